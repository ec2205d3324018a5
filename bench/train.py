"""Benchmark of `ttt train` on this machine, all in one run.

1. samples/s of the tiny preset (on the embedded sample, made by `ttt preprocess`) and the small
   preset (on 1024-code rows): a plain torch loop (8-bit LAMB, no swarm) against a single hivemind
   peer (`training.peer.Peer`) on the same data; the ratio is hivemind's overhead;
2. bytes one peer sends for one full gradient with the paper's compression (8-bit for tensors of
   >= 2^16 elements, fp16 for the rest) against fp32, for every preset, and checked against real
   hivemind serialisation for the tiny preset;
3. training memory of the small preset (batch 2): parameters + gradients, and the activations
   autograd keeps for the backward pass, with and without reversible layers and sharing.

Prints tables and writes every figure to bench/results/train.json.

    .venv/bin/python bench/train.py [--steps 20]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from common import save_results
from hivemind.compression import CompressionInfo
from rich.console import Console
from rich.table import Table
from stream import write_paper_scale, write_sample  # the bench helpers that make datasets

from pipeline.core.stream import CodeStream
from training.compression import COMPRESSION_THRESHOLD, averaging_compression
from training.config import PRESETS, ModelConfig, PeerSettings
from training.model import DalleTransformer
from training.optimizer import ClippedLAMB8bit
from training.peer import Peer

BATCH = {"tiny": 16, "small": 2}
# The small preset takes seconds per step on a CPU: a few steps measure it.
STEPS_DIVISOR = {"tiny": 1, "small": 2}

console = Console(width=130)


def plain_loop(preset: str, dataset: Path, steps: int) -> float:
    """Samples/s of forward + backward + 8-bit LAMB on one process, no swarm."""
    config = PRESETS[preset].model
    torch.manual_seed(0)
    model = DalleTransformer(config)
    optimizer = ClippedLAMB8bit(model.parameters(), lr=1e-3)
    stream = CodeStream(dataset, batch_size=BATCH[preset], text_len=config.text_len, seed=0)
    batches = iter(stream)
    samples, start = 0, 0.0
    for step in range(steps + 1):
        if step == 1:  # the first step allocates optimizer state: not timed
            start = time.perf_counter()
        batch = next(batches)
        model(batch["text"], batch["codes"])["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
        samples += len(batch["text"]) if step else 0
    return samples / (time.perf_counter() - start)


def hivemind_peer(preset: str, dataset: Path, steps: int, folder: Path) -> float:
    """Samples/s of one `ttt train` peer (every batch is a global step: target = its batch)."""
    settings = PeerSettings(
        dataset=str(dataset),
        run_id=f"bench-{preset}",
        preset=preset,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        target_batch_size=BATCH[preset],
        batch_size=BATCH[preset],
        checkpoint_dir=str(folder),
        checkpoint_every=10**9,
        loader_workers=0,
        matchmaking_time=1.0,
    )
    peer = Peer(settings, console=Console(quiet=True))
    try:
        peer.resume_or_join()
        # The peer's own loop (with its per-step metrics, parameter hash and rollback copy); the first
        # global step allocates the optimizer state and is not timed.
        settings.max_steps = 1
        peer.train_until_done()
        settings.max_steps = steps + 1
        start = time.perf_counter()
        peer.train_until_done()
        seconds = time.perf_counter() - start
    finally:
        peer.shutdown()
    return steps * BATCH[preset] / seconds


def gradient_bytes(config: ModelConfig) -> tuple[int, int]:
    """(paper compression, fp32) bytes of one full gradient, from the parameter shapes."""
    with torch.device("meta"):
        sizes = [p.numel() for p in DalleTransformer(config).parameters()]
    compressed = sum(n + 8 + 256 * 4 if n >= COMPRESSION_THRESHOLD else 2 * n for n in sizes)
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
    parser.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    args = parser.parse_args()
    torch.set_num_threads(2)
    started = time.perf_counter()
    results = {"speed": bench_speed(args.steps), "bytes": bench_bytes(), "memory": bench_memory()}
    print_results(results, args.steps)
    save_results("train", results, started, console)


def bench_speed(steps: int) -> dict:
    """Plain loop against one peer, for tiny on the sample and small on 1024-code rows."""
    speed = {}
    with tempfile.TemporaryDirectory(prefix="ttt-bench-train-") as tmp:
        sample, codes1024 = Path(tmp) / "sample", Path(tmp) / "1024-codes"
        console.print("making datasets: the embedded sample (ttt preprocess) and 1024-code rows")
        write_sample(sample, 1200)
        write_paper_scale(codes1024, 2048)
        for preset, dataset in (("tiny", sample), ("small", codes1024)):
            preset_steps = max(2, steps // STEPS_DIVISOR[preset])
            plain = plain_loop(preset, dataset, preset_steps)
            peer = hivemind_peer(preset, dataset, preset_steps, Path(tmp) / f"ckpt-{preset}")
            speed[preset] = {"plain": plain, "hivemind_peer": peer, "ratio": peer / plain}
            console.print(f"  {preset}: plain {plain:.1f}, hivemind peer {peer:.1f} samples/s")
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


def print_results(results: dict, steps: int) -> None:
    table = Table(title=f"training speed on this CPU (2 threads), {steps} steps (small: half)")
    for column in ("preset", "batch", "plain torch loop", "one hivemind peer", "peer / plain"):
        table.add_column(column, justify="right")
    for preset, speed in results["speed"].items():
        table.add_row(
            preset,
            str(BATCH[preset]),
            f"{speed['plain']:.1f}",
            f"{speed['hivemind_peer']:.1f}",
            f"{speed['ratio']:.2f}",
        )
    console.print(table)
    table = Table(title="bytes of one full gradient sent by a peer")
    for column in ("preset", "fp32", "paper compression", "reduction"):
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
