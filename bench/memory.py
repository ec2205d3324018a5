"""Memory of a tiny trainer in a swarm, with what lightens a peer's processes (the default) and without.

Two `ttt train` peers of the tiny preset average on 127.0.0.1, the second joining the first, on the embedded sample.
Once they took a round together and `--warmup` seconds more passed, each trainer's processes are sampled every 10 s
for `--seconds`: private and proportional memory and CPU of its main process, its `p2pd` and the processes forked
from it (hivemind's DHT and two averagers, the data loader's worker), and the global steps the pair took meanwhile.
Each variant is a peer's environment (training/swarm/processes.py, `lighten_the_processes`): "none" undoes all of
it (the baseline), "all" is the default, "all but the freeze" undoes `gc.freeze`, "all but trims every 5 s" trims every
5 s instead of every second. The variants alternate, `--runs` times each. Prints the medians and their ratios to
the baseline; every figure goes to bench/results/memory.json. Variants' names are separated by commas.

    PYTHONPATH=. .venv/bin/python -m bench.memory [--runs 2] [--variants none,all] [--warmup 60] [--seconds 120]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.common import save_results
from bench.scale import process_reading, process_tree
from pipeline.sample import DEFAULT_SAMPLE_ROWS
from tests.support.datasets import write_sample
from tests.support.swarm_runs import SwarmRun

VARIANTS = {  # each a peer's environment
    "none": {"TTT_HEAP_TRIM_SECONDS": "0", "TTT_GC_FREEZE": "0"},
    "all": {},
    "all but the freeze": {"TTT_GC_FREEZE": "0"},
    "all but trims every 5 s": {"TTT_HEAP_TRIM_SECONDS": "5"},
}
TRAINERS = ("peer-1", "peer-2")
SAMPLE_PERIOD = 10.0
MB = 2**20
PARTS = ("main", "p2pd", "forked")


def memory_by_part(pid: int) -> dict[str, dict[str, float]]:
    """Private and proportional MB, and CPU seconds so far, of PID's main process, its p2p daemons and the processes
    forked from it."""
    parts = {part: {"private": 0.0, "pss": 0.0, "cpu": 0.0} for part in PARTS}
    for process in process_tree(pid):
        if (reading := process_reading(process)) is None:
            continue
        name, private, pss, cpu = reading
        part = parts["main" if process == pid else "p2pd" if name == "p2pd" else "forked"]
        part["private"] += private / MB
        part["pss"] += pss / MB
        part["cpu"] += cpu
    return parts


def wait_for_a_round_together(run: SwarmRun, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while run.logs[TRAINERS[1]].first_round_together is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"the pair took no round together within {timeout} s:\n{run.timeline()}")
        time.sleep(1)
        run.read()


def last_step(run: SwarmRun) -> int:
    run.read()
    return max((step for log in run.logs.values() for step, _, _ in log.rounds), default=0)


def one_run(dataset: Path, folder: Path, env: dict, args: argparse.Namespace) -> dict:
    """One pair: its samples of memory per trainer and part, and the global steps per minute while sampled."""
    run = SwarmRun(
        folder, ["--dataset", str(dataset), "--run-id", folder.name, "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    )
    try:
        for name in TRAINERS:
            run.start(name, env=env)
        wait_for_a_round_together(run)
        time.sleep(args.warmup)
        first_step, started = last_step(run), time.monotonic()
        samples = []
        while time.monotonic() - started < args.seconds:
            samples.append({name: memory_by_part(run.processes[name].pid) for name in TRAINERS})
            time.sleep(SAMPLE_PERIOD)
        steps_per_minute = (last_step(run) - first_step) / (time.monotonic() - started) * 60
    finally:
        for name in TRAINERS:
            run.kill(name, signal.SIGINT)
        run.wait_for_exit(list(TRAINERS), timeout=120)
    return {"samples": samples, "steps_per_minute": steps_per_minute, "cores": cores_by_part(samples)}


def cores_by_part(samples: list[dict]) -> dict[str, float]:
    """The cores each part of a trainer used from the first sample to the last (the median trainer's)."""
    seconds = SAMPLE_PERIOD * (len(samples) - 1)
    return {
        part: statistics.median(samples[-1][name][part]["cpu"] - samples[0][name][part]["cpu"] for name in TRAINERS)
        / seconds
        for part in PARTS
    }


def summary(runs: list[dict]) -> dict:
    """Medians over every sample of every trainer: private and proportional MB per part and in all, steps/minute."""
    figures = {}
    for part in PARTS:
        for kind in ("private", "pss"):
            values = [sample[name][part][kind] for run in runs for sample in run["samples"] for name in TRAINERS]
            figures[f"{part} {kind} (MB)"] = statistics.median(values)
        figures[f"{part} cores"] = statistics.median(run["cores"][part] for run in runs)
    for kind in ("private", "pss"):
        totals = [
            sum(sample[name][part][kind] for part in sample[name])
            for run in runs
            for sample in run["samples"]
            for name in TRAINERS
        ]
        figures[f"{kind} (MB)"], figures[f"{kind}, largest sample (MB)"] = statistics.median(totals), max(totals)
    figures["steps per minute"] = statistics.median(run["steps_per_minute"] for run in runs)
    return figures


def show(results: dict[str, dict], console: Console) -> None:
    """One column per variant, each figure with its ratio to the first variant's."""
    summaries = [done["summary"] for done in results.values()]
    table = Table(title="a tiny trainer of a pair: medians of its samples")
    for column in ("", *results):
        table.add_column(column, justify="right")
    for row in summaries[0]:
        cells = [f"{summaries[0][row]:.3g}"] + [
            f"{summary[row]:.3g} ({summary[row] / max(summaries[0][row], 1e-9):.2f}x)" for summary in summaries[1:]
        ]
        table.add_row(row, *cells)
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="pairs of each variant, alternated")
    parser.add_argument("--variants", default="none,all", help=f"the first is the baseline; of {', '.join(VARIANTS)}")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds after the first round before sampling")
    parser.add_argument("--seconds", type=float, default=120.0, help="seconds of samples in each run")
    args = parser.parse_args()
    console, started = Console(), time.perf_counter()
    chosen = args.variants.split(",")
    if unknown := set(chosen) - set(VARIANTS):
        raise SystemExit(f"no variant {', '.join(sorted(unknown))}: choose among {', '.join(VARIANTS)}")
    runs: dict[str, list[dict]] = {name: [] for name in chosen}
    with tempfile.TemporaryDirectory(prefix="ttt-bench-memory-") as tmp:
        dataset = Path(tmp) / "sample"
        write_sample(dataset, DEFAULT_SAMPLE_ROWS)
        for number in range(args.runs):
            for name in chosen:
                env = VARIANTS[name]
                console.print(f"run {number + 1} of {args.runs}: {name}")
                runs[name].append(
                    one_run(dataset, Path(tmp) / f"run-{number}-{len(runs[name])}-{env != {}}", env, args)
                )
    results = {name: {"runs": done, "summary": summary(done)} for name, done in runs.items()}
    show(results, console)
    save_results("memory", results, started, console)


if __name__ == "__main__":
    main()
