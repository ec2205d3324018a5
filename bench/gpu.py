"""The GPU checks of shared/GPU-CHECKS.md that no other bench script covers, in one run on a CUDA machine.

0. optimizer: a few steps of the tiny preset with the 8-bit LAMB on the CPU and on the GPU agree;
1. encode: the paper's full-size f=8 GumbelVQ (8192 codes, random weights, seed 0) at 256 px on the sample
   domain's images, through the pipeline's own `encode` (images/s at several batch sizes) and through the
   preprocess stage itself (`encode_shard`: JPEG decode + encode, as a Dask worker runs it), in fp32, bf16
   and fp16; the share of codes equal to fp32's, and fp32 on the GPU against fp32 on the CPU;
2. step: one training step (forward + backward + 8-bit LAMB step, fp32, on the GPU) of a preset at a batch
   size: seconds and peak `torch.cuda.max_memory_allocated` against the memory calculator's terms
   for the same settings (`ttt calc ... --alone`; its GPU margin is what this measures);
3. stream: does the streaming loader (pinned memory) keep a GPU training step busy? The loader alone into
   the GPU, the small preset's step alone on a batch already there, and the two together.

Writes every figure to bench/results/gpu.json (keeping the parts not run this time).

    python -m bench.gpu [--parts encode,step,stream] [--images 512] [--step-preset ttt-1.1b --step-batch 1]
    python -m bench.gpu --compare-datasets A B   # share of equal codes of two `ttt preprocess` outputs, by key
"""

from __future__ import annotations

import argparse
import io
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from bench.common import save_results, synchronize

REPO = Path(__file__).resolve().parent.parent
FULL_VQGAN_CONFIG = REPO / "tests" / "data" / "vqgan_gumbel_f8_8192.yaml"
PRECISIONS = ("fp32", "bf16", "fp16")
ENCODE_BATCHES = (16, 64, 128)

console = Console(width=130)


def random_vqgan_checkpoint(path: Path) -> None:
    """The full-size config with random weights (seed 0), saved in the released layout (`state_dict`)."""
    from pipeline.vqgan.codec import build_vqgan, first_stage_config

    config = first_stage_config(FULL_VQGAN_CONFIG)
    torch.manual_seed(0)
    model = build_vqgan(config["target"], config["params"])
    torch.save({"state_dict": model.state_dict()}, path)


def sample_images(count: int, size: int = 256) -> np.ndarray:
    from pipeline.vqgan.train import SampleImages

    return SampleImages(size, seed=0).train_batch(count)


def jpeg_bytes(images: np.ndarray) -> list[bytes]:
    """Each image as the JPEG (quality 95) a downloader hands the preprocess stage."""
    from PIL import Image

    jpegs = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="JPEG", quality=95)
        jpegs.append(buffer.getvalue())
    return jpegs


def device_facts(device: torch.device) -> dict:
    """The GPU's name and whether cuDNN and matmuls may use TF32 (nothing on another device)."""
    if device.type != "cuda":
        return {}
    return {
        "gpu": torch.cuda.get_device_name(device),
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
    }


def encode_rates(model, pixels: torch.Tensor, device: torch.device) -> tuple[dict, dict]:
    """Images/s of `encode` in each precision at each of ENCODE_BATCHES, and each precision's codes (of the first
    batch size's pass)."""
    from pipeline.vqgan.codec import encode

    count = len(pixels)
    codes, rates = {}, {}
    for precision in PRECISIONS:
        encode(model, pixels[:16], precision)  # warm up: cuDNN picks its algorithms, autocast caches casts
        rates[precision] = {}
        for batch in ENCODE_BATCHES:
            synchronize(device)
            start = time.perf_counter()
            out = torch.cat([encode(model, pixels[i : i + batch], precision) for i in range(0, count, batch)])
            seconds = time.perf_counter() - start
            rates[precision][batch] = count / seconds
            codes.setdefault(precision, out)
        console.print(
            f"  encode {precision}: "
            + ", ".join(f"batch {b} {r:,.1f}" for b, r in rates[precision].items())
            + " images/s"
        )
    return rates, codes


