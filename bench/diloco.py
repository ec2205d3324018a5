"""Benchmark of DiLoCo (`ttt train --local-steps H`) against the synchronous run, on this machine, in one run.

Two `ttt train` peers of the tiny preset on the embedded sample (127.0.0.1), the run's defaults (--batch-size 16,
--target-batch-size 64), each peer processing the same number of samples in every mode: synchronous (a gradient
round every global step, about two batches per peer) and --local-steps 10, 50 and 100. For each mode:

- bytes each peer sent to the other per training sample, as the peer prints them when it finishes: what its
  averagers sent in averaging rounds (all-reduce parts and results: the traffic of every step of a run), and in
  all, with the states it served (the second peer's join, and downloads of a peer that fell behind; DiLoCo sends
  them uncompressed, as a newcomer needs the others' very bits); each as a ratio to the synchronous run;
- the final loss: the final checkpoint's mean loss on a fixed set of the sample's batches (the same for all modes),
  and its ratio to the synchronous run's;
- the share of images the sample judge accepts for the seen prompts (top-k 64, a few per prompt).

Each run's learning-rate schedule spans its run (--total-steps: global steps, or inner steps with DiLoCo); every
mode matchmakes for 1 s (the default 5 s would make the synchronous run's 100 rounds slow, not change the bytes).
The goal: at least 50x fewer averaging bytes per sample at H=100, with a final loss within 10% of the synchronous
run's.

    .venv/bin/python -m bench.diloco [--outer-steps 2]
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
from pipeline.vqgan.codec import load_vqgan, sample_vqgan_spec
from tests.support.datasets import write_sample
from tests.support.swarm_runs import SwarmRun
from training.checkpoint import latest_checkpoint

console = Console(width=130)
BATCH, TARGET, PEERS = 16, 64, 2
LOCAL_STEPS = (10, 50, 100)
SENT = re.compile(r"sent ([\d,]+) bytes to other peers \(averaging ([\d,]+), states served ([\d,]+)")
EVAL_BATCHES = 8  # of 32 samples, fixed: what each final checkpoint's loss is measured on
JUDGE_SAMPLES = 4  # images per seen prompt
PEER_ARGS = [
    "--batch-size", str(BATCH), "--target-batch-size", str(TARGET), "--threads", "1", "--loader-workers", "0",
    "--matchmaking-time", "1", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
]  # fmt: skip


def train(dataset: Path, folder: Path, local_steps: int, inner_steps: int) -> dict:
    """Two peers processing `inner_steps` batches each: synchronously (local_steps 0) or with DiLoCo."""
    if local_steps:
        mode = ["--local-steps", str(local_steps), "--max-steps", str(inner_steps // local_steps)]
        schedule = inner_steps
    else:
        global_steps = inner_steps * BATCH * PEERS // TARGET
        mode, schedule = ["--max-steps", str(global_steps)], global_steps
    run = SwarmRun(folder, ["--dataset", str(dataset), "--run-id", f"diloco-{local_steps}", *PEER_ARGS, *mode])
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
        "local_steps": local_steps,
        "samples_per_peer": samples,
        "bytes_sent_per_peer": [total for total, _, _ in sent],
        "averaging_bytes_per_peer": [averaging for _, averaging, _ in sent],
        "bytes_per_sample": sum(total for total, _, _ in sent) / sum(samples),
        "averaging_bytes_per_sample": sum(averaging for _, averaging, _ in sent) / sum(samples),
        "seconds": seconds,
        "checkpoint": str(latest_checkpoint(folder / "a")),
    }


@torch.no_grad()
def eval_loss(checkpoint: str, dataset: Path) -> float:
    """The checkpoint's mean loss on the same EVAL_BATCHES batches of the sample, for every mode."""
    loaded = open_checkpoint(checkpoint, torch.device("cpu"))
    model = loaded.model.float().eval()
    config = model.config
    stream = CodeStream(
        dataset, batch_size=32, text_len=config.text_len, codebook_size=config.codebook_size,
        grid=(config.grid, config.grid), num_workers=0, seed=1234,
    )  # fmt: skip
    losses = []
    for batch in stream:
        losses.append(model(batch["text"], batch["codes"])["loss"].item())
        if len(losses) == EVAL_BATCHES:
            return sum(losses) / len(losses)
    raise AssertionError("the sample holds fewer batches than EVAL_BATCHES")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--outer-steps", type=int, default=2, help="Outer steps at the largest H (100).")
    args = parser.parse_args()
    started = time.perf_counter()
    inner_steps = max(LOCAL_STEPS) * args.outer_steps
    vqgan = load_vqgan(sample_vqgan_spec(), torch.device("cpu"))
    judging = SamplingSettings(top_k=64, top_p=1.0)
    with tempfile.TemporaryDirectory() as tmp:
        dataset = Path(tmp) / "sample"
        write_sample(dataset, 200)
        runs = []
        for local_steps in (0, *LOCAL_STEPS):
            console.print(f"training: {'synchronous' if not local_steps else f'--local-steps {local_steps}'}")
            run = train(dataset, Path(tmp) / f"run-{local_steps}", local_steps, inner_steps)
            run["final_loss"] = eval_loss(run["checkpoint"], dataset)
            checkpoint = open_checkpoint(run["checkpoint"], torch.device("cpu"))
            run["seen_accepted"] = judge_acceptance(checkpoint, vqgan, SEEN_PROMPTS, JUDGE_SAMPLES, judging).share
            runs.append(run)
    sync = runs[0]
    table = Table(title=f"2 peers, {inner_steps * BATCH:,} samples each (batch {BATCH}, target {TARGET})")
    for column in ("mode", "averaging bytes per sample", "vs synchronous", "all bytes per sample", "vs synchronous",
                   "final loss", "vs synchronous", "judge accepts (seen)", "seconds"):  # fmt: skip
        table.add_column(column, no_wrap=column == "mode")
    for run in runs:
        run["averaging_bytes_ratio"] = sync["averaging_bytes_per_sample"] / run["averaging_bytes_per_sample"]
        run["bytes_ratio"] = sync["bytes_per_sample"] / run["bytes_per_sample"]
        run["loss_ratio"] = run["final_loss"] / sync["final_loss"]
        table.add_row(
            f"--local-steps {run['local_steps']}" if run["local_steps"] else "synchronous",
            f"{run['averaging_bytes_per_sample']:,.0f}",
            f"{run['averaging_bytes_ratio']:,.1f}x fewer",
            f"{run['bytes_per_sample']:,.0f}",
            f"{run['bytes_ratio']:,.1f}x fewer",
            f"{run['final_loss']:.4f}",
            f"{run['loss_ratio']:.3f}",
            f"{run['seen_accepted']:.0%}",
            f"{run['seconds']:.0f}",
        )
    console.print(table)
    goal = runs[-1]["averaging_bytes_ratio"] >= 50 and runs[-1]["loss_ratio"] <= 1.10
    console.print(f"goal (>= 50x fewer averaging bytes at H=100, loss within 10%): {'met' if goal else 'NOT met'}")
    save_results("diloco", {"runs": runs, "goal_met": goal}, started, console)


if __name__ == "__main__":
    main()
