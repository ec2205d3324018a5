"""Does the tiny model compose what it never saw, given more training? Held-out acceptance against training length.

The demo's model in one process (no swarm): the tiny preset with the sample's word tokenizer, `ttt train`'s
optimizer, learning rate, weight decay and clipping, global batches of 64 and the paper's schedule over the run's
length, trained from seed 0 on a `ttt preprocess` output of the embedded sample. After each run the sample judge
scores images of the 16 seen and the 16 held-out prompts, sampled as `ttt generate` does (top-p 0.75), with 95%
intervals (inference/sample_quality.py). One run per (dataset, steps): the demo trains 200 global steps on the
default 1,200-row sample; longer runs and larger samples say whether the held-out gap is one of compute or data.
A second table sorts the held-out images by what the judge found wrong (the two shapes swapped, other shapes or
colours, a shape too many or too few), for the held-out prompts whose swapped layout (the same two shapes the other
way round) is among the training rows, and for those whose two shapes the rows never show together on that axis.

    PYTHONPATH=. python -m bench.generalisation --data ttt-data [--data big-data] [--steps 200,800,3200]
                                                [--device cuda] [--samples-per-prompt 8]

Writes its figures to bench/results/generalisation.json. On 2 CPU cores a step takes about 0.8 s (800 in 664 s).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench.common import save_results
from inference.sample_quality import HELDOUT_PROMPTS, SEEN_PROMPTS, Acceptance, judge_acceptance
from inference.settings import SamplingSettings
from pipeline.core.devices import pick_device
from pipeline.core.stream import CodeStream
from pipeline.core.text import load_tokenizer
from pipeline.sample.domain import layout, swapped_layout
from pipeline.sample.judge import Verdict, parse_caption
from pipeline.sample.tokenizer import TOKENIZER_PATH
from pipeline.vqgan.codec import load_vqgan, sample_vqgan_spec
from training.checkpoint import Checkpoint
from training.config import DEFAULT_OPTIMIZER, PRESETS, RunSettings, model_config
from training.model import DalleTransformer
from training.optimizer import linear_schedule, make_optimizer

BATCH = RunSettings.target_batch_size  # the demo's global batch
FAILURE_KINDS = ("accepted", "the two shapes swapped", "other shapes or colours", "a shape too many or too few")
SWAP_SEEN, PAIR_UNSEEN = "the swapped layout in the rows", "pair never together on that axis"  # held-out prompts
console = Console(width=130)


def stream(data: Path, config, epochs: int | None) -> CodeStream:
    """The dataset's rows, shuffled, tokenized with the sample's word tokenizer; endless in full batches, or every
    row of `epochs` passes."""
    return CodeStream(
        data, batch_size=BATCH, text_len=config.text_len, codebook_size=config.codebook_size,
        grid=(config.grid, config.grid), tokenizer=str(TOKENIZER_PATH), seed=0, drop_last=epochs is None,
        epochs=epochs,
    )  # fmt: skip


def batches(data: Path, config, device: torch.device):
    for batch in stream(data, config, epochs=None):
        yield batch["text"].to(device), batch["codes"].to(device)


def train(data: Path, steps: int, device: torch.device) -> tuple[DalleTransformer, float, float]:
    """The tiny preset trained `steps` global steps; returns the model, the last 10 steps' mean loss and seconds."""
    config = model_config("tiny", str(TOKENIZER_PATH))
    torch.manual_seed(0)
    model = DalleTransformer(config).to(device)
    optimizer = make_optimizer(
        DEFAULT_OPTIMIZER, model.parameters(), lr=PRESETS["tiny"].peak_learning_rate(DEFAULT_OPTIMIZER),
        weight_decay=RunSettings.weight_decay, max_grad_norm=RunSettings.max_grad_norm,
    )  # fmt: skip
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_schedule(steps))
    losses, started = [], time.perf_counter()
    for _, (text, codes) in zip(range(steps), batches(data, config, device), strict=False):
        loss = model(text, codes)["loss"]
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    last = torch.stack(losses[-10:]).mean().item()
    return model.eval(), last, time.perf_counter() - started


def judged(model: DalleTransformer, steps: int, vqgan, samples_per_prompt: int) -> dict[str, Acceptance]:
    checkpoint = Checkpoint(model, {"step": steps}, load_tokenizer(str(TOKENIZER_PATH)))
    judge = {"samples_per_prompt": samples_per_prompt, "sampling": SamplingSettings()}
    return {
        "seen": judge_acceptance(checkpoint, vqgan, SEEN_PROMPTS, **judge),
        "held out": judge_acceptance(checkpoint, vqgan, HELDOUT_PROMPTS, **judge),
    }


