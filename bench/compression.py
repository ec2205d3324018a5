"""Benchmark of the averaging compression: what each codec loses of a gradient, and what that costs training.

Four simulated peers train the tiny preset on the embedded sample (made by `ttt preprocess`), in one process; each
codec's run starts from the same initialisation and trains on the same batches, and so does it again for each seed
(another initialisation and other batches): one run's loss differs from another's by chance far more than a small
gradient error moves it. Each global step, every peer computes its gradient on its own
batch; the gradients travel as a synchronous round sends them (each sender's tensors compressed, their mean
compressed again as the reducer returns it: training/swarm/allreduce.py's same result), and the 8-bit LAMB steps on
the result. The codecs, the baseline first:

    fp32        nothing lost (the baseline)
    uniform-8   hivemind's Uniform8BitQuantization, the paper's: 256 levels over each tensor's mean +- 3 standard
                deviations, values beyond clamped (tensors under 2^16 values in fp16, as ttt sends them)
    blockwise-8 ttt's Blockwise8Bit: a scale per block of 64 values (training/swarm/compression.py)

For each codec: the relative error of the averaged gradient (||received - exact|| / ||exact||, exact = the fp32
mean of the same gradients, median and largest over all steps of all seeds), the same for the audits' sketch of
each sender's gradient as its reducers receive it (training/audit/sketch.py: what the reducers' check compares with
the commitments within received.py's RECEIVED_TOLERANCE), the bytes one gradient takes, and the
training loss over the last steps and the final model's loss on fixed batches of the sample, each as a ratio to the
fp32 run of the same seed (the mean over the seeds, and the smallest and largest).

Prints a table and writes every figure to bench/results/compression.json.

    .venv/bin/python -m bench.compression [--steps 150] [--peers 4] [--seeds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from hivemind.compression import CompressionInfo, Float16Compression, Uniform8BitQuantization
from rich.console import Console
from rich.table import Table

from bench.common import save_results
from pipeline.core.stream import CodeStream
from tests.support.datasets import write_sample
from training.audit.sketch import Sketcher, run_seed, sketch_distance
from training.config import COMPRESSION_THRESHOLD, PRESETS
from training.model import DalleTransformer
from training.optimizer import make_optimizer
from training.swarm.compression import averaging_compression, round_trip

BATCH = 8
SAMPLE_ROWS = 1200
FIXED_BATCHES = 8  # the batches every run's final model is evaluated on
LAST_STEPS = 20  # the training loss is the mean over these last steps

console = Console(width=130)


def uniform_8bit(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as hivemind's Uniform8BitQuantization delivers it (its own decoder fails under numpy >= 2.4: the
    codebook is read here directly), fp16 under 2^16 values."""
    if tensor.numel() < COMPRESSION_THRESHOLD:
        return round_trip(Float16Compression(), tensor)
    indices, codebook = Uniform8BitQuantization().quantize(tensor.detach().float())
    return torch.from_numpy(codebook)[torch.from_numpy(indices.astype("int64"))].reshape(tensor.shape)


def uniform_8bit_bytes(tensor: torch.Tensor) -> int:
    if tensor.numel() < COMPRESSION_THRESHOLD:
        return 2 * tensor.numel()
    return tensor.numel() + 8 + 256 * 4  # indices, the codebook's size and the codebook


def blockwise_8bit(tensor: torch.Tensor) -> torch.Tensor:
    return round_trip(averaging_compression(), tensor)


def blockwise_8bit_bytes(tensor: torch.Tensor) -> int:
    return len(averaging_compression().compress(tensor, CompressionInfo.from_tensor(tensor)).buffer)


CODECS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], int]]] = {
    "fp32": (lambda tensor: tensor, lambda tensor: 4 * tensor.numel()),
    "uniform-8": (uniform_8bit, uniform_8bit_bytes),
    "blockwise-8": (blockwise_8bit, blockwise_8bit_bytes),
}


def peer_batches(dataset: Path, peers: int, steps: int, seed: int = 0) -> list[list[dict]]:
    """For each step, each peer's batch (its own stream of the sample), the same for every codec."""
    text_len = PRESETS["tiny"].model.text_len
    streams = [iter(CodeStream(dataset, batch_size=BATCH, text_len=text_len, seed=seed + peer, peer=f"p{peer}"))
               for peer in range(peers)]  # fmt: skip
    return [[next(stream) for stream in streams] for _ in range(steps)]