def strict_fp32_codes(model, pixels: torch.Tensor, device: torch.device) -> tuple[float, torch.Tensor]:
    """Images/s and codes of fp32 with cuDNN's TF32 off (it defaults to TF32 on Ampere and later), batch 64."""
    from pipeline.vqgan.codec import encode

    count = len(pixels)
    previous = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        encode(model, pixels[:16])
        synchronize(device)
        start = time.perf_counter()
        strict = torch.cat([encode(model, pixels[i : i + 64]) for i in range(0, count, 64)])
        return count / (time.perf_counter() - start), strict
    finally:
        torch.backends.cudnn.allow_tf32 = previous


def cpu_comparison(spec, pixels: torch.Tensor, cpu_check: int, codes: dict, strict: torch.Tensor) -> dict:
    """The first `cpu_check` images encoded in fp32 on the CPU: its speed, and the share of each GPU precision's
    codes (and strict fp32's) equal to it."""
    from pipeline.vqgan.codec import encode, load_vqgan

    cpu_model = load_vqgan(spec, "cpu")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    start = time.perf_counter()
    on_cpu = torch.cat([encode(cpu_model, pixels[i : i + 8]) for i in range(0, cpu_check, 8)])
    return {
        "cpu_fp32_images": cpu_check,
        "cpu_fp32_images_per_s": cpu_check / (time.perf_counter() - start),
        "equal_codes_vs_cpu_fp32": {
            **{p: float((codes[p][:cpu_check] == on_cpu).float().mean()) for p in PRECISIONS},
            "fp32 without TF32": float((strict[:cpu_check] == on_cpu).float().mean()),
        },
    }


def encode_stage(spec, device: torch.device, jpegs: list[bytes]) -> dict:
    """The preprocess stage as a worker runs it: JPEG bytes in, codes out (one shard of all the images), in each
    precision; and the JPEG decode alone (images/s)."""
    import pandas as pd

    from pipeline.preprocess.download import ImageBatch
    from pipeline.preprocess.encode import EncodeSettings, decode_jpegs, encode_shard

    count = len(jpegs)
    batch = ImageBatch(rows=pd.DataFrame({"row": range(count)}), jpegs=jpegs, failures=Counter(), seconds=0.0)
    stage = {}
    for precision in PRECISIONS:
        settings = EncodeSettings(256, batch_size=32, device=str(device), precision=precision)
        encode_shard(batch, spec, settings)  # the first call loads the model, as a worker's first task does
        done = encode_shard(batch, spec, settings)
        stage[precision] = count / done.seconds
    console.print(f"  encode_shard (JPEG decode + encode, batch 32): {stage}")
    decode_start = time.perf_counter()
    decode_jpegs(jpegs, 256)
    return {
        "encode_shard_images_per_s": stage,
        "jpeg_decode_images_per_s": count / (time.perf_counter() - decode_start),
    }


def bench_encode(device: torch.device, count: int, cpu_check: int) -> dict:
    """The full-size VQGAN's encode on `count` sample images: its speed and codes in each precision against fp32
    (and, on a GPU, against strict fp32 and fp32 on the CPU), then the preprocess stage's."""
    from pipeline.vqgan.codec import describe_vqgan, images_to_tensor, load_vqgan

    started = time.perf_counter()
    images = sample_images(count)
    console.print(f"  rendered {count} sample images at 256 px in {time.perf_counter() - started:.1f} s")
    pixels = images_to_tensor(images)
    jpegs = jpeg_bytes(images)
    result: dict = {"images": count, "device": str(device), **device_facts(device)}

    with tempfile.TemporaryDirectory(prefix="ttt-bench-gpu-") as folder:
        ckpt = Path(folder) / "random.ckpt"
        random_vqgan_checkpoint(ckpt)
        spec = describe_vqgan(FULL_VQGAN_CONFIG, ckpt)
        model = load_vqgan(spec, device)
        result["encode_images_per_s"], codes = encode_rates(model, pixels, device)
        result["equal_codes_vs_fp32"] = {p: float((codes[p] == codes["fp32"]).float().mean()) for p in PRECISIONS}
        if device.type == "cuda":
            result["encode_images_per_s_fp32_no_tf32_batch_64"], strict = strict_fp32_codes(model, pixels, device)
            result["equal_codes_vs_strict_fp32"] = {p: float((codes[p] == strict).float().mean()) for p in PRECISIONS}
            result.update(cpu_comparison(spec, pixels, cpu_check, codes, strict))
        console.print(f"  equal codes: {result['equal_codes_vs_fp32']} (vs fp32 on this device)")
        for key in ("equal_codes_vs_strict_fp32", "equal_codes_vs_cpu_fp32"):
            if key in result:
                console.print(f"  {key}: {result[key]}")
        result.update(encode_stage(spec, device, jpegs))
    return result


