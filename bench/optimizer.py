"""ttt's optimizers (training/optimizer.py): state bytes, CPU step time, and training quality on the sample.

    PYTHONPATH=. python -m bench.optimizer [--quick] [--data /tmp/lamb-data] [--sweep] [--device cuda]

1. State bytes per parameter value of each optimizer, measured on the real tensors after one step (and the
   table's own figure), for the tiny and small presets and one block of ttt-1.1b. Goal: <= 2.1 for lamb-8bit.
2. Step time on the device (the CPU by default) of lamb-8bit, fp32 lamb and bitsandbytes' Adam8bit on the same
   parameter sets, as ratios to Adam8bit measured in the same process; the median of several steps. Goal: <= 1.3x
   Adam8bit.
3. Quality: the tiny preset trained without hivemind on the embedded sample (`ttt preprocess --sample-rows 200
   --shards 8`, made at --data if missing; 178 of its rows pass the filters), read once with CodeStream, with
   the paper's schedule (linear warm-up over 10%, then decay), weight decay 0.01 and clipping at 1. Every
   optimizer starts from the same weights and sees the same batches. Two regimes: batch 64, and a large batch
   standing in for 1,024: the sample is so small that any batch of 1,024 from it holds every row 5-6 times, so
   its gradient is the whole sample's; the bench computes that gradient by accumulating micro-batches of 50 rows
   over the sample, and scales every optimizer's learning rate by sqrt(1024 / 64) = 4 (the same rule for all:
   LAMB's square-root scaling). The final loss is the mean over the whole sample. fp32 LAMB without bias
   correction runs too: the measurement behind LAMB's `bias_correction=True`. Goal: lamb-8bit within 2% of fp32
   lamb. The relative update ||dw|| / (lr ||w||) per tensor kind shows what the trust ratio does: 1 for every
   tensor under LAMB (while ||w|| <= 10), whatever its gradient's scale; under Adam about sqrt(numel) / ||w||.
   --sweep then trains at the learning rates of SWEEP (where LEARNING_RATES come from): about 15 minutes more.

The machine this was written on has 2 CPU cores shared with other work: torch runs with --threads (default 1).
With --device cuda every part runs on the GPU (the sample must exist at --data: making it needs the preprocess
stage's libraries) and the figures go to bench/results/optimizer-cuda.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench.common import save_results, synchronize
from pipeline.core.stream import CodeStream
from training.config import OPTIMIZER_STATES, OPTIMIZERS, PRESETS
from training.model import Block, DalleTransformer
from training.optimizer import LAMB, linear_schedule, make_optimizer

console = Console(width=150)
TIMED = ("lamb-8bit", "lamb", "adam-8bit")
TRAINED = ("lamb-8bit", "lamb", "adam-8bit", "lamb-no-bias-correction")
# Peak learning rates at batch 64: LAMB's best of 1e-2, 3e-2, 1e-1 at 30 and 40 steps; Adam's best of 1e-3, 3e-3,
# 1e-2 was 3e-3 at 40 steps and 1e-2 at 30 (by 2.6%; 3e-3 is kept: it was the best of 3e-4 ... 1e-2 over 40 steps).
LEARNING_RATES = {"lamb-8bit": 3e-2, "lamb": 3e-2, "lamb-no-bias-correction": 3e-2, "adam-8bit": 3e-3}
# --sweep: (optimizer, peak lr, large batch) besides the runs above; the last two: batch 64's rates unscaled.
SWEEP = (
    ("lamb", 1e-2, False), ("lamb", 1e-1, False), ("adam-8bit", 1e-3, False), ("adam-8bit", 1e-2, False),
    ("lamb-no-bias-correction", 1e-2, False), ("lamb-no-bias-correction", 1e-1, False),
    ("lamb", 3e-2, True), ("adam-8bit", 3e-3, True),
)  # fmt: skip
WEIGHT_DECAY, MAX_GRAD_NORM = 0.01, 1.0
SMALL_BATCH, LARGE_BATCH, MICRO_BATCH = 64, 1024, 50
MEMORY_COLUMNS = ("parameters", "optimizer", "values", "state bytes/value", "table's", "step ms", "vs adam-8bit")
QUALITY_COLUMNS = (
    "batch", "optimizer", "peak lr", "final loss", "vs lamb", "train loss",
    "dw/(lr|w|) emb", "mat", "vec", "spread", "trust emb", "mat", "vec", "s",
)  # fmt: skip


def bench_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    """An optimizer of OPTIMIZERS, or the bench's own fp32 LAMB without bias correction."""
    if name == "lamb-no-bias-correction":
        return LAMB(params, lr=lr, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_GRAD_NORM, eight_bit=False,
                    bias_correction=False)  # fmt: skip
    return make_optimizer(name, params, lr=lr, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_GRAD_NORM)


