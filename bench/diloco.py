"""Benchmark of DiLoCo (`ttt train --local-steps H`) against the synchronous run, on this machine, in one run.

Two `ttt train` peers of the tiny preset on the embedded sample (127.0.0.1), as many rows as each peer processes
samples (1,600 per outer step: a peer sees each row about once, so the run cannot learn the rows by heart), the run's
defaults (--batch-size 16, --target-batch-size 64), each peer processing the same number of samples in every mode:
synchronous (a gradient round every global step, about two batches per peer); --local-steps 10 and 100 as DiLoCo
runs by default (4-bit pseudo-gradients with error feedback, rounds overlapped with the next inner steps); and at
H=100 the 1-bit and 8-bit pseudo-gradients and the rounds that stop training (--outer-bits 8, --no-outer-overlap),
alone and together (the DiLoCo of earlier versions). For each mode:

- bytes each peer sent to the other per training sample, as the peer prints them when it finishes: what its
  averagers sent in averaging rounds (all-reduce parts and results: the traffic of every step of a run), and in
  all, with the states it served (the second peer's join, and downloads of a peer that fell behind; DiLoCo sends
  them uncompressed, as a newcomer needs the others' very bits); each as a ratio to the synchronous run;
- the final loss on held-out layouts: the final checkpoint's mean loss on images of the sample's held-out layouts
  (pipeline/sample/domain.py's `is_heldout_layout`: no row of any sample shows one; rendered and encoded as `ttt
  preprocess` stores the sample's, the same for all modes), and its ratio to the synchronous run's; and its loss on
  the training rows (how well it fits what it saw, beside how well it composes what it did not);
- each peer's share of its training time spent computing: forward and backward and optimizer steps (the rest:
  waiting for rounds and peers, loading batches), as the peer prints it when it finishes;
- the share of images the sample judge accepts for the seen prompts (top-k 64, a few per prompt).

Each run's learning-rate schedule spans its run (--total-steps: global steps, or inner steps with DiLoCo); every
mode matchmakes for 1 s (the default 5 s would make the synchronous run's 100 rounds slow, not change the bytes).
The goals (issue 35): at least 200x fewer averaging bytes per sample than the synchronous run at H=100 (800x
than fp32 gradients every step: the synchronous run's bytes times the model's fp32 bytes over its 8-bit and fp16
ones), with a held-out loss within 5% of the synchronous run's.

With --rows N the sample holds N rows instead (a run of many outer steps then sees each row several times: writing
32,000 rows would take about half an hour here); the held-out layouts stay unseen whatever the rows.

With --outer LR,MOMENTUM (repeatable) it compares outer steps instead: the synchronous run, the default
(--outer-lr 1 --outer-momentum 0: the peers' mean) and H=100 with each outer step given (0.7,0.9: the DiLoCo
papers' Nesterov step).

    .venv/bin/python -m bench.diloco [--outer-steps 2] [--quick] [--rows 3200] [--outer 1,0]
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench.common import save_results
from inference.generate import open_checkpoint
from inference.sample_quality import SEEN_PROMPTS, judge_acceptance
from inference.settings import SamplingSettings
from pipeline.core.stream import CodeStream
from pipeline.preprocess.run import SAMPLE_IMAGE_SIZE
from pipeline.vqgan.codec import encode, images_to_tensor, load_vqgan, sample_vqgan_spec
from pipeline.vqgan.train import SampleImages
from tests.support.datasets import write_sample
from tests.support.swarm_runs import SwarmRun
from training.checkpoint import Checkpoint, latest_checkpoint
from training.config import COMPRESSION_THRESHOLD

console = Console(width=170)
BATCH, TARGET, PEERS = 16, 64, 2
MODES = {  # label: --local-steps and the options of the mode
    "synchronous": (0, []),
    "--local-steps 10": (10, []),
    "--local-steps 100 --outer-bits 8 --no-outer-overlap": (100, ["--outer-bits", "8", "--no-outer-overlap"]),
    "--local-steps 100 --outer-bits 8": (100, ["--outer-bits", "8"]),
    "--local-steps 100 --no-outer-overlap": (100, ["--no-outer-overlap"]),
    "--local-steps 100 --outer-bits 1": (100, ["--outer-bits", "1"]),
    "--local-steps 100": (100, []),
}
LARGEST_H = 100
DEFAULT = "--local-steps 100"  # the mode the goals are for
QUICK_MODES = ["synchronous", "--local-steps 100 --outer-bits 1", DEFAULT]
SENT = re.compile(r"sent ([\d,]+) bytes to other peers \(averaging ([\d,]+), states served ([\d,]+)")
COMPUTING = re.compile(r"computing (\d+)% of the time")
HELD_OUT_IMAGES = 512  # images of held-out layouts
JUDGE_SAMPLES = 4  # images per seen prompt
PEER_ARGS = [
    "--batch-size", str(BATCH), "--target-batch-size", str(TARGET), "--threads", "1", "--loader-workers", "0",
    "--matchmaking-time", "1", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
]  # fmt: skip


def outer_step_modes(outer_steps: list[tuple[str, str]]) -> dict[str, tuple[int, list[str]]]:
    """The synchronous run, the default and DiLoCo at H=100 with each outer step given as (LR, MOMENTUM)."""
    modes = {label: MODES[label] for label in ("synchronous", DEFAULT)}
    for lr, momentum in outer_steps:
        modes[f"{DEFAULT} --outer-lr {lr} --outer-momentum {momentum}"] = (
            LARGEST_H,
            ["--outer-lr", lr, "--outer-momentum", momentum],
        )
    return modes


def outer_step(text: str) -> tuple[str, str]:
    """--outer's "LR,MOMENTUM" as the two option values (argparse reports a ValueError as an invalid value)."""
    lr, momentum = text.split(",")
    float(lr), float(momentum)
    return lr, momentum