def bench_optimizer(device: torch.device, steps: int = 5) -> dict:
    """The tiny preset trained a few steps with the 8-bit LAMB on the CPU and on `device`, from the same start on
    the same batch: do the two agree? (bitsandbytes runs different kernels on each.)"""
    from training.config import PRESETS
    from training.model import DalleTransformer
    from training.optimizer import make_optimizer

    config = PRESETS["tiny"].model
    torch.manual_seed(0)
    text = torch.randint(0, 256, (16, config.text_len))
    codes = torch.randint(0, config.codebook_size, (16, config.image_tokens))
    runs = {}
    for where in ("cpu", device):
        torch.manual_seed(0)
        model = DalleTransformer(config).to(where)
        optimizer = make_optimizer("lamb-8bit", model.parameters(), lr=3e-2)
        losses = []
        for _ in range(steps):
            loss = model(text.to(where), codes.to(where))["loss"]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        runs[str(where)] = (losses, torch.cat([p.detach().cpu().flatten() for p in model.parameters()]))
    (cpu_losses, cpu_params), (dev_losses, dev_params) = runs["cpu"], runs[str(device)]
    start = torch.cat([p.detach().flatten() for p in (torch.manual_seed(0), DalleTransformer(config))[1].parameters()])
    moved = (cpu_params - start).abs().max().item()
    result = {
        "steps": steps,
        "losses_cpu": cpu_losses,
        f"losses_{device.type}": dev_losses,
        "max_abs_param_difference": (cpu_params - dev_params).abs().max().item(),
        "max_abs_param_change_on_cpu": moved,
        # how far apart the two devices' updates are, against the size of the update
        "update_difference_over_update_norm": ((cpu_params - dev_params).norm() / (cpu_params - start).norm()).item(),
        "update_cosine": torch.nn.functional.cosine_similarity(cpu_params - start, dev_params - start, dim=0).item(),
    }
    console.print(f"  the 8-bit LAMB, tiny preset, {steps} steps on cpu and {device}: {result}")
    return result


def calculator_estimate(preset: str, config, batch: int) -> dict:
    """What `ttt calc` predicts for this bench's step: the bare model and 8-bit LAMB on the device, not a swarm."""
    from training.calc.memory import Setup, architecture_of, estimate

    setup = Setup(batch_size=batch, reversible=config.reversible, swarm=False)
    return estimate(architecture_of(preset, config), setup).to_dict()


