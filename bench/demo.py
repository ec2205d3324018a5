"""Does the demo's run take in a peer that joins at mid-run without losing what it learnt? `ttt demo`'s training,
alone and with a third peer joining.

The demo's two peers (`ttt demo`'s own commands: the tiny preset, 200 global steps, the sample's word tokenizer,
the first peer waiting for the second) train on the demo's dataset, once as the demo does and once with a third peer
started, with the same command and the first peer's address as a volunteer joins, when the first peer reaches global
step 100. Each run reports:

- the swarm's loss at its first step and over its last 10 steps (the mean of the peers' progress lines), and the
  share of the two-peer run's loss decrease that the run with the joiner keeps (the demo's issue asks for >= 30%);
- the joiner's loss at its first step against the swarm's at that step: the share of the swarm's decrease it starts
  with (its downloaded state; a peer starting from scratch keeps none);
- full rounds: for each peer, its global steps whose round held every peer of the run, of its steps after the last
  peer's state download; the wall time; and the sample judge's acceptance of the first peer's final checkpoint (seen
  prompts and held-out compositions, 95% intervals).

    PYTHONPATH=. .venv/bin/python -m bench.demo [--runs 1] [--steps 200] [--join-at 100] [--samples-per-prompt 8]
                                             [--logs DIR]

Timing decides who is in which round, so `--runs` repeats both scenarios; `--logs` keeps every peer's output. Writes
bench/results/demo.json. On 2 CPU cores the two-peer run takes about 5 minutes and the joined one about 8 (three
peers share the cores), each with about a minute of judging.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.common import save_results
from bench.generalisation import share
from inference.demo import peer_command
from inference.sample_quality import judge_sample_prompts
from inference.settings import DemoSettings
from pipeline.sample import DEFAULT_SAMPLE_ROWS
from tests.support.datasets import write_sample
from tests.support.swarm_runs import PeerLog, SwarmRun

LAST_STEPS = 10  # the run's final loss: the mean over its last so many steps
RUN_TIMEOUT = 1800.0  # seconds one run may take

console = Console(width=130)


def swarm_loss(logs: list[PeerLog], step: int) -> float | None:
    """The mean of the losses the peers printed for global step STEP (None when no peer printed one)."""
    losses = [log.losses[step] for log in logs if step in log.losses]
    return statistics.fmean(losses) if losses else None


def final_loss(logs: list[PeerLog], steps: int) -> float:
    losses = [swarm_loss(logs, step) for step in range(steps - LAST_STEPS + 1, steps + 1)]
    return statistics.fmean(loss for loss in losses if loss is not None)


def train(folder: Path, settings: DemoSettings, join_at: int | None) -> dict[str, PeerLog]:
    """The demo's peers (their logs and checkpoints in FOLDER); with JOIN_AT, a third one started when the first
    reaches that global step."""

    def command(number: int, initial_peers: list[str]) -> list[str]:
        return peer_command(settings, f"demo-peer-{number}", str(folder / f"peer-{number}"), initial_peers)

    swarm = SwarmRun(folder, [])
    swarm.launch("peer-1", command(1, []))
    swarm.launch("peer-2", command(2, [swarm.address]))
    if join_at is not None:
        swarm.wait_for_step("peer-1", join_at, timeout=RUN_TIMEOUT)
        swarm.launch("peer-3", command(3, [swarm.address]))
    logs = swarm.finish(timeout=RUN_TIMEOUT)
    failed = [log for log in logs.values() if log.returncode != 0]
    if failed:
        raise SystemExit(f"{failed[0].name} failed in {folder}:\n{failed[0].text}")
    return logs


def full_rounds(logs: dict[str, PeerLog]) -> dict[str, str]:
    """For each peer, its global steps whose round held every peer of the run, of its steps after the last peer's
    state download (a step of a state download counts as not full)."""
    since = max(log.synchronised[0] if log.synchronised else 0 for log in logs.values())
    shares = {}
    for log in logs.values():
        sizes = [size for step, size, _ in log.rounds if step > since]
        shares[log.name] = f"{sum(size == len(logs) for size in sizes)} of {len(sizes)}"
    return shares


def joiner_figures(logs: dict[str, PeerLog], first_loss: float) -> dict:
    """Where the joiner started: its first step's loss against the swarm's (the two first peers') at that step, and
    the share of the swarm's decrease from FIRST_LOSS (the run's first step) that it shows."""
    joiner, swarm = logs["peer-3"], [logs["peer-1"], logs["peer-2"]]
    first_step = min(joiner.losses)
    at_join = swarm_loss(swarm, first_step)
    return {
        "synchronised_at": joiner.synchronised[0] if joiner.synchronised else None,
        "first_step": first_step,
        "first_loss": joiner.losses[first_step],
        "swarm_loss_then": at_join,
        "decrease_kept": (first_loss - joiner.losses[first_step]) / (first_loss - at_join),
    }


def measure(folder: Path, settings: DemoSettings, join_at: int | None) -> dict:
    """One run of the demo's training (with a joiner at JOIN_AT, if given), then the judge."""
    started = time.perf_counter()
    logs = train(folder, settings, join_at)
    seconds = time.perf_counter() - started
    peers = list(logs.values())
    scores = judge_sample_prompts(str(folder / "peer-1"), settings.samples_per_prompt, settings.seed)
    first_step = min(logs["peer-1"].losses)
    result = {
        "join_at": join_at, "seconds": seconds,
        "first_loss": swarm_loss(peers, first_step), "final_loss": final_loss(peers, settings.steps),
        "full_rounds": full_rounds(logs),
        "scores": {name: {"share": a.share, "interval": a.interval()} for name, a in scores.items()},
        "shown": {name: share(a) for name, a in scores.items()},
    }  # fmt: skip
    if join_at is not None:
        result["joiner"] = joiner_figures(logs, result["first_loss"])
    console.print(result)
    return result