def train(dataset: Path, folder: Path, label: str, mode_options: tuple[int, list[str]], inner_steps: int) -> dict:
    """Two peers processing `inner_steps` batches each: synchronously (local_steps 0) or with DiLoCo."""
    local_steps, options = mode_options
    if local_steps:
        mode = ["--local-steps", str(local_steps), "--max-steps", str(inner_steps // local_steps), *options]
        schedule = inner_steps
    else:
        global_steps = inner_steps * BATCH * PEERS // TARGET
        mode, schedule = ["--max-steps", str(global_steps)], global_steps
    run = SwarmRun(folder, ["--dataset", str(dataset), "--run-id", f"diloco-{folder.name}", *PEER_ARGS, *mode])
    started = time.perf_counter()
    run.start("a", "--wait-for-peers", "2", "--total-steps", str(schedule))
    run.start("b", "--total-steps", str(schedule))
    logs = run.finish(timeout=1800)
    seconds = time.perf_counter() - started
    for log in logs.values():
        if log.returncode != 0:
            raise SystemExit(f"peer {log.name} failed:\n{log.text}")
    sent = [[int(n.replace(",", "")) for n in SENT.search(log.text).groups()] for log in logs.values()]
    samples = [log.contributed for log in logs.values()]
    return {
        "mode": label,
        "samples_per_peer": samples,
        "compute_share_per_peer": [int(COMPUTING.search(log.text).group(1)) / 100 for log in logs.values()],
        "bytes_sent_per_peer": [total for total, _, _ in sent],
        "averaging_bytes_per_peer": [averaging for _, averaging, _ in sent],
        "bytes_per_sample": sum(total for total, _, _ in sent) / sum(samples),
        "averaging_bytes_per_sample": sum(averaging for _, averaging, _ in sent) / sum(samples),
        "seconds": seconds,
        "checkpoint": str(latest_checkpoint(folder / "a")),
    }


def batches(dataset: Path, config) -> CodeStream:
    """One pass over the dataset's rows, 32 at a time, in a fixed order."""
    return CodeStream(
        dataset, batch_size=32, text_len=config.text_len, codebook_size=config.codebook_size,
        grid=(config.grid, config.grid), num_workers=0, seed=1234, epochs=1,
    )  # fmt: skip


@torch.no_grad()
def held_out_layouts(checkpoint: Checkpoint, vqgan: torch.nn.Module) -> list[dict]:
    """HELD_OUT_IMAGES images of the sample's held-out layouts with their captions, as batches of 32 like the
    stream's: the images as `ttt preprocess` stores the sample's, encoded by the sample VQGAN."""
    images, captions = SampleImages(SAMPLE_IMAGE_SIZE, seed=1234).heldout_set(HELD_OUT_IMAGES)
    text = torch.from_numpy(checkpoint.tokenizer.encode_batch(captions, checkpoint.model.config.text_len))
    codes = torch.cat([encode(vqgan, images_to_tensor(images[i : i + 32])) for i in range(0, len(images), 32)])
    codes = codes.flatten(1)
    return [{"text": text[i : i + 32], "codes": codes[i : i + 32]} for i in range(0, len(images), 32)]


@torch.no_grad()
def eval_loss(model: torch.nn.Module, rows: list[dict]) -> float:
    """A checkpoint's model's mean loss per row on `rows`."""
    model = model.float().eval()
    total = sum(model(batch["text"], batch["codes"])["loss"].item() * len(batch["text"]) for batch in rows)
    return total / sum(len(batch["text"]) for batch in rows)


def fp32_over_compressed(model: torch.nn.Module) -> float:
    """fp32 bytes of the model's gradients over what the synchronous run sends: 8 bits for tensors of at least
    COMPRESSION_THRESHOLD values, fp16 for the rest (metadata aside)."""
    parameters = list(model.parameters())
    compressed = sum(p.numel() * (1 if p.numel() >= COMPRESSION_THRESHOLD else 2) for p in parameters)
    return sum(4 * p.numel() for p in parameters) / compressed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--outer-steps", type=int, default=2, help="Outer steps at the largest H (100).")
    parser.add_argument("--quick", action="store_true", help="Only synchronous, 1-bit DiLoCo and today's default.")
    parser.add_argument("--rows", type=int, help="Rows of the sample (default: as many as a peer processes).")
    parser.add_argument(
        "--outer", action="append", type=outer_step, metavar="LR,MOMENTUM",
        help="Compare outer steps instead: the synchronous run, the default and DiLoCo at H=100 with this outer "
        "learning rate and momentum (repeatable).",
    )  # fmt: skip
    args = parser.parse_args()
    if args.outer:
        modes = outer_step_modes(args.outer)
    else:
        modes = {label: MODES[label] for label in (QUICK_MODES if args.quick else MODES)}
    started = time.perf_counter()
    inner_steps = LARGEST_H * args.outer_steps
    vqgan = load_vqgan(sample_vqgan_spec(), torch.device("cpu"))
    judging = SamplingSettings(top_k=64, top_p=1.0)
    with tempfile.TemporaryDirectory() as tmp:
        dataset = Path(tmp) / "sample"
        write_sample(dataset, args.rows or inner_steps * BATCH)
        runs, rows, training_rows, fp32_factor = [], None, None, None
        for number, (label, mode_options) in enumerate(modes.items()):
            console.print(f"training: {label}")
            run = train(dataset, Path(tmp) / f"run-{number}", label, mode_options, inner_steps)
            checkpoint = open_checkpoint(run["checkpoint"], torch.device("cpu"))
            rows = rows or held_out_layouts(checkpoint, vqgan)
            training_rows = training_rows or [dict(batch) for batch in batches(dataset, checkpoint.model.config)]
            fp32_factor = fp32_factor or fp32_over_compressed(checkpoint.model)
            run["held_out_loss"] = eval_loss(checkpoint.model, rows)
            run["training_loss"] = eval_loss(checkpoint.model, training_rows)
            run["seen_accepted"] = judge_acceptance(checkpoint, vqgan, SEEN_PROMPTS, JUDGE_SAMPLES, judging).share
            runs.append(run)
    training_rows_count = sum(len(batch["text"]) for batch in training_rows)
    title = (
        f"2 peers, {inner_steps * BATCH:,} samples each (batch {BATCH}, target {TARGET}) from {training_rows_count:,} "
        f"training rows; held-out loss on {HELD_OUT_IMAGES} images of held-out layouts; vs fp32: the synchronous "
        f"bytes x {fp32_factor:.2f}"
    )
    print_table(runs, title, fp32_factor)
    default = next(run for run in runs if run["mode"] == DEFAULT)
    goal = default["averaging_bytes_ratio"] >= 200 and default["fp32_ratio"] >= 800 and default["loss_ratio"] <= 1.05
    console.print(
        f"goal (at H=100: >= 200x fewer averaging bytes than synchronous, >= 800x than fp32, held-out loss within "
        f"5%): {'met' if goal else 'NOT met'}"
    )
    save_results("diloco", {"runs": runs, "fp32_factor": fp32_factor, "goal_met": goal}, started, console)


def print_table(runs: list[dict], title: str, fp32_factor: float) -> None:
    """Each mode's bytes, loss, judge and time, with their ratios to the synchronous run (the first)."""
    sync = runs[0]
    table = Table(title=title)
    columns = ("mode", "averaging bytes per sample", "vs synchronous", "vs fp32", "all bytes per sample",
               "held-out loss", "vs synchronous", "training rows' loss", "judge accepts (seen)", "computing",
               "seconds")  # fmt: skip
    for column in columns:
        table.add_column(column, no_wrap=column == "mode")
    for run in runs:
        run["averaging_bytes_ratio"] = sync["averaging_bytes_per_sample"] / run["averaging_bytes_per_sample"]
        run["fp32_ratio"] = run["averaging_bytes_ratio"] * fp32_factor
        run["bytes_ratio"] = sync["bytes_per_sample"] / run["bytes_per_sample"]
        run["loss_ratio"] = run["held_out_loss"] / sync["held_out_loss"]
        table.add_row(
            run["mode"],
            f"{run['averaging_bytes_per_sample']:,.0f}",
            f"{run['averaging_bytes_ratio']:,.1f}x fewer",
            f"{run['fp32_ratio']:,.0f}x fewer",
            f"{run['bytes_per_sample']:,.0f}",
            f"{run['held_out_loss']:.4f}",
            f"{run['loss_ratio']:.3f}",
            f"{run['training_loss']:.4f}",
            f"{run['seen_accepted']:.0%}",
            " / ".join(f"{share:.0%}" for share in run["compute_share_per_peer"]),
            f"{run['seconds']:.0f}",
        )
    console.print(table)


if __name__ == "__main__":
    main()