def train(codec: str, batches: list[list[dict]], fixed: list[dict], seed: int) -> dict:
    """The simulated swarm's run with `codec`: its losses and its averaged gradients' errors."""
    send, _ = CODECS[codec]
    torch.manual_seed(seed)
    model = DalleTransformer(PRESETS["tiny"].model)
    optimizer = make_optimizer("lamb-8bit", model.parameters(), lr=PRESETS["tiny"].learning_rate)
    parameters = list(model.parameters())
    sketcher = Sketcher.for_run([parameter.numel() for parameter in parameters], run_seed("bench"))
    losses, errors, sketch_errors = [], [], []
    for step_batches in batches:
        sent, exact, step_losses = [], [], []
        for batch in step_batches:
            model.zero_grad(set_to_none=True)
            loss = model(batch["text"], batch["codes"])["loss"]
            loss.backward()
            step_losses.append(loss.item())
            grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in parameters]
            exact.append(grads)
            sent.append([send(grad) for grad in grads])
            sketch_errors.append(sketch_distance(sketcher.sketch(sent[-1]), sketcher.sketch(grads)))
        for index, parameter in enumerate(parameters):
            mean = torch.stack([grads[index] for grads in sent]).mean(dim=0)
            parameter.grad = send(mean)  # the reducer returns the compressed mean
        exact_mean = torch.cat([torch.stack(grads).mean(dim=0).flatten() for grads in zip(*exact, strict=True)])
        received = torch.cat([parameter.grad.flatten() for parameter in parameters])
        errors.append(float((received - exact_mean).norm() / exact_mean.norm()))
        optimizer.step()
        losses.append(statistics.fmean(step_losses))
    with torch.no_grad():
        final = statistics.fmean(model(b["text"], b["codes"])["loss"].item() for b in fixed)
    return {
        "train_loss": statistics.fmean(losses[-LAST_STEPS:]),
        "final_loss": final,
        "errors": errors,
        "sketch_errors": sketch_errors,
    }


def gradient_bytes(codec: str) -> int:
    _, size = CODECS[codec]
    return sum(size(parameter.detach()) for parameter in DalleTransformer(PRESETS["tiny"].model).parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="global steps of each run")
    parser.add_argument("--peers", type=int, default=4, help="simulated peers, one batch of 8 each per step")
    parser.add_argument("--seeds", type=int, default=3, help="runs of every codec, each from its own seed")
    args = parser.parse_args()
    torch.set_num_threads(2)
    started = time.perf_counter()
    results = {"steps": args.steps, "peers": args.peers, "batch": BATCH, "seeds": args.seeds, "codecs": {}}
    results["codecs"] = {codec: {"bytes": gradient_bytes(codec), "runs": []} for codec in CODECS}
    with tempfile.TemporaryDirectory() as tmp:
        console.print("making the sample (ttt preprocess)")
        write_sample(Path(tmp), SAMPLE_ROWS)
        fixed = [step[0] for step in peer_batches(Path(tmp), 1, FIXED_BATCHES, seed=99)]
        for seed in range(args.seeds):
            batches = peer_batches(Path(tmp), args.peers, args.steps, seed=100 * seed)
            for codec in CODECS:
                console.print(f"seed {seed}: training with {codec}")
                results["codecs"][codec]["runs"].append(train(codec, batches, fixed, seed))
    print_results(results)
    save_results("compression", results, started, console)


def print_results(results: dict) -> None:
    codecs = results["codecs"]
    base = codecs["fp32"]
    runs = f"{results['steps']} steps, {results['seeds']} seeds"
    table = Table(title=f"{results['peers']} simulated peers, tiny preset on the sample, {runs}")
    for column in ("codec", "gradient error median", "largest", "sketch error median", "largest", "bytes / fp32",
                   "train loss / fp32", "final loss / fp32"):  # fmt: skip
        table.add_column(column, justify="right")
    for name, codec in codecs.items():
        errors = [error for run in codec["runs"] for error in run["errors"]]
        sketch_errors = [error for run in codec["runs"] for error in run["sketch_errors"]]
        table.add_row(
            name,
            f"{statistics.median(errors):.4f}",
            f"{max(errors):.4f}",
            f"{statistics.median(sketch_errors):.4f}",
            f"{max(sketch_errors):.4f}",
            f"{codec['bytes'] / base['bytes']:.3f}",
            ratios(codec["runs"], base["runs"], "train_loss"),
            ratios(codec["runs"], base["runs"], "final_loss"),
        )
    console.print(table)


def ratios(runs: list[dict], baseline: list[dict], key: str) -> str:
    """The mean ratio of each seed's figure to the baseline's of the same seed, with the smallest and largest."""
    each = [run[key] / base[key] for run, base in zip(runs, baseline, strict=True)]
    return f"{statistics.fmean(each):.4f} ({min(each):.4f}-{max(each):.4f})"


if __name__ == "__main__":
    main()
