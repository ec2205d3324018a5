"""Benchmark of `ttt train` on this machine, all in one run.

1. samples/s of the tiny preset (on the embedded sample, made by `ttt preprocess`) and the small
   preset (on 1024-code rows): a plain torch loop (8-bit LAMB, no swarm) against a single hivemind
   peer (`training.peer.loop.Peer`) on the same data, with the same number of local batches per optimizer
   step: 16 for tiny (a realistic accumulation: the headline) and 1 (every batch a global step: the
   worst case); the ratio is what the peer costs over plain training;
2. bytes one peer sends for one full gradient with ttt's averaging compression (8 bits in blocks of 64 for tensors of
   >= 2^16 elements, fp16 for the rest) against fp32, for every preset, and checked against real
   hivemind serialisation for the tiny preset;
3. training memory of the small preset (batch 2): parameters + gradients, and the activations
   autograd keeps for the backward pass, with and without reversible layers and sharing;
4. joining a running swarm: `ttt train` peers with the default settings on the sample, 2, 3 and 4 of
   them on 127.0.0.1, the first starting alone and the others joining it either before its first step or
   a few steps in; for every joiner, the global steps and seconds from its state download to the first
   round it takes part in (the goal: 3 steps at most, every time), and the share of rounds each peer
   takes part in. Timing decides this, so every scenario runs `--join-runs` times with the swarm
   holding its step for joiners (the default) and `--baseline-runs` times without (`--join-timeout 0`,
   how hivemind joins on its own).

Prints tables and writes every figure to bench/results/train.json.

    .venv/bin/python -m bench.train [--batches 80] [--device auto] [--join-runs 5] [--baseline-runs 2]
                                    [--only speed,bytes,memory,join]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from hivemind.compression import CompressionInfo
from rich.console import Console
from rich.table import Table

from bench.common import save_results, synchronize
from pipeline.core.devices import pick_device
from pipeline.core.stream import CodeStream
from tests.support.datasets import write_paper_scale, write_sample  # the bench helpers that make datasets
from tests.support.swarm_runs import JOIN_GOAL, SwarmRun, meets_join_goal
from training.calc.memory import compressed_bytes
from training.config import PRESETS, ModelConfig, PeerSettings, RunSettings
from training.model import DalleTransformer
from training.optimizer import make_optimizer
from training.peer.join import join
from training.swarm.compression import averaging_compression

BATCH = {"tiny": 16, "small": 2}
# Local batches per optimizer step, the first the headline: a realistic accumulation, then every batch a step.
ACCUMULATIONS = {"tiny": (16, 1), "small": (1,)}
# The small preset takes seconds per batch on a CPU: a tenth of --batches measures it.
BATCHES_DIVISOR = {"tiny": 1, "small": 10}
ARRIVALS = {  # the first peer's global step at which each joiner starts (0: as soon as it is up)
    "before the first step": lambda joiners: [0] * joiners,
    "a few steps in": lambda joiners: [2 * (i + 1) for i in range(joiners)],
}

console = Console(width=130)


def plain_loop(preset: str, dataset: Path, steps: int, accumulation: int, device: torch.device) -> float:
    """Samples/s of forward + backward + 8-bit LAMB every ACCUMULATION batches on one process, no swarm."""
    config = PRESETS[preset].model
    torch.manual_seed(0)
    model = DalleTransformer(config).to(device)
    optimizer = make_optimizer("lamb-8bit", model.parameters(), lr=1e-3)
    stream = CodeStream(
        dataset, batch_size=BATCH[preset], text_len=config.text_len, seed=0, pin_memory=device.type == "cuda"
    )
    batches = iter(stream)
    samples, start = 0, 0.0
    for step in range(steps + 1):
        if step == 1:  # the first step allocates optimizer state: not timed
            synchronize(device)
            start = time.perf_counter()
        for _ in range(accumulation):
            batch = next(batches)
            text, codes = batch["text"].to(device, non_blocking=True), batch["codes"].to(device, non_blocking=True)
            model(text, codes)["loss"].backward()
            samples += len(text) if step else 0
        optimizer.step()
        optimizer.zero_grad()
    synchronize(device)
    return samples / (time.perf_counter() - start)


def hivemind_peer(
    preset: str, dataset: Path, steps: int, accumulation: int, device: torch.device, folder: Path
) -> float:
    """Samples/s of one `ttt train` peer whose target batch is ACCUMULATION of its batches."""
    run = RunSettings(
        dataset=str(dataset),
        run_id=f"bench-{preset}-{accumulation}",
        preset=preset,
        target_batch_size=accumulation * BATCH[preset],
        matchmaking_time=1.0,
    )
    settings = PeerSettings(
        run=run,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        batch_size=BATCH[preset],
        checkpoint_dir=str(folder),
        checkpoint_every=10**9,
        loader_workers=0,
        device=device.type,
    )
    peer = join(settings, Console(quiet=True))
    try:
        peer.catch_up_with_the_swarm()
        # The peer's own loop (with its per-step metrics, parameter hash and rollback copy); the first
        # global step allocates the optimizer state and is not timed.
        peer.settings.max_steps = 1
        peer.train_until_done()
        peer.settings.max_steps = steps + 1
        samples = peer.report.total_samples
        synchronize(device)
        start = time.perf_counter()
        peer.train_until_done()
        synchronize(device)
        seconds = time.perf_counter() - start
        samples = peer.report.total_samples - samples
    finally:
        peer.shutdown()
    return samples / seconds


def gradient_bytes(config: ModelConfig) -> tuple[int, int]:
    """(paper compression, fp32) bytes of one full gradient, from the parameter shapes."""
    with torch.device("meta"):
        sizes = [p.numel() for p in DalleTransformer(config).parameters()]
    compressed = sum(compressed_bytes(n) for n in sizes)
    return compressed, 4 * sum(sizes)


def serialized_gradient_bytes(config: ModelConfig) -> int:
    """The same for real, through hivemind's serialisation of every tensor."""
    compression = averaging_compression()
    model = DalleTransformer(config)
    total = 0
    for parameter in model.parameters():
        tensor = torch.randn_like(parameter)
        total += len(compression.compress(tensor, CompressionInfo.from_tensor(tensor)).buffer)
    return total


