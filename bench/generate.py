"""Benchmark of `ttt generate` on this machine, all in one run.

1. Speed: image codes sampled per second with the key/value cache against recomputing the
   whole prefix at every step (what sampling without a cache does), for the tiny preset (64
   codes) and the small preset (1024 codes, 256 px images; random weights: speed does not
   depend on them). Tiny is timed in full both ways. For small without the cache, a full
   image takes tens of minutes on a CPU, so the step is timed at 16 evenly spaced positions
   and the image's time is their mean x 1024 (the step cost grows smoothly with the position;
   pass --full to time every step).
2. Quality (with --checkpoint, repeatable): the share of images the sample judge accepts for
   the 16 held-out and the 16 seen prompts of the sample domain, with plain sampling, top-k and
   top-p, each with its 95% confidence interval (inference/sample_quality.py's `Acceptance`).

Prints tables and writes every figure to bench/results/generate.json.

    .venv/bin/python -m bench.generate [--checkpoint ckpt/ --checkpoint other/ckpt] [--samples-per-prompt 16]
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from bench.common import save_results, timed
from inference.generate import inference_dtype, open_checkpoint
from inference.sample_quality import HELDOUT_PROMPTS, SEEN_PROMPTS, judge_acceptance
from inference.sampling import recomputed_logits, sample_codes
from inference.settings import SamplingSettings
from pipeline.core.devices import pick_device
from pipeline.vqgan.codec import load_vqgan, sample_vqgan_spec
from training.config import PRESETS
from training.model import DalleTransformer

SPEED_RUNS = [("tiny", 1), ("tiny", 8), ("small", 1), ("small", 8)]
SAMPLED_POSITIONS = 16
MIN_SECONDS = 3.0  # repeat short measurements for at least this long
PLAIN = SamplingSettings(top_p=1.0)  # what the speed figures sample with
QUALITY_SAMPLINGS = {
    "plain (temperature 1)": SamplingSettings(top_p=1.0),
    "top-k 64": SamplingSettings(top_k=64, top_p=1.0),
    "top-p 0.75": SamplingSettings(top_p=0.75),
}

console = Console(width=130)


def cached_rate(model: DalleTransformer, text: torch.Tensor) -> float:
    """Codes/s of a whole image sampled with the cache."""
    generator = torch.Generator(text.device).manual_seed(0)
    runs, seconds = timed(lambda: sample_codes(model, text, PLAIN, generator), MIN_SECONDS)
    return runs * text.shape[0] * model.config.image_tokens / seconds


@torch.no_grad()
def uncached_rate(model: DalleTransformer, text: torch.Tensor, full: bool) -> tuple[float, bool]:
    """Codes/s without the cache: every step runs the whole prefix (sample_codes(use_cache=False)).

    Returns (rate, measured in full). When not in full, the step is timed at evenly spaced positions.
    """
    config = model.config
    if full or config.image_tokens <= 64:
        generator = torch.Generator(text.device).manual_seed(0)
        runs, seconds = timed(lambda: sample_codes(model, text, PLAIN, generator, use_cache=False), MIN_SECONDS)
        return runs * text.shape[0] * config.image_tokens / seconds, True
    codes = torch.zeros(text.shape[0], config.image_tokens, dtype=torch.long, device=text.device)
    positions = torch.linspace(0, config.image_tokens - 1, SAMPLED_POSITIONS).round().long().tolist()
    step_seconds = []
    for position in positions:
        _, seconds = timed(lambda p=position: recomputed_logits(model, text, codes, p))
        step_seconds.append(seconds)
    image_seconds = sum(step_seconds) / len(step_seconds) * config.image_tokens
    return text.shape[0] * config.image_tokens / image_seconds, False


def bench_speed(device: torch.device, full: bool) -> list[dict]:
    table = Table(title=f"sampling speed on {device} (image codes/s; text prefill included)")
    for column in ("preset", "codes per image", "batch", "with KV cache", "without cache", "speed-up"):
        table.add_column(column, justify="right")
    rows = []
    for preset, batch in SPEED_RUNS:
        torch.manual_seed(0)
        model = DalleTransformer(PRESETS[preset].model).eval().to(device, inference_dtype(device))
        text = torch.randint(0, 256, (batch, model.config.text_len), device=device)
        with_cache = cached_rate(model, text)
        without_cache, measured = uncached_rate(model, text, full)
        row = {
            "preset": preset,
            "codes": model.config.image_tokens,
            "batch": batch,
            "cached": with_cache,
            "uncached": without_cache,
            "uncached_measured_in_full": measured,
        }
        rows.append(row)
        note = "" if measured else f" (from {SAMPLED_POSITIONS} positions)"
        table.add_row(
            preset,
            str(row["codes"]),
            str(batch),
            f"{with_cache:,.1f}",
            f"{without_cache:,.2f}{note}",
            f"{with_cache / without_cache:,.1f}x",
        )
    console.print(table)
    return rows


def bench_quality(checkpoints: list[str], samples_per_prompt: int, device: torch.device) -> list[dict]:
    vqgan = load_vqgan(sample_vqgan_spec(), device)
    table = Table(title=f"share of images the sample judge accepts ({samples_per_prompt} per prompt)")
    for column in ("checkpoint", "global step", "sampling", "held-out prompts", "seen prompts"):
        table.add_column(column)
    rows = []
    for checkpoint in checkpoints:
        loaded = open_checkpoint(checkpoint, device)
        loaded.model.to(inference_dtype(device))
        for name, sampling in QUALITY_SAMPLINGS.items():
            heldout = judge_acceptance(loaded, vqgan, HELDOUT_PROMPTS, samples_per_prompt, sampling)
            seen = judge_acceptance(loaded, vqgan, SEEN_PROMPTS, samples_per_prompt, sampling)
            rows.append(
                {
                    "checkpoint": checkpoint,
                    "step": loaded.step,
                    "sampling": name,
                    "heldout": heldout.share,
                    "heldout_interval": heldout.interval(),
                    "seen": seen.share,
                    "seen_interval": seen.interval(),
                    "heldout_per_prompt": heldout.accepted,
                    "seen_per_prompt": seen.accepted,
                }
            )
            table.add_row(
                checkpoint,
                str(loaded.step),
                name,
                heldout.summary(),
                seen.summary(),
            )
    console.print(table)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", action="append", default=[], help="Checkpoint to judge (repeatable).")
    parser.add_argument("--samples-per-prompt", type=int, default=16)
    parser.add_argument("--full", action="store_true", help="Time every uncached step of the 1024-code model.")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    device = torch.device(pick_device(args.device))
    results = {"device": str(device), "threads": torch.get_num_threads()}
    if not args.skip_speed:
        results["speed"] = bench_speed(device, args.full)
    if args.checkpoint:
        results["quality"] = bench_quality(args.checkpoint, args.samples_per_prompt, device)
    save_results("generate", results, started, console)


if __name__ == "__main__":
    main()