def bench_step(device: torch.device, preset: str, batch: int, steps: int) -> dict:
    from training.config import PRESETS
    from training.model import DalleTransformer, parameter_count
    from training.optimizer import make_optimizer

    config = PRESETS[preset].model
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    free_before = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    model = DalleTransformer(config).to(device)
    optimizer = make_optimizer("lamb-8bit", model.parameters(), lr=1e-3)
    text = torch.randint(0, 256, (batch, config.text_len), device=device)
    codes = torch.randint(0, config.codebook_size, (batch, config.image_tokens), device=device)
    peaks, seconds, losses = [], [], []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        loss = model(text, codes)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
        if device.type == "cuda":
            peaks.append(torch.cuda.max_memory_allocated(device))
    predicted = calculator_estimate(preset, config, batch)
    estimate = predicted["device_total"] - predicted["margin"]  # the terms; the margin is what this measures
    result = {
        "preset": preset,
        "batch": batch,
        "parameters": parameter_count(config),
        "step_seconds": seconds,
        "losses": losses,
        "calculator_terms_bytes": estimate,
        "calculator_device_total_bytes": predicted["device_total"],
    }
    if device.type == "cuda":
        result["peak_allocated_bytes_per_step"] = peaks
        result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        result["free_before_bytes"] = free_before
        result["peak_over_estimate"] = max(peaks) / estimate
    console.print(
        f"  {preset} batch {batch}: steps {', '.join(f'{s:.2f}' for s in seconds)} s; "
        + (f"peak {max(peaks) / 2**30:.2f} GiB allocated, " if peaks else "")
        + f"calculator terms {estimate / 2**30:.2f} GiB "
        + f"(with its GPU margin {predicted['device_total'] / 2**30:.2f}); "
        + f"losses {', '.join(f'{x:.3f}' for x in losses)}"
    )
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def loader_alone(device: torch.device, streams: Callable[[int], Iterable[dict]], seconds: float) -> dict:
    """Samples/s the loader moves into `device` with 0 and 2 workers, from its second batch on (the first includes
    starting the readers and the workers), for `seconds` each."""
    loader = {}
    for workers in (0, 2):
        samples, start, first = 0, None, True
        for item in streams(workers):
            moved = {key: item[key].to(device, non_blocking=True) for key in ("text", "codes")}
            if first:  # the first batch includes starting the readers (and the workers)
                synchronize(device)
                first, start = False, time.perf_counter()
                continue
            samples += len(moved["text"])
            if time.perf_counter() - start >= seconds:
                break
        synchronize(device)
        loader[workers] = samples / (time.perf_counter() - start)
        console.print(f"  loader alone into {device}, {workers} workers: {loader[workers]:,.0f} samples/s")
    return loader


def small_preset_step(device: torch.device, config) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One training step (forward, backward, 8-bit LAMB) of a model of `config` built on `device` from seed 0."""
    from training.model import DalleTransformer
    from training.optimizer import make_optimizer

    torch.manual_seed(0)
    model = DalleTransformer(config).to(device)
    optimizer = make_optimizer("lamb-8bit", model.parameters(), lr=1e-3)

    def step(text: torch.Tensor, codes: torch.Tensor) -> None:
        model(text, codes)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def step_alone(device: torch.device, step: Callable, fixed: dict, batch: int, seconds: float) -> float:
    """Samples/s of `step` on one batch (`fixed`, of `batch` rows) already on `device`, after two warm-up steps, for
    `seconds`."""
    text, codes = fixed["text"].to(device), fixed["codes"].to(device)
    for _ in range(2):
        step(text, codes)
    synchronize(device)
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step(text, codes)
        steps += 1
        synchronize(device)
    return steps * batch / (time.perf_counter() - start)


def step_fed_by_the_loader(device: torch.device, step: Callable, batches: Iterator[dict], seconds: float) -> dict:
    """`step` on the loader's batches, from the second on, for `seconds`: steps, the time it ran, and the time it
    waited for the loader."""
    steps, start = 0, None
    wait = 0.0
    while True:
        fetch = time.perf_counter()
        item = next(batches)
        text = item["text"].to(device, non_blocking=True)
        codes = item["codes"].to(device, non_blocking=True)
        if start is not None:
            wait += time.perf_counter() - fetch
        step(text, codes)
        if start is None:
            synchronize(device)
            start = time.perf_counter()
            continue
        steps += 1
        if time.perf_counter() - start >= seconds:
            break
    synchronize(device)
    return {"steps": steps, "elapsed": time.perf_counter() - start, "wait": wait}


def loader_and_step(
    device: torch.device,
    step: Callable,
    streams: Callable[[int], Iterable[dict]],
    batch: int,
    seconds: float,
    alone: float,
) -> dict:
    """The loader (0 and 2 workers) feeding `step`: samples/s, against the step alone, and the share of the time
    spent waiting for the loader."""
    together = {}
    for workers in (0, 2):
        fed = step_fed_by_the_loader(device, step, iter(streams(workers)), seconds)
        steps, elapsed = fed["steps"], fed["elapsed"]
        together[workers] = {
            "samples_per_s": steps * batch / elapsed,
            "share_of_step_alone": steps * batch / elapsed / alone,
            "share_of_time_waiting_for_the_loader": fed["wait"] / elapsed,
        }
        console.print(f"  loader ({workers} workers) + step: {together[workers]}")
    return together


def bench_stream(device: torch.device, dataset: Path, batch: int, seconds: float) -> dict:
    """The loader alone (into the device), the small preset's step alone, and the two together (samples/s)."""
    from pipeline.core.stream import CodeStream
    from training.config import PRESETS

    config = PRESETS["small"].model
    pin = device.type == "cuda"

    def streams(workers: int) -> CodeStream:
        return CodeStream(dataset, batch_size=batch, text_len=config.text_len, seed=0, num_workers=workers,
                          pin_memory=pin)  # fmt: skip

    result: dict = {"batch": batch, "pin_memory": pin}
    result["loader_samples_per_s"] = loader_alone(device, streams, seconds)
    step = small_preset_step(device, config)
    alone = step_alone(device, step, next(iter(streams(0))), batch, seconds)
    result["step_alone_samples_per_s"] = alone
    console.print(f"  small preset step alone (batch {batch}, data already on {device}): {alone:,.1f} samples/s")
    result["loader_and_step"] = loader_and_step(device, step, streams, batch, seconds, alone)
    return result