def share(acceptance: Acceptance) -> str:
    low, high = acceptance.interval()
    return f"{acceptance.share:.0%} ({low:.0%}-{high:.0%})"


def dataset_captions(data: Path) -> list[str]:
    """The captions of the rows a run reads from `data` (after the stream's filters)."""
    config = model_config("tiny", str(TOKENIZER_PATH))
    return [caption for batch in stream(data, config, epochs=1) for caption in batch["caption"]]


def failure_kind(verdict: Verdict) -> str:
    """What the judge found wrong with an image, in one of FAILURE_KINDS (from the reasons `judge` gives)."""
    if verdict.match:
        return "accepted"
    if any(reason.startswith("the ") for reason in verdict.reasons):
        return "the two shapes swapped"  # both there, the relation the other way round
    if any(reason.startswith("no ") for reason in verdict.reasons):
        return "other shapes or colours"
    return "a shape too many or too few"


def held_out_failures(held_out: Acceptance, captions: list[str]) -> dict[str, dict[str, int]]:
    """The held-out images by what went wrong, for the prompts whose swapped layout (the same two shapes the other way
    round) is among the training rows and for those whose two shapes never appear together on that axis."""
    seen = {layout(scene) for scene in map(parse_caption, captions) if scene is not None and scene.second is not None}
    kinds: dict[str, Counter] = {SWAP_SEEN: Counter(), PAIR_UNSEEN: Counter()}
    for prompt, verdicts in held_out.verdicts.items():
        group = SWAP_SEEN if swapped_layout(parse_caption(prompt)) in seen else PAIR_UNSEEN
        kinds[group].update(failure_kind(verdict) for verdict in verdicts)
        kinds[group]["prompts"] += 1
    return {group: dict(counts) for group, counts in kinds.items()}


def measure(data: Path, captions: list[str], steps: int, device: torch.device, vqgan, samples_per_prompt: int) -> dict:
    """One run: trained `steps` steps on `data` (rows with `captions`), then judged."""
    model, loss, seconds = train(data, steps, device)
    scores = judged(model, steps, vqgan, samples_per_prompt)
    console.print(f"{data.name} {steps} steps: seen {share(scores['seen'])}, held out {share(scores['held out'])}")
    return {
        "dataset": str(data), "rows": len(captions), "steps": steps, "last_loss": loss, "train_seconds": seconds,
        "scores": {name: {"share": a.share, "interval": a.interval(), "accepted": a.accepted}
                   for name, a in scores.items()},
        "shown": {name: share(a) for name, a in scores.items()},
        "held_out_failures": held_out_failures(scores["held out"], captions),
    }  # fmt: skip


def failures_table(runs: list[dict]) -> Table:
    table = Table(title="held-out images by what the judge found (prompts: their count)")
    for column in ("dataset", "steps", "held-out prompts", "prompts", *FAILURE_KINDS):
        table.add_column(column, justify="right")
    for run in runs:
        for group, counts in run["held_out_failures"].items():
            cells = [str(counts.get(kind, 0)) for kind in ("prompts", *FAILURE_KINDS)]
            table.add_row(Path(run["dataset"]).name, str(run["steps"]), group, *cells)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, action="append", required=True, help="A `ttt preprocess` output.")
    parser.add_argument("--steps", default="200,800,3200", help="Training lengths, comma-separated.")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    args = parser.parse_args()
    started = time.perf_counter()
    device = torch.device(pick_device(args.device))
    vqgan = load_vqgan(sample_vqgan_spec(), device)
    steps = [int(s) for s in args.steps.split(",")]
    captions = {data: dataset_captions(data) for data in args.data}
    runs = [
        measure(data, captions[data], n, device, vqgan, args.samples_per_prompt) for data in args.data for n in steps
    ]
    table = Table(title=f"the tiny preset alone, batch {BATCH}, on {device}: the judge's acceptance (95% CI)")
    for column in ("dataset", "rows", "steps", "passes", "last loss", "train s", "seen", "held out"):
        table.add_column(column, justify="right")
    for run in runs:
        table.add_row(
            Path(run["dataset"]).name, f"{run['rows']:,}", str(run["steps"]),
            f"{run['steps'] * BATCH / run['rows']:.1f}", f"{run['last_loss']:.3f}", f"{run['train_seconds']:.0f}",
            run["shown"]["seen"], run["shown"]["held out"],
        )  # fmt: skip
    console.print(table)
    console.print(failures_table(runs))
    results = {"device": str(device), "runs": runs}
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
    save_results("generalisation", results, started, console)


if __name__ == "__main__":
    main()