def decrease(run: dict) -> float:
    return run["first_loss"] - run["final_loss"]


def print_table(runs: list[dict]) -> None:
    """One row per run; "decrease kept" is against the mean decrease of the two-peer runs (theirs show the noise)."""
    alone = statistics.fmean(decrease(run) for run in runs if run["join_at"] is None)
    table = Table(title="the demo's training, two peers alone and with a third joining (the first peer's model judged)")
    columns = ("run", "wall s", "first loss", f"last {LAST_STEPS} steps", "decrease kept", "joiner starts with",
               "full rounds", "seen", "held out")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for run in runs:
        joiner = run.get("joiner")
        table.add_row(
            "two peers" if run["join_at"] is None else f"third joins at step {run['join_at']}",
            f"{run['seconds']:.0f}", f"{run['first_loss']:.3f}", f"{run['final_loss']:.3f}",
            f"{decrease(run) / alone:.0%}",
            f"{joiner['decrease_kept']:.0%} (step {joiner['first_step']})" if joiner else "",
            ", ".join(run["full_rounds"].values()), run["shown"]["seen"], run["shown"]["held out"],
        )  # fmt: skip
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="Runs of each scenario.")
    parser.add_argument("--steps", type=int, default=DemoSettings.steps)
    parser.add_argument("--join-at", type=int, default=DemoSettings.steps // 2)
    parser.add_argument("--samples-per-prompt", type=int, default=DemoSettings.samples_per_prompt)
    parser.add_argument("--logs", type=Path, help="Keep the runs' folders (peer logs, checkpoints) here.")
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ttt-bench-demo-") as tmp:
        folder = args.logs or Path(tmp)
        data = folder / "ttt-data"
        console.print(f"making the demo's dataset ({DEFAULT_SAMPLE_ROWS:,} sample rows, ttt preprocess)")
        write_sample(data, DEFAULT_SAMPLE_ROWS)
        settings = DemoSettings(dataset=str(data), steps=args.steps, samples_per_prompt=args.samples_per_prompt)
        runs = [
            measure(folder / f"{scenario}-{run}", settings, join_at)
            for run in range(args.runs)
            for scenario, join_at in (("alone", None), ("joined", args.join_at))
        ]
    print_table(runs)
    save_results("demo", {"steps": args.steps, "runs": runs}, started, console)


if __name__ == "__main__":
    main()