def training_memory(config: ModelConfig, batch: int) -> tuple[int, int]:
    """(parameters + gradients, activations kept for backward) in bytes for one training step."""
    torch.manual_seed(0)
    model = DalleTransformer(config)
    text = torch.randint(0, 256, (batch, config.text_len))
    codes = torch.randint(0, config.codebook_size, (batch, config.image_tokens))
    parameters = {p.data_ptr() for p in model.parameters()}
    saved = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.data_ptr() not in parameters:
            saved[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        loss = model(text, codes)["loss"]
    loss.backward()
    weights = sum(2 * p.numel() * p.element_size() for p in model.parameters())
    return weights, sum(saved.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=80, help="timed local batches per speed measurement")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda for the speed measurements")
    parser.add_argument("--join-runs", type=int, default=5, help="runs of every joining scenario")
    parser.add_argument("--baseline-runs", type=int, default=2, help="the same without holding steps for joiners")
    parser.add_argument("--only", default="speed,bytes,memory,join", help="the parts to run, comma-separated")
    args = parser.parse_args()
    parts = set(args.only.split(","))
    torch.set_num_threads(2)
    started = time.perf_counter()
    results = {}
    if "speed" in parts:
        device = torch.device(pick_device(args.device))
        results["speed"] = {"device": describe_device(device), "runs": bench_speed(args.batches, device)}
    if "bytes" in parts:
        results["bytes"] = bench_bytes()
    if "memory" in parts:
        results["memory"] = bench_memory()
    if "join" in parts:
        results["join"] = bench_join(args.join_runs, args.baseline_runs)
    print_results(results)
    save_results("train", results, started, console, keep_other_parts=True)


def bench_speed(batches: int, device: torch.device) -> dict:
    """Plain loop against one peer, for tiny on the sample and small on 1024-code rows, at every accumulation;
    each measurement times about BATCHES local batches (small: a tenth), after one untimed global step."""
    speed = {}
    with tempfile.TemporaryDirectory(prefix="ttt-bench-train-") as tmp:
        sample, codes1024 = Path(tmp) / "sample", Path(tmp) / "1024-codes"
        console.print("making datasets: the embedded sample (ttt preprocess) and 1024-code rows")
        write_sample(sample, 1200)
        write_paper_scale(codes1024, 2048)
        for preset, dataset in (("tiny", sample), ("small", codes1024)):
            for accumulation in ACCUMULATIONS[preset]:
                steps = max(2, batches // BATCHES_DIVISOR[preset] // accumulation)
                plain = plain_loop(preset, dataset, steps, accumulation, device)
                folder = Path(tmp) / f"ckpt-{preset}-{accumulation}"
                peer = hivemind_peer(preset, dataset, steps, accumulation, device, folder)
                speed[f"{preset}, {accumulation}"] = {
                    "preset": preset,
                    "accumulation": accumulation,
                    "steps": steps,
                    "plain": plain,
                    "hivemind_peer": peer,
                    "ratio": peer / plain,
                }
                console.print(
                    f"  {preset}, {accumulation} batches per step: plain {plain:.2f}, peer {peer:.2f} samples/s "
                    f"(peer / plain {peer / plain:.2f})"
                )
    return speed


def bench_bytes() -> dict:
    sent = {}
    for name, preset in PRESETS.items():
        compressed, fp32 = gradient_bytes(preset.model)
        sent[name] = {"compressed": compressed, "fp32": fp32, "reduction": fp32 / compressed}
    sent["tiny"]["serialized"] = serialized_gradient_bytes(PRESETS["tiny"].model)
    return sent


def bench_memory() -> dict:
    memory = {}
    small = PRESETS["small"].model
    for reversible in (True, False):
        for share in (True, False):
            config = ModelConfig(**{**small.to_dict(), "reversible": reversible, "share_groups": share})
            weights, activations = training_memory(config, BATCH["small"])
            memory[f"reversible={reversible}, shared={share}"] = {
                "weights_and_grads": weights,
                "activations": activations,
            }
    return memory


def join_run(dataset: Path, folder: Path, arrivals: list[int], joining: list[str]) -> dict:
    """One run: the first peer alone, the others joining at ARRIVALS with JOINING options; what their lines say."""
    max_steps = max(arrivals) + 3 * JOIN_GOAL
    args = ["--dataset", str(dataset), "--run-id", folder.name, "--max-steps", str(max_steps)]
    run = SwarmRun(folder, [*args, "--host-maddrs", "/ip4/127.0.0.1/tcp/0"])
    run.start("peer-1")
    for number, step in enumerate(arrivals, start=2):
        if step:
            run.wait_for_step("peer-1", step)
        run.start(f"peer-{number}", *joining)
    logs = run.finish()
    failed = [log.name for log in logs.values() if log.returncode != 0]
    if failed:
        raise SystemExit(f"{', '.join(failed)} failed in {folder}:\n{logs[failed[0]].text}")
    joiners = [log for log in logs.values() if log.synchronised is not None]
    first_sync = min(log.synchronised[0] for log in joiners)
    return {
        "max_steps": max_steps,
        "steps_to_first_round": [log.steps_to_first_round for log in joiners],
        "seconds_to_first_round": [log.seconds_to_first_round for log in joiners],
        "download_seconds": [log.synchronised[2] for log in joiners],
        # the share of the steps a peer went through (after the first joiner arrived) that it averaged with others
        "round_share": {
            log.name: log.rounds_together / max(1, sum(step > first_sync for step, _, _ in log.rounds))
            for log in logs.values()
        },
        "contributed": {log.name: log.contributed for log in logs.values()},
    }


JOINING = {"held": [], "not held": ["--join-timeout", "0"]}  # the joiners' options: the swarm holds, or not


def bench_join(runs: int, baseline_runs: int) -> dict:
    """Every scenario (2, 3, 4 peers; joiners before the first step or a few steps in), RUNS times with the
    swarm holding its step for joiners and BASELINE_RUNS times without."""
    join = {}
    with tempfile.TemporaryDirectory(prefix="ttt-bench-join-") as tmp:
        sample = Path(tmp) / "sample"
        console.print("joining a running swarm: making the sample (ttt preprocess)")
        write_sample(sample, 200)
        for peers in (2, 3, 4):
            for arrival, steps_of in ARRIVALS.items():
                scenario = join[f"{peers} peers, joiners {arrival}"] = {name: [] for name in JOINING}
                for mode, count in (("held", runs), ("not held", baseline_runs)):
                    for run in range(count):
                        folder = Path(tmp) / f"join-{peers}-{len(join)}-{mode}-{run}"
                        scenario[mode].append(join_run(sample, folder, steps_of(peers - 1), JOINING[mode]))
                        console.print(f"  {peers} peers, joiners {arrival}, {mode} run {run + 1}: {scenario[mode][-1]}")
    return join


def join_row(scenario: str, mode: str, runs: list[dict]) -> list[str]:
    """A scenario's runs in one table row; a joiner that never took part in a round counts as missing the goal."""
    all_steps = [s for run in runs for s in run["steps_to_first_round"]]
    steps = [s for s in all_steps if s is not None] or [0]
    seconds = [s for run in runs for s in run["seconds_to_first_round"] if s is not None] or [0.0]
    met = [meets_join_goal(s) for s in all_steps]
    every_time = sum(all(map(meets_join_goal, run["steps_to_first_round"])) for run in runs)
    never = all_steps.count(None)
    shares = [share for run in runs for share in run["round_share"].values()]
    return [
        scenario,
        mode,
        f"{every_time}/{len(runs)}",
        f"{sum(met)}/{len(met)}" + (f" ({never} never)" if never else ""),
        f"{statistics.median(steps):.0f} / {max(steps)}",
        f"{statistics.median(seconds):.1f} / {max(seconds):.1f}",
        f"{min(shares):.0%} / {statistics.mean(shares):.0%}",
    ]


def print_results(results: dict) -> None:
    if "speed" in results:
        print_speed(results["speed"])
    if "bytes" in results:
        print_bytes(results)
    if "memory" in results:
        print_memory(results)
    if "join" in results:
        table = Table(title=f"joining a running swarm (default settings; goal: a round within {JOIN_GOAL} steps)")
        columns = (
            "scenario", "step held for joiners", "runs: all met goal", "joiners met goal",
            "steps to 1st round, med/max", "seconds to 1st round, med/max", "round share, min/mean",
        )  # fmt: skip
        for column in columns:
            table.add_column(column, justify="right")
        for scenario, modes in results["join"].items():
            for mode, runs in modes.items():
                if runs:
                    table.add_row(*join_row(scenario, mode, runs))
        console.print(table)


def print_speed(speed: dict) -> None:
    table = Table(title=f"training speed on {speed['device']}: a plain torch loop against one ttt train peer")
    columns = ("preset", "batch", "batches per step", "timed steps", "plain (samples/s)", "peer (samples/s)")
    for column in (*columns, "peer / plain"):
        table.add_column(column, justify="right")
    for run in speed["runs"].values():
        table.add_row(
            run["preset"],
            str(BATCH[run["preset"]]),
            str(run["accumulation"]),
            str(run["steps"]),
            f"{run['plain']:.2f}",
            f"{run['hivemind_peer']:.2f}",
            f"{run['ratio']:.2f}",
        )
    console.print(table)


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"this CPU ({torch.get_num_threads()} threads)"


def print_bytes(results: dict) -> None:
    table = Table(title="bytes of one full gradient sent by a peer")
    for column in ("preset", "fp32", "compressed", "reduction"):
        table.add_column(column, justify="right")
    for preset, sent in results["bytes"].items():
        table.add_row(
            preset, f"{sent['fp32'] / 1e6:,.2f} MB", f"{sent['compressed'] / 1e6:,.2f} MB", f"{sent['reduction']:.2f}x"
        )
    console.print(table)
    console.print(
        f"tiny, real hivemind serialisation: {results['bytes']['tiny']['serialized'] / 1e6:.3f} MB "
        f"(arithmetic: {results['bytes']['tiny']['compressed'] / 1e6:.3f} MB)"
    )


def print_memory(results: dict) -> None:
    table = Table(title=f"small preset, batch {BATCH['small']}: training memory")
    for column in ("layers", "parameters + gradients", "activations kept for backward"):
        table.add_column(column, justify="right")
    for name, memory in results["memory"].items():
        table.add_row(
            name, f"{memory['weights_and_grads'] / 2**20:,.1f} MiB", f"{memory['activations'] / 2**20:,.1f} MiB"
        )
    console.print(table)


if __name__ == "__main__":
    main()
