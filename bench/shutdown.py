"""Benchmark of how a peer leaves: SIGTERM (the graceful leave) to its main process or to every process it started,
and SIGKILL of its main process, repeated.

Each trial starts one `ttt train` peer of the tiny preset on the embedded sample, waits until it has taken a global
step, and sends the signal: SIGTERM and SIGKILL to the main process only (as `kill PID`, `docker stop` or the OOM
killer do), "SIGTERM to the group" to every process of the peer's process group at once (as systemd's stop, whose
default KillMode signals every process of the unit, and Slurm's do). It then counts the processes the peer had
started that are still running 10 s later, and times the main process's exit (SIGTERM: also its exit status, and
whether it wrote a checkpoint).

Prints a table and writes every figure to bench/results/shutdown.json.

    .venv/bin/python -m bench.shutdown [--trials 20] [--signals SIGTERM,group,SIGKILL]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

from bench.common import save_results
from tests.support.commands import PEER_ARGS
from tests.support.datasets import write_sample
from tests.support.swarm_runs import SwarmRun

console = Console(width=130)
ORPHAN_WAIT = 10.0  # seconds after the signal at which the processes left are counted


# what each kind of trial sends, and whether to the whole process group
SIGNALS = {"SIGTERM": (signal.SIGTERM, False), "group": (signal.SIGTERM, True), "SIGKILL": (signal.SIGKILL, False)}
NAMES = {"SIGTERM": "SIGTERM", "group": "SIGTERM to the group", "SIGKILL": "SIGKILL"}


def trial(folder: Path, dataset: Path, signum: signal.Signals, group: bool) -> dict:
    """One peer, one signal to its main process (or its whole group): exit time, status, checkpoint, processes left
    after 10 s."""
    run = SwarmRun(folder, ["--dataset", str(dataset), "--run-id", "shutdown", *PEER_ARGS])
    run.start("a")
    run.wait_for_step("a", 1)
    main = run.processes["a"]
    children = psutil.Process(main.pid).children(recursive=True)
    signalled = time.monotonic()
    (os.killpg if group else os.kill)(main.pid, signum)
    while main.poll() is None and time.monotonic() - signalled < 120:
        time.sleep(0.05)
    exited = time.monotonic() - signalled
    time.sleep(max(0.0, signalled + ORPHAN_WAIT - time.monotonic()))
    left = [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for process in left:  # clean up after a failed trial, so that the next one starts alone
        process.kill()
    latest = folder / "a" / "latest.json"
    return {
        "exit_seconds": exited,
        "returncode": main.returncode,
        "checkpoint_step": json.loads(latest.read_text())["step"] if latest.is_file() else None,
        "children": len(children),
        "left": len(left),
    }


def bench(trials: int, kinds: list[str]) -> dict:
    results: dict[str, list[dict]] = {NAMES[kind]: [] for kind in kinds}
    with tempfile.TemporaryDirectory(prefix="ttt-bench-shutdown-") as tmp:
        tmp = Path(tmp)
        dataset = tmp / "sample"
        write_sample(dataset, 200)
        for number in range(trials):
            for kind in kinds:
                console.print(f"  trial {number + 1} of {trials}: {NAMES[kind]}")
                results[NAMES[kind]].append(trial(tmp / f"{kind}-{number}", dataset, *SIGNALS[kind]))
    return results


def print_results(results: dict) -> None:
    table = Table(title="a peer signalled after its first global step (tiny, 2 cores)")
    for column in ("signal", "trials", "exit s (median, max)", "exit 0", "checkpoint", "processes left after 10 s"):
        table.add_column(column, justify="right")
    for name, trials in results.items():
        seconds = [t["exit_seconds"] for t in trials]
        table.add_row(
            name,
            str(len(trials)),
            f"{statistics.median(seconds):.1f}, {max(seconds):.1f}",
            f"{sum(t['returncode'] == 0 for t in trials)} of {len(trials)}",
            f"{sum(t['checkpoint_step'] is not None for t in trials)} of {len(trials)}",
            f"{sum(t['left'] for t in trials)} of {sum(t['children'] for t in trials)}",
        )
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20, help="trials of each signal")
    parser.add_argument(
        "--signals", default=",".join(SIGNALS), help=f"which, comma-separated, of {', '.join(SIGNALS)} (default: all)"
    )
    args = parser.parse_args()
    kinds = args.signals.split(",")
    unknown = [kind for kind in kinds if kind not in SIGNALS]
    if unknown:
        parser.error(f"--signals: unknown {', '.join(unknown)}; choose from {', '.join(SIGNALS)}")
    started = time.perf_counter()
    results = bench(args.trials, kinds)
    print_results(results)
    save_results("shutdown", results, started, console)


if __name__ == "__main__":
    main()
