"""Benchmark of robust averaging (--aggregation) on this machine, all in one run.

1. one averaging round, mean vs CenteredClip: four hivemind averagers in this process (three honest peers and
   one that sends its gradients times -10) holding the gradients of the tiny and the small preset, compressed
   as the peers send them; seconds from the trigger to the last peer's result (matchmaking excluded), median of
   a few rounds, and the ratio;
2. what one bad peer does to a swarm: three honest `ttt train` peers of the tiny preset on the embedded sample
   and one tests/support/faulty_peer.py peer on 127.0.0.1, for each attack (gradients x -10, random gradients of 100x
   the honest norm, NaN) with `mean` and with `centered-clip`, against a run of the three honest peers alone;
   the honest peers' mean loss at the last step, its ratio to the run without attacker, and how much of that
   run's loss decrease they kept;
3. peers that lie about their samples: two honest `ttt train` peers and one faulty peer that claims K times the
   samples it processes (its weight in each round, its share of the swarm's progress) while it sends bad
   gradients, with `mean` and `centered-clip`, against the two honest peers alone (30 global steps): the honest
   peers' loss (mean of the last five steps), its ratio to the honest run's, and the global steps per minute.

Prints tables and writes every figure to bench/results/robust.json.

    .venv/bin/python -m bench.robust [--steps 12] [--claim-steps 30] [--only rounds,swarm,claims]
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
from tests.support.commands import SWARM_ARGS
from tests.support.datasets import write_sample
from tests.support.swarm_runs import PeerLog, SwarmRun
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
# Faulty peers that lie about their samples (tests/support/faulty_peer.py's faults) -> what the table calls them.
LIARS = {
    "scale:-5+claim:1000": "x -5, claims 1000x",
    "scale:-20+claim:1000": "x -20, claims 1000x",
    "noise+claim:1000": "noise, claims 1000x",
    "nan+claim:1000": "NaN, claims 1000x",
    "scale:-5+claim:10": "x -5, claims 10x",
}
LAST_STEPS = 5  # the honest loss of a claims run: the mean over its last steps


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


def swarm_with(
    folder: Path, dataset: Path, steps: int, aggregation: str, attack: str | None, honest: tuple[str, ...]
) -> dict[str, PeerLog]:
    """A run of the `honest` peers and, with `attack`, one faulty peer of it; every peer's log."""
    run = SwarmRun(
        folder,
        ["--dataset", str(dataset), "--run-id", "bench", "--max-steps", str(steps), "--aggregation", aggregation,
         *SWARM_ARGS],
    )  # fmt: skip
    peers = len(honest) + (attack is not None)
    run.start(honest[0], "--wait-for-peers", str(peers))
    for name in honest[1:]:
        run.start(name)
    if attack:
        run.start("x", fault=attack)
    return run.finish()


def honest_losses(logs: dict[str, PeerLog], honest: tuple[str, ...]) -> dict[int, float]:
    """Global step -> the honest peers' mean loss at it."""
    losses = [logs[name].losses for name in honest]
    common = set.intersection(*(set(steps) for steps in losses))
    return {step: statistics.mean(loss[step] for loss in losses) for step in sorted(common)}


def steps_per_minute(log: PeerLog) -> float:
    """The global steps a peer saw per minute, from its first progress line to its last."""
    rounds = log.rounds
    return 60 * (rounds[-1][0] - rounds[0][0]) / max(rounds[-1][2] - rounds[0][2], 1e-9)


def bench_swarm(steps: int) -> dict:
    results = {}
    with tempfile.TemporaryDirectory(prefix="ttt-bench-robust-") as tmp:
        tmp = Path(tmp)
        dataset = tmp / "sample"
        write_sample(dataset, 1200)
        console.print(f"  three honest peers, {steps} global steps")
        baseline = swarm_with(tmp / "baseline", dataset, steps, "mean", None, HONEST)
        results["no attacker"] = honest_losses(baseline, HONEST)
        for attack in ATTACKS:
            for aggregation in AGGREGATIONS:
                console.print(f"  three honest peers and one sending {ATTACKS[attack]}, {aggregation}")
                logs = swarm_with(tmp / f"{attack}-{aggregation}", dataset, steps, aggregation, attack, HONEST)
                results[f"{attack}/{aggregation}"] = honest_losses(logs, HONEST)
    return results


def claims_row(logs: dict[str, PeerLog], honest: tuple[str, ...]) -> dict:
    losses = honest_losses(logs, honest)
    last = sorted(losses)[-LAST_STEPS:]
    return {
        "loss": statistics.mean(losses[step] for step in last),
        "first_loss": losses[min(losses)],
        "steps_per_minute": statistics.mean(steps_per_minute(logs[name]) for name in honest),
    }


def bench_claims(steps: int) -> dict:
    """Two honest peers and one that lies about its samples, per lie and aggregation; the honest peers alone."""
    honest, results = HONEST[:2], {}
    with tempfile.TemporaryDirectory(prefix="ttt-bench-claims-") as tmp:
        tmp = Path(tmp)
        dataset = tmp / "sample"
        write_sample(dataset, 1200)
        for aggregation in AGGREGATIONS:
            console.print(f"  two honest peers, {aggregation}, {steps} global steps")
            results[f"none/{aggregation}"] = claims_row(
                swarm_with(tmp / f"honest-{aggregation}", dataset, steps, aggregation, None, honest), honest
            )
            for liar in LIARS:
                console.print(f"  two honest peers and one sending {LIARS[liar]}, {aggregation}")
                logs = swarm_with(tmp / f"{liar}-{aggregation}", dataset, steps, aggregation, liar, honest)
                results[f"{liar}/{aggregation}"] = claims_row(logs, honest)
    return results


def print_claims(results: dict) -> None:
    table = Table(title="two honest peers and one that lies about its samples (tiny): the honest peers' loss")
    for column in ("attacker", "aggregation", "loss (last 5 steps)", "vs honest run", "steps/min", "vs honest run"):
        table.add_column(column, justify="right")
    for key, row in results.items():
        liar, aggregation = key.split("/")
        honest = results[f"none/{aggregation}"]
        table.add_row(
            LIARS.get(liar, "none"), aggregation, f"{row['loss']:.3f}", f"{row['loss'] / honest['loss']:.3f}",
            f"{row['steps_per_minute']:.1f}", f"{row['steps_per_minute'] / honest['steps_per_minute']:.2f}",
        )  # fmt: skip
    console.print(table)


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
    parser.add_argument("--claim-steps", type=int, default=30, help="global steps of each run of the claims part")
    parser.add_argument("--only", default="rounds,swarm,claims", help="comma-separated parts to run")
    args = parser.parse_args()
    started, parts, results = time.perf_counter(), args.only.split(","), {}
    if "rounds" in parts:
        console.print("[bold]one averaging round, mean vs CenteredClip[/]")
        results["rounds"] = bench_rounds()
    if "swarm" in parts:
        console.print("[bold]a swarm with one bad peer[/]")
        results["swarm"] = bench_swarm(args.steps)
    if "claims" in parts:
        console.print("[bold]peers that lie about their samples[/]")
        results["claims"] = bench_claims(args.claim_steps)
    print_results(results)
    if "claims" in results:
        print_claims(results["claims"])
    save_results("robust", results, started, console, keep_other_parts=True)


if __name__ == "__main__":
    main()