def compare_datasets(a: Path, b: Path) -> dict:
    """Share of equal codes between two outputs of `ttt preprocess` on the same rows, matched by key."""
    import pyarrow.parquet as pq

    def read(folder: Path) -> dict[str, np.ndarray]:
        rows = {}
        for file in sorted(folder.rglob("*.parquet")):
            table = pq.read_table(file, columns=["key", "code"]).to_pydict()
            for key, code in zip(table["key"], table["code"], strict=True):
                rows[key] = np.frombuffer(code, dtype="<i2")
        return rows

    left, right = read(a), read(b)
    shared = sorted(set(left) & set(right))
    equal = sum(int((left[k] == right[k]).sum()) for k in shared)
    total = sum(left[k].size for k in shared)
    return {"rows_a": len(left), "rows_b": len(right), "rows_compared": len(shared), "equal_codes": equal / total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="encode,optimizer,step,stream")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--images", type=int, default=512, help="sample images to encode")
    parser.add_argument("--cpu-check", type=int, default=32, help="of them, also encoded in fp32 on the CPU")
    parser.add_argument("--step-preset", default="ttt-1.1b")
    parser.add_argument("--step-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--stream-dataset", help="a folder of 1024-code rows (made by write_paper_scale)")
    parser.add_argument("--stream-rows", type=int, default=4096, help="rows to write when no --stream-dataset")
    parser.add_argument("--stream-batch", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0, help="per stream measurement")
    parser.add_argument("--compare-datasets", nargs=2, metavar=("A", "B"))
    parser.add_argument("--name", default="gpu", help="results file name under bench/results/")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.compare_datasets:
        result = compare_datasets(*map(Path, args.compare_datasets))
        console.print(result)
        return
    device = torch.device(args.device)
    parts = set(args.parts.split(","))
    results: dict = {"device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
    if "encode" in parts:
        console.print("full-size f=8 GumbelVQ encode at 256 px")
        results["encode"] = bench_encode(device, args.images, args.cpu_check)
    if "optimizer" in parts:
        console.print("the 8-bit LAMB on the CPU and on the device")
        results["optimizer"] = bench_optimizer(device)
    if "step" in parts:
        console.print(f"one training step of {args.step_preset} at batch {args.step_batch}")
        results["step"] = bench_step(device, args.step_preset, args.step_batch, args.steps)
    if "stream" in parts:
        console.print("the streaming loader into a training step")
        with tempfile.TemporaryDirectory(prefix="ttt-bench-gpu-stream-") as tmp:
            dataset = Path(args.stream_dataset) if args.stream_dataset else Path(tmp) / "1024-codes"
            if not args.stream_dataset:
                from tests.support.datasets import write_paper_scale

                write_paper_scale(dataset, args.stream_rows)
            results["stream"] = bench_stream(device, dataset, args.stream_batch, args.seconds)
    save_results(args.name, results, started, console, keep_other_parts=True)


if __name__ == "__main__":
    main()
