"""Benchmark of VQGAN encode and decode on this machine, all in one run.

1. images/s to encode (image -> codes) and decode (codes -> image) for the shipped sample VQGAN
   (64 px -> 8x8 codes) and for the paper's full-size f=8 GumbelVQ (8192 codes, random weights,
   256 px -> 32x32 codes), at batch sizes 1..32, through the pipeline's own encode/decode;
   the ratio of the two models' speeds at each batch size;
2. the shipped checkpoint's held-out quality, re-measured from the file (PSNR, judge, codebook use).

Prints a table and writes every figure to bench/results/vqgan.json.

    .venv/bin/python -m bench.vqgan [--threads 2] [--heldout 400]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench.common import save_results, timed
from pipeline.vqgan.codec import build_vqgan, decode, encode, first_stage_config, load_vqgan, sample_vqgan_spec
from pipeline.vqgan.train import SampleImages, evaluate

REPO = Path(__file__).resolve().parent.parent
FULL_VQGAN_CONFIG = REPO / "tests" / "data" / "vqgan_gumbel_f8_8192.yaml"
BATCH_SIZES = (1, 2, 4, 8, 16, 32)

console = Console(width=130)


def rate(work, min_seconds: float) -> float:
    """Calls of `work` per second, over at least `min_seconds` (at least one call)."""
    runs, seconds = timed(work, min_seconds)
    return runs / seconds


def bench_model(model: torch.nn.Module, params: dict, image_size: int, min_seconds: float) -> dict:
    """Encode and decode images/s at each batch size (`params`: the config's model.params)."""
    grid = image_size // 2 ** (len(params["ddconfig"]["ch_mult"]) - 1)
    decode(model, encode(model, torch.zeros(1, 3, image_size, image_size)))  # warm up: first calls allocate
    results = {}
    for batch in BATCH_SIZES:
        pixels = torch.rand(batch, 3, image_size, image_size) * 2 - 1
        codes = torch.randint(0, params["n_embed"], (batch, grid, grid))
        results[batch] = {
            "encode": batch * rate(lambda p=pixels: encode(model, p), min_seconds),
            "decode": batch * rate(lambda c=codes: decode(model, c), min_seconds),
        }
        rates = results[batch]
        console.print(f"  batch {batch:>2}: encode {rates['encode']:8.2f}  decode {rates['decode']:8.2f} images/s")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--heldout", type=int, default=400, help="held-out images to re-measure quality on")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    console.print(f"shipped sample VQGAN, 64 px, {args.threads} threads")
    spec = sample_vqgan_spec()
    shipped = load_vqgan(spec)
    shipped_rates = bench_model(shipped, spec.params, 64, min_seconds=1.0)

    console.print(f"full-size f=8 GumbelVQ (random weights), 256 px, {args.threads} threads")
    config = first_stage_config(FULL_VQGAN_CONFIG)
    full = build_vqgan(config["target"], config["params"]).eval().requires_grad_(False)
    full_rates = bench_model(full, config["params"], 256, min_seconds=0.0)

    images, captions = SampleImages(64, seed=0).heldout_set(args.heldout)
    quality = evaluate(shipped, images, captions)

    table = Table(title=f"VQGAN images/s on this CPU ({args.threads} threads)")
    for column in ("batch", "sample encode", "sample decode", "full f=8 encode", "full f=8 decode", "ratio enc / dec"):
        table.add_column(column, justify="right")
    for batch in BATCH_SIZES:
        small, big = shipped_rates[batch], full_rates[batch]
        table.add_row(
            str(batch),
            f"{small['encode']:,.1f}",
            f"{small['decode']:,.1f}",
            f"{big['encode']:,.2f}",
            f"{big['decode']:,.2f}",
            f"{small['encode'] / big['encode']:,.0f}x / {small['decode'] / big['decode']:,.0f}x",
        )
    console.print(table)
    console.print(
        f"shipped checkpoint on {quality.images} held-out images: PSNR {quality.psnr_db:.2f} dB, "
        f"judged correct {quality.judged_correct:.1%}, {quality.codes_used} of {quality.codebook_size} codes used "
        f"(perplexity {quality.perplexity:.1f})"
    )
    results = {
        "threads": args.threads,
        "sample_vqgan_images_per_s": shipped_rates,
        "full_f8_images_per_s": full_rates,
        "sample_vqgan_heldout": asdict(quality),
    }
    save_results("vqgan", results, started, console)


if __name__ == "__main__":
    main()