def parameter_sets(device: torch.device) -> dict[str, list[torch.Tensor]]:
    """The tensors the optimizers step on: the tiny and small presets' models and one block of ttt-1.1b."""
    torch.manual_seed(0)
    return {
        "tiny": [p.detach().to(device) for p in DalleTransformer(PRESETS["tiny"].model).parameters()],
        "small": [p.detach().to(device) for p in DalleTransformer(PRESETS["small"].model).parameters()],
        "ttt-1.1b block": [p.detach().to(device) for p in Block(PRESETS["ttt-1.1b"].model).parameters()],
    }


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in an optimizer's state, each storage once (bitsandbytes shares its maps)."""
    seen, total = set(), 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in seen:
                seen.add(value.untyped_storage().data_ptr())
                total += value.untyped_storage().nbytes()
    return total


def fresh_copies(tensors: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Parameters with the tensors' values and a fixed random gradient each (scaled like a clipped one)."""
    generator = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(t.clone()) for t in tensors]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=generator) * 1e-3).to(p.device)
    return params


def measure_memory_and_time(sets: dict[str, list[torch.Tensor]], repeats: int) -> list[dict]:
    """State bytes per value after one step of each optimizer, and for those of TIMED the median step time over
    `repeats` steps, taken in turns (one step of each, then again), so that other work on the machine slows all
    of them alike."""
    rows = []
    for set_name, tensors in sets.items():
        numel = sum(t.numel() for t in tensors)
        optimizers = {}
        for name in OPTIMIZERS:
            optimizer = bench_optimizer(name, fresh_copies(tensors), lr=1e-3)
            optimizer.step()  # bitsandbytes allocates its state in the first step: not timed
            rows.append({
                "parameters": set_name, "optimizer": name, "values": numel,
                "state_bytes_per_value": state_bytes(optimizer) / numel,
                "table_bytes_per_value": sum(OPTIMIZER_STATES[name].state_bytes(t.numel()) for t in tensors) / numel,
            })  # fmt: skip
            if name in TIMED:
                optimizers[name] = optimizer
        seconds = {name: [] for name in optimizers}
        device = tensors[0].device
        for _ in range(repeats):
            for name, optimizer in optimizers.items():
                synchronize(device)
                started = time.perf_counter()
                optimizer.step()
                synchronize(device)
                seconds[name].append(time.perf_counter() - started)
        for row in rows[-len(OPTIMIZERS) :]:
            if row["optimizer"] in seconds:
                row["step_seconds"] = statistics.median(seconds[row["optimizer"]])
                row["vs_adam_8bit"] = row["step_seconds"] / statistics.median(seconds["adam-8bit"])
        del optimizers
    return rows


