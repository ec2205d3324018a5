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

3. Step profile (--step-profile): where one cached sampling step of the small preset goes, at the image's middle
   position: its wall time (layers and logits; the draw timed apart), the time the device spends in the step's
   kernels and how many it launches (torch.profiler), and on CUDA the same step replayed as the CUDA graph that
   sampling uses there (`CachedStep`), which takes the host's launching out of the step. Wall time far above
   kernel time means the step waits on the host.

Prints tables and writes every figure to bench/results/generate.json (generate-cuda.json on a GPU).

    .venv/bin/python -m bench.generate [--checkpoint ckpt/ --checkpoint other/ckpt] [--samples-per-prompt 16]
    .venv/bin/python -m bench.generate --device cuda --step-profile [--skip-speed]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

from bench.common import median_seconds, save_results, synchronize, timed
from inference.generate import inference_dtype, open_checkpoint
from inference.sample_quality import HELDOUT_PROMPTS, SEEN_PROMPTS, judge_acceptance
from inference.sampling import CachedStep, recomputed_logits, sample_codes, sample_next, sampling_attention
from inference.settings import SamplingSettings
from pipeline.core.devices import pick_device
from pipeline.vqgan.codec import load_vqgan, sample_vqgan_spec
from training.config import PRESETS
from training.model import DalleTransformer, KVCache

SPEED_RUNS = [("tiny", 1), ("tiny", 8), ("small", 1), ("small", 8)]
SAMPLED_POSITIONS = 16
PROFILED_BATCHES = (1, 8)
PROFILE_REPEATS = 50
MIN_SECONDS = 3.0  # repeat short measurements for at least this long
PLAIN = SamplingSettings(top_p=1.0)  # what the speed figures sample with
QUALITY_SAMPLINGS = {
    "plain (temperature 1)": SamplingSettings(top_p=1.0),
    "top-k 64": SamplingSettings(top_k=64, top_p=1.0),
    "top-p 0.75": SamplingSettings(top_p=0.75),
}

console = Console(width=130)


def warm_median_seconds(work: Callable[[], object], device: torch.device, repeats: int = PROFILE_REPEATS) -> float:
    """`median_seconds` of `work` after one unmeasured run, which meets new shapes and allocations first."""
    work()
    return median_seconds(work, repeats, device)


def cached_rate(model: DalleTransformer, text: torch.Tensor) -> float:
    """Codes/s of a whole image sampled with the cache."""
    generator = torch.Generator(text.device).manual_seed(0)
    runs, seconds = timed(lambda: sample_codes(model, text, PLAIN, generator), MIN_SECONDS)
    return runs * text.shape[0] * model.config.image_tokens / seconds


@torch.no_grad()
def uncached_rate(model: DalleTransformer, text: torch.Tensor, full: bool) -> tuple[float, bool]:
    """Codes/s without the cache: every step runs the whole prefix (sample_codes(use_cache=False)).

    Returns (rate, measured in full). When not in full, the step is timed at evenly spaced positions, as sampling
    runs it (in `sampling_attention`), each once after a run that meets its length for the first time.
    """
    config = model.config
    if full or config.image_tokens <= 64:
        generator = torch.Generator(text.device).manual_seed(0)
        runs, seconds = timed(lambda: sample_codes(model, text, PLAIN, generator, use_cache=False), MIN_SECONDS)
        return runs * text.shape[0] * config.image_tokens / seconds, True
    codes = torch.zeros(text.shape[0], config.image_tokens, dtype=torch.long, device=text.device)
    positions = torch.linspace(0, config.image_tokens - 1, SAMPLED_POSITIONS).round().long().tolist()
    with sampling_attention(text.device):
        step_seconds = [
            warm_median_seconds(lambda p=position: recomputed_logits(model, text, codes, p), text.device, repeats=1)
            for position in positions
        ]
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


def kernel_time_and_launches(work: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """Seconds the device spends in kernels per run of `work`, and kernels launched per run (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            work()
        synchronize(device)
    kernels = [event for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    return sum(event.time_range.elapsed_us() for event in kernels) / 1e6 / 10, len(kernels) / 10


@torch.no_grad()
def profile_cached_step(model: DalleTransformer, batch: int, device: torch.device) -> dict:
    """One cached step at the image's middle position (see the module's docstring, part 3): the step run as it
    is (`CachedStep.run`) and, on CUDA, replayed as the CUDA graph that sampling uses (`CachedStep`)."""
    config = model.config
    text = torch.randint(0, 256, (batch, config.text_len), device=device)
    cache = KVCache(config, batch, device, next(model.parameters()).dtype)
    code = torch.randint(0, config.codebook_size, (batch, 1), device=device)
    position = config.text_len + config.image_tokens // 2
    generator = torch.Generator(device).manual_seed(0)
    with sampling_attention(device):
        model.run_layers(model.text_embedding(text), cache)
        cache.keys.normal_(), cache.values.normal_()  # stands for the codes before the middle
        step = CachedStep(model, cache)
        logits = step(code, position)
        row = {"batch": batch, "position": position}
        row["step_seconds"] = warm_median_seconds(lambda: step.run(keys=position + 1), device)
        row["draw_seconds"] = warm_median_seconds(lambda: sample_next(logits, PLAIN, generator), device)
        if device.type == "cuda":
            row["kernel_seconds"], row["kernels"] = kernel_time_and_launches(lambda: step.run(position + 1), device)
            row["graph_seconds"] = warm_median_seconds(lambda: step(code, position), device)
    return row


def bench_step_profile(device: torch.device, preset: str = "small") -> list[dict]:
    torch.manual_seed(0)
    model = DalleTransformer(PRESETS[preset].model).eval().to(device, inference_dtype(device))
    rows = [profile_cached_step(model, batch, device) for batch in PROFILED_BATCHES]
    table = Table(title=f"one cached sampling step of the {preset} preset on {device} (ms; codes/s = batch / step)")
    columns = ("batch", "step", "draw", "kernels' time", "kernels", "CUDA graph", "codes/s eager", "codes/s graph")
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        graph = row.get("graph_seconds")
        table.add_row(
            str(row["batch"]), f"{row['step_seconds'] * 1e3:.2f}", f"{row['draw_seconds'] * 1e3:.2f}",
            f"{row['kernel_seconds'] * 1e3:.2f}" if "kernel_seconds" in row else "",
            f"{row['kernels']:.0f}" if "kernels" in row else "",
            f"{graph * 1e3:.2f}" if graph else "",
            f"{row['batch'] / (row['step_seconds'] + row['draw_seconds']):,.0f}",
            f"{row['batch'] / (graph + row['draw_seconds']):,.0f}" if graph else "",
        )  # fmt: skip
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
    parser.add_argument("--step-profile", action="store_true", help="Where a cached sampling step's time goes.")
    args = parser.parse_args()
    started = time.perf_counter()
    device = torch.device(pick_device(args.device))
    results = {"device": str(device), "threads": torch.get_num_threads()}
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
    if not args.skip_speed:
        results["speed"] = bench_speed(device, args.full)
    if args.step_profile:
        results["step_profile"] = bench_step_profile(device)
    if args.checkpoint:
        results["quality"] = bench_quality(args.checkpoint, args.samples_per_prompt, device)
    save_results("generate" if device.type == "cpu" else f"generate-{device.type}", results, started, console)


if __name__ == "__main__":
    main()
