"""Benchmark of robust averaging (--aggregation) on this machine, all in one run.

1. one averaging round, mean vs CenteredClip: four hivemind averagers in this process (three honest peers and
   one that sends its gradients times -10) holding the gradients of the tiny and the small preset, compressed
   as the peers send them; seconds from the trigger to the last peer's result (matchmaking excluded), median of
   a few rounds, and the ratio;
2. what one bad peer does to a swarm: three honest `ttt train` peers of the tiny preset on the embedded sample
   and one tests/support/faulty_peer.py peer on 127.0.0.1, for each attack (gradients x -10, random gradients of 100x
   the honest norm, NaN) with `mean` and with `centered-clip`, against a run of the three honest peers alone;
   the honest peers' mean loss at the last step, its ratio to the run without attacker, and how much of that
   run's loss decrease they kept.

Prints tables and writes every figure to bench/results/robust.json.

    .venv/bin/python -m bench.robust [--steps 12] [--only rounds,swarm]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage
from rich.console import Console
from rich.table import Table

from bench.common import save_results
from tests.support.datasets import write_sample
from tests.support.swarm_runs import SwarmRun
from training.config import PRESETS
from training.model import DalleTransformer
from training.swarm.aggregation import Aggregation
from training.swarm.allreduce import RobustAveraging
from training.swarm.compression import averaging_compression

console = Console(width=130)
ATTACKS = {"scale": "gradients x -10", "noise": "random, 100x the norm", "nan": "NaN"}
AGGREGATIONS = {"mean": Aggregation("mean"), "centered-clip": Aggregation("centered-clip", tau=1.0)}
ROUNDS = 3  # timed rounds per preset and aggregation
HONEST = ("a", "b", "c")


class BenchAverager(RobustAveraging, DecentralizedAverager):
    """hivemind's averager with the peers' reducer."""


def gradients_like(preset: str, attacker: bool, seed: int) -> list[torch.Tensor]:
    """Gradient-sized tensors of the preset's parameters: a shared direction plus this peer's noise."""
    with torch.device("meta"):
        shapes = [parameter.shape for parameter in DalleTransformer(PRESETS[preset].model).parameters()]
    generator = torch.Generator().manual_seed(0)
    shared = [torch.randn(shape, generator=generator) * 1e-3 for shape in shapes]
    generator.manual_seed(seed)
    tensors = [g + torch.randn(g.shape, generator=generator) * 1e-3 for g in shared]
    return [t * -10 for t in tensors] if attacker else tensors


def round_seconds(preset: str, aggregation: Aggregation) -> list[float]:
    """Seconds of ROUNDS all-reduce rounds of four averagers (one of them an attacker), matchmaking excluded."""
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dhts = [first] + [
        hivemind.DHT(start=True, initial_peers=first.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        for _ in range(3)
    ]
    averagers = [
        BenchAverager(
            gradients_like(preset, attacker=i == 3, seed=i + 1),
            dht=dht,
            prefix=f"bench-{preset}",
            target_group_size=4,
            min_group_size=4,
            min_matchmaking_time=2.0,
            compression=averaging_compression(),
            aggregation=aggregation,
            start=True,
        )
        for i, dht in enumerate(dhts)
    ]
    seconds = []
    try:
        for _ in range(ROUNDS):
            controls = [averager.step(wait=False, require_trigger=True, timeout=300) for averager in averagers]
            while not all(c.stage == AveragingStage.AWAITING_TRIGGER or c.done() for c in controls):
                time.sleep(0.01)
            started = time.perf_counter()
            for control in controls:
                control.allow_allreduce()
            for control in controls:
                control.result()
            seconds.append(time.perf_counter() - started)
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()
    return seconds


def bench_rounds() -> dict:
    results = {}
    for preset in ("tiny", "small"):
        results[preset] = {}
        for name, aggregation in AGGREGATIONS.items():
            console.print(f"  {preset}: {ROUNDS} rounds with {name}")
            results[preset][name] = statistics.median(round_seconds(preset, aggregation))
        results[preset]["ratio"] = results[preset]["centered-clip"] / results[preset]["mean"]
    return results


def honest_losses(folder: Path, dataset: Path, steps: int, aggregation: str, attack: str | None) -> dict[int, float]:
    """Global step -> the honest peers' mean loss, in a run with `attack`'s faulty peer (None: honest peers only)."""
    run = SwarmRun(
        folder,
        ["--dataset", str(dataset), "--run-id", "bench", "--max-steps", str(steps), "--aggregation", aggregation,
         "--threads", "1", "--loader-workers", "0", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
    )  # fmt: skip
    peers = len(HONEST) + (attack is not None)
    run.start("a", "--wait-for-peers", str(peers))
    for name in HONEST[1:]:
        run.start(name)
    if attack:
        run.start("x", fault=attack)
    logs = run.finish()
    losses = [logs[name].losses for name in HONEST]
    common = set.intersection(*(set(steps) for steps in losses))
    return {step: statistics.mean(loss[step] for loss in losses) for step in sorted(common)}


def bench_swarm(steps: int) -> dict:
    results = {}
    with tempfile.TemporaryDirectory(prefix="ttt-bench-robust-") as tmp:
        tmp = Path(tmp)
        dataset = tmp / "sample"
        write_sample(dataset, 1200)
        console.print(f"  three honest peers, {steps} global steps")
        baseline = honest_losses(tmp / "baseline", dataset, steps, "mean", None)
        results["no attacker"] = baseline
        for attack in ATTACKS:
            for aggregation in AGGREGATIONS:
                console.print(f"  three honest peers and one sending {ATTACKS[attack]}, {aggregation}")
                results[f"{attack}/{aggregation}"] = honest_losses(
                    tmp / f"{attack}-{aggregation}", dataset, steps, aggregation, attack
                )
    return results


def summary(losses: dict[int, float], baseline: dict[int, float]) -> tuple[float, float, float]:
    """(loss at the last step, its ratio to the baseline's, share of the baseline's loss decrease kept)."""
    last = max(losses)
    first = min(baseline)
    kept = (baseline[first] - losses[last]) / (baseline[first] - baseline[max(baseline)])
    return losses[last], losses[last] / baseline[max(baseline)], kept


def print_results(results: dict) -> None:
    if "rounds" in results:
        table = Table(title="one averaging round of four peers (one sends gradients x -10), matchmaking excluded")
        for column in ("preset", "mean", "centered-clip", "ratio"):
            table.add_column(column, justify="right")
        for preset, row in results["rounds"].items():
            table.add_row(preset, f"{row['mean']:.2f} s", f"{row['centered-clip']:.2f} s", f"{row['ratio']:.2f}")
        console.print(table)
    if "swarm" in results:
        swarm = results["swarm"]
        baseline = {int(k): v for k, v in swarm["no attacker"].items()}
        table = Table(title="the honest peers' loss at the last step, three honest peers and one bad one (tiny)")
        for column in ("attack", "aggregation", "loss", "vs no attacker", "loss decrease kept"):
            table.add_column(column, justify="right")
        table.add_row("none", "mean", f"{baseline[max(baseline)]:.4f}", "1.000", "100%")
        for key, losses in swarm.items():
            if key == "no attacker":
                continue
            attack, aggregation = key.split("/")
            loss, ratio, kept = summary({int(k): v for k, v in losses.items()}, baseline)
            table.add_row(ATTACKS[attack], aggregation, f"{loss:.4f}", f"{ratio:.3f}", f"{kept:.0%}")
        console.print(table)


def main() -> None:
    logging.getLogger("hivemind").setLevel(logging.CRITICAL)  # averagers and DHTs torn down at once complain
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="global steps of each swarm run")
    parser.add_argument("--only", default="rounds,swarm", help="comma-separated parts to run")
    args = parser.parse_args()
    started, parts, results = time.perf_counter(), args.only.split(","), {}
    if "rounds" in parts:
        console.print("[bold]one averaging round, mean vs CenteredClip[/]")
        results["rounds"] = bench_rounds()
    if "swarm" in parts:
        console.print("[bold]a swarm with one bad peer[/]")
        results["swarm"] = bench_swarm(args.steps)
    print_results(results)
    save_results("robust", results, started, console, keep_other_parts=True)


if __name__ == "__main__":
    main()