def load_sample(data: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """The whole sample as two tensors (text, codes) on `device`, read once with CodeStream in a fixed order."""
    if not (data / "data").exists():
        from pipeline.preprocess.run import PreprocessOptions, preprocess

        console.print(f"making the sample at {data}")
        preprocess(PreprocessOptions(output=str(data), shards=8, sample_rows=200), console=Console(quiet=True))
    config = PRESETS["tiny"].model
    stream = CodeStream(
        data, batch_size=MICRO_BATCH, text_len=config.text_len, codebook_size=config.codebook_size,
        grid=(config.grid, config.grid), num_workers=0, seed=0, epochs=1,
    )  # fmt: skip
    batches = list(stream)
    return {key: torch.cat([batch[key] for batch in batches]).to(device) for key in ("text", "codes")}


def small_batches(sample: dict[str, torch.Tensor], steps: int) -> list[torch.Tensor]:
    """Row indices of `steps` batches of SMALL_BATCH: passes over the sample, each in its own seeded order."""
    rows = len(sample["text"])
    generator = torch.Generator().manual_seed(0)
    order = torch.cat([torch.randperm(rows, generator=generator) for _ in range(steps * SMALL_BATCH // rows + 1)])
    return [order[i * SMALL_BATCH : (i + 1) * SMALL_BATCH] for i in range(steps)]


@torch.no_grad()
def sample_loss(model: DalleTransformer, sample: dict[str, torch.Tensor]) -> float:
    """The model's mean loss over the whole sample."""
    model.eval()
    chunks = zip(sample["text"].split(MICRO_BATCH), sample["codes"].split(MICRO_BATCH), strict=True)
    losses = [model(text, codes)["loss"].item() for text, codes in chunks]
    model.train()
    return sum(losses) / len(losses)


def tensor_kind(name: str, param: torch.Tensor) -> str:
    """What a tensor is, for the update-size table: an embedding, another matrix, or a vector."""
    if param.ndim <= 1:
        return "vectors"
    return "embeddings" if "embedding" in name else "matrices"


def relative_updates(named: list, before: list[torch.Tensor], lr: float) -> dict[str, list[float]]:
    """||dw|| / (lr ||w||) of every tensor with a nonzero norm, by kind."""
    moved: dict[str, list[float]] = {"embeddings": [], "matrices": [], "vectors": []}
    for (name, param), old in zip(named, before, strict=True):
        if old.norm() > 0:
            moved[tensor_kind(name, param)].append(((param.detach() - old).norm() / old.norm()).item() / lr)
    return moved


def train(name: str, lr: float, large: bool, steps: int, sample: dict[str, torch.Tensor]) -> dict:
    """The tiny preset trained `steps` steps from the same start; its final loss on the sample, how far each kind
    of tensor moved per step relative to its norm and the step's learning rate (median over steps), and how
    unequal that is among the matrices (the largest over the smallest; median over steps)."""
    torch.manual_seed(0)
    model = DalleTransformer(PRESETS["tiny"].model).to(sample["text"].device)
    named = list(model.named_parameters())
    optimizer = bench_optimizer(name, model.parameters(), lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_schedule(steps))
    batches = [torch.arange(len(sample["text"]))] * steps if large else small_batches(sample, steps)
    moved: dict[str, list[float]] = {"embeddings": [], "matrices": [], "vectors": [], "spread": []}
    losses, started = [], time.perf_counter()
    for rows in batches:
        loss = 0.0
        for chunk in rows.split(MICRO_BATCH):  # a large batch: accumulated over micro-batches
            part = model(sample["text"][chunk], sample["codes"][chunk])["loss"] * len(chunk) / len(rows)
            part.backward()
            loss += part.item()
        before, step_lr = [p.detach().clone() for _, p in named], optimizer.param_groups[0]["lr"]
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss)
        step_moved = relative_updates(named, before, step_lr)
        for kind, values in step_moved.items():
            moved[kind].append(statistics.median(values))
        matrices = step_moved["embeddings"] + step_moved["matrices"]
        moved["spread"].append(max(matrices) / min(matrices))
    result = {
        "optimizer": name, "lr": lr, "large_batch": large, "steps": steps, "final_loss": sample_loss(model, sample),
        "last_train_losses": losses[-5:], "seconds": time.perf_counter() - started,
        "relative_update_per_lr": {kind: statistics.median(values) for kind, values in moved.items()},
    }  # fmt: skip
    if isinstance(optimizer, LAMB):
        by_kind: dict[str, list[float]] = {"embeddings": [], "matrices": [], "vectors": []}
        for n, p in named:
            by_kind[tensor_kind(n, p)].append(optimizer.trust_ratios[p].item())
        result["last_trust_ratio"] = {kind: statistics.median(values) for kind, values in by_kind.items()}
    return result


def print_memory_and_time(rows: list[dict], device_name: str) -> None:
    table = Table(title=f"Optimizer state and {device_name} step time (state after one step; time: median of steps)")
    for column in MEMORY_COLUMNS:
        table.add_column(column)
    for row in rows:
        timed = "step_seconds" in row
        table.add_row(
            row["parameters"], row["optimizer"], f"{row['values']:,}", f"{row['state_bytes_per_value']:.3f}",
            f"{row['table_bytes_per_value']:.3f}", f"{row['step_seconds'] * 1000:.0f}" if timed else "",
            f"{row['vs_adam_8bit']:.2f}x" if timed else "",
        )  # fmt: skip
    console.print(table)


def print_quality(runs: list[dict], title: str, references: list[dict]) -> None:
    """A table of training runs; "vs fp32 lamb": the final loss over that of the fp32 LAMB run of `references`
    in the same regime."""
    caption = (
        "final loss: over the whole sample; vs lamb: over fp32 LAMB's in the regime; train loss: the last 5 steps'; "
        "dw/(lr|w|): median over steps of ||dw|| / (lr ||w||) (per kind: embeddings, other matrices, vectors); "
        "spread: its largest over its smallest among all matrices (median over steps); "
        "trust: LAMB's trust ratio at the last step (median per kind)"
    )
    table = Table(title=title, caption=caption)
    for column in QUALITY_COLUMNS:
        table.add_column(column, no_wrap=column == "optimizer")
    for run in runs:
        reference = fp32_lamb(references, run["large_batch"])
        moved, trust = run["relative_update_per_lr"], run.get("last_trust_ratio", {})
        table.add_row(
            f"{LARGE_BATCH:,}" if run["large_batch"] else f"{SMALL_BATCH}", run["optimizer"],
            f"{run['lr']:g}", f"{run['final_loss']:.4f}",
            f"{run['final_loss'] / reference['final_loss']:.4f}" if reference else "",
            f"{statistics.mean(run['last_train_losses']):.4f}",
            *(f"{moved[kind]:.3g}" for kind in ("embeddings", "matrices", "vectors", "spread")),
            *(f"{trust[kind]:.3g}" if trust else "" for kind in ("embeddings", "matrices", "vectors")),
            f"{run['seconds']:.0f}",
        )  # fmt: skip
    console.print(table)


def fp32_lamb(runs: list[dict], large: bool) -> dict | None:
    """The fp32 LAMB run of a regime: what the 8-bit one is compared with."""
    return next((run for run in runs if run["optimizer"] == "lamb" and run["large_batch"] == large), None)


def print_goals(rows: list[dict], runs: list[dict]) -> None:
    eight_bit = [row for row in rows if row["optimizer"] == "lamb-8bit"]
    block = next(row for row in eight_bit if row["parameters"] == "ttt-1.1b block")
    times = ", ".join(f"{row['parameters']} {row['vs_adam_8bit']:.2f}x" for row in eight_bit)
    losses = [run["final_loss"] / fp32_lamb(runs, run["large_batch"])["final_loss"] for run in runs
              if run["optimizer"] == "lamb-8bit"]  # fmt: skip
    console.print(f"goal: lamb-8bit state <= 2.1 bytes/value (ttt-1.1b block): {block['state_bytes_per_value']:.3f}")
    console.print(f"goal: lamb-8bit step <= 1.3x Adam8bit: {times}")
    console.print(f"goal: lamb-8bit final loss within 2% of fp32 lamb: {', '.join(f'{x:.4f}' for x in losses)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="Fewer steps and timing repeats (about 3 minutes).")
    parser.add_argument("--data", type=Path, default=Path("/tmp/lamb-data"), help="The sample (made if missing).")
    parser.add_argument("--sweep", action="store_true", help="Also train at the learning rates of SWEEP.")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared).")
    parser.add_argument("--device", default="cpu", help="Where the optimizers and the training run (cpu, cuda).")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    started = time.perf_counter()
    small_steps, large_steps, repeats = (10, 4, 3) if args.quick else (30, 12, 7)
    rows = measure_memory_and_time(parameter_sets(device), repeats)
    print_memory_and_time(rows, device.type.upper())
    sample = load_sample(args.data, device)
    runs = []
    for large, steps in ((False, small_steps), (True, large_steps)):
        for name in TRAINED if not large else TRAINED[:3]:
            lr = LEARNING_RATES[name] * ((LARGE_BATCH / SMALL_BATCH) ** 0.5 if large else 1.0)
            runs.append(train(name, lr, large=large, steps=steps, sample=sample))
            console.print(f"{name} lr {lr:g} large {large}: final loss {runs[-1]['final_loss']:.4f}")
    rows_in_sample = len(sample["text"])
    print_quality(
        runs,
        f"Tiny preset on the sample ({rows_in_sample} rows): batch {SMALL_BATCH} for {small_steps} "
        f"steps, batch {LARGE_BATCH:,} (the whole sample's gradient) for {large_steps} steps",
        runs,
    )
    console.print(f"the default runs took {time.perf_counter() - started:.0f} s")
    sweep = []
    if args.sweep:
        for name, lr, large in SWEEP:
            sweep.append(train(name, lr, large=large, steps=large_steps if large else small_steps, sample=sample))
            console.print(f"sweep {name} lr {lr:g} large {large}: final loss {sweep[-1]['final_loss']:.4f}")
        swept = sorted(sweep + runs, key=lambda run: (run["large_batch"], run["optimizer"], run["lr"]))
        print_quality(swept, "Learning rates (the runs above and SWEEP's)", runs)
    print_goals(rows, runs)
    results = {"device": str(device), "threads": args.threads, "quick": args.quick, "memory_and_time": rows,
               "quality": runs}  # fmt: skip
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
    if args.sweep:
        results["sweep"] = sweep
    name = "optimizer" if device.type == "cpu" else f"optimizer-{device.type}"
    save_results(name, results, started, console, keep_other_parts=True)  # a sweep run before stays


if __name__ == "__main__":
    main()
