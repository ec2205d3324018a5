"""Benchmark of `ttt preprocess` on this machine, all in one run on the same data.

1. each stage alone in this process, one after another on one core (filter, download, encode,
   write), on the embedded sample served from 127.0.0.1; the CPU bound of the pipeline is
   workers / (1/download + 1/encode + 1/write);
2. the real pipeline end to end (`preprocess()` of the sample's metadata, from reading it to the
   data card) on a LocalCluster started beforehand (one worker per core) whose workers have imported
   the stages and loaded the VQGAN: once with the image server answering at once, once with it
   waiting --latency seconds per image as web hosts do; the ratios: no delay / CPU bound, and
   with latency / no delay;
3. `ttt preprocess` of the sample as a user runs it (cold: generating the sample, cluster start,
   worker imports, VQGAN loading, cluster stop included), and bytes per sample of its output
   against the codebook's entropy bound and the JPEGs downloaded;
4. the shard format at the paper's scale (32x32 codes from 8192, no VQGAN): bytes per sample
   against the 13-bit bound and the codes' entropy, at the default and at a fast Brotli level;
5. with --full-vqgan, encode speed of the paper's full-size f=8 GumbelVQ (random weights) at 256 px.

Prints tables and writes every figure to bench/results/preprocess.json.

    .venv/bin/python -m bench.preprocess [--rows 6000] [--shards 24] [--latency 0.3] [--full-vqgan]
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from bench.common import save_results, timed

# Heavy modules are imported inside the functions: Dask's spawned workers re-import this script.
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

REPO = Path(__file__).resolve().parent.parent
FULL_VQGAN_CONFIG = REPO / "tests" / "data" / "vqgan_gumbel_f8_8192.yaml"
PAPER_ROWS, PAPER_GRID, PAPER_CODEBOOK = 4096, 32, 8192
FAST_BROTLI_LEVEL = 8
QUOTED_PHOTO_JPEG_BYTES = 30_000  # DESIGN.md's 256 px photo at q95: quoted, not measured here

console = Console(width=130)


def bench_stages(rows, num_shards: int) -> dict:
    """Every stage alone in this process, one after another, on the same rows (samples/s, one core)."""
    import torch

    from pipeline.core.filters import FilterConfig, apply_filters
    from pipeline.core.shard_format import DatasetFacts
    from pipeline.preprocess.download import DownloadSettings, download_shard
    from pipeline.preprocess.encode import EncodeSettings, encode_shard
    from pipeline.preprocess.run import SAMPLE_IMAGE_SIZE, plan_shards
    from pipeline.preprocess.writer import WriteSettings, serialize_shard, write_shard
    from pipeline.vqgan.codec import sample_vqgan_spec

    rates = {}
    runs, seconds = timed(lambda: apply_filters(rows, FilterConfig()), min_seconds=1.0)
    rates["filter"] = len(rows) * runs / seconds
    kept, _ = apply_filters(rows, FilterConfig())
    plan = plan_shards(kept, num_shards)

    download = DownloadSettings(image_size=SAMPLE_IMAGE_SIZE)
    download_shard(0, kept.iloc[:4], download)  # imports img2dataset once, as a worker's first task does
    batches = []
    _, seconds = timed(lambda: batches.extend(download_shard(i, r, download) for i, r in enumerate(plan)))
    rates["download"] = len(kept) / seconds

    torch.set_num_threads(1)  # each Dask worker is single-threaded
    spec = sample_vqgan_spec()
    encode = EncodeSettings(SAMPLE_IMAGE_SIZE, batch_size=32, device="cpu")
    encode_shard(batches[0], spec, encode)  # loads the model, as a worker's first encode task does
    encoded = []
    _, seconds = timed(lambda: encoded.extend(encode_shard(batch, spec, encode) for batch in batches))
    images = sum(len(e.codes) for e in encoded)
    rates["encode"] = images / seconds

    side = spec.grid_side(SAMPLE_IMAGE_SIZE)
    write = WriteSettings(DatasetFacts(spec.codebook_size, side, side, SAMPLE_IMAGE_SIZE, spec.identity), num_shards)
    with tempfile.TemporaryDirectory(prefix="ttt-bench-write-") as folder:

        def write_all() -> None:
            for index, (codes, shard_rows) in enumerate(zip(encoded, plan, strict=True)):
                write_shard(Path(folder), serialize_shard(codes, write, index, len(shard_rows)))

        runs, seconds = timed(write_all, min_seconds=1.0)
    rates["write"] = images * runs / seconds
    return rates


def cpu_bound(stages: dict, workers: int) -> float:
    """Samples/s of `workers` cores that each run a shard's download, encode and write at their speeds alone."""
    return workers / sum(1 / stages[stage] for stage in ("download", "encode", "write"))


def warm_worker() -> None:
    """What a worker's first tasks do once: import the stages (img2dataset, torch, the writer), load the VQGAN."""
    import img2dataset.downloader  # noqa: F401

    import pipeline.preprocess.writer  # noqa: F401 (imports the encode stage with it)
    from pipeline.core.devices import pick_device
    from pipeline.vqgan.codec import cached_vqgan, sample_vqgan_spec

    cached_vqgan(sample_vqgan_spec(), pick_device("auto"))


def bench_warm_cluster(metadata: Path, num_shards: int, port: int, latency: float) -> dict:
    """The pipeline on the served sample's metadata, on a warm cluster (as every shard after a worker's
    first sees it): once with the images served at once, once `latency` seconds late."""
    from pipeline.preprocess.graph import dask_client
    from pipeline.sample.domain import serve_folder

    runs = {}
    with dask_client(None) as client:
        client.run(warm_worker)
        workers = len(client.scheduler_info()["workers"])
        for name, delay in (("no_delay", 0.0), ("latency", latency)):
            with serve_folder(metadata.parent, port, delay):
                runs[name] = run_pipeline(metadata, num_shards, client.scheduler.address)
    runs["workers"] = workers
    runs["same_shards_with_latency"] = runs["no_delay"].pop("sha256") == runs["latency"].pop("sha256")
    return runs


def timed_preprocess(**options) -> tuple:
    """`preprocess()` with these options into a temporary folder: (its summary, wall seconds)."""
    from pipeline.preprocess.run import PreprocessOptions, preprocess

    with tempfile.TemporaryDirectory(prefix="ttt-bench-e2e-") as folder:
        start = time.perf_counter()
        summary = preprocess(PreprocessOptions(output=folder, **options), console=Console(quiet=True))
        return summary, time.perf_counter() - start


def run_pipeline(metadata: Path, num_shards: int, scheduler: str) -> dict:
    """`preprocess()` of a metadata file on a running cluster, timed from reading the metadata to the card."""
    summary, wall = timed_preprocess(inputs=[str(metadata)], shards=num_shards, scheduler=scheduler)
    return {
        "wall_seconds": wall,
        "rows_written": summary.rows_written,
        "samples_per_s": summary.rows_written / wall,
        "stage_rates_in_pipeline": {stage: summary.stage_rate(stage) for stage in ("download", "encode", "write")},
        "sha256": [shard.sha256 for shard in summary.shards],
    }


def bench_cold_run(num_rows: int, num_shards: int, port: int) -> dict:
    """`ttt preprocess` of the embedded sample as a user runs it: generating the sample, LocalCluster start,
    worker imports, VQGAN loading and the cluster's stop included."""
    summary, wall = timed_preprocess(sample_rows=num_rows, sample_port=port, shards=num_shards)
    return {
        "wall_seconds": wall,
        "rows_written": summary.rows_written,
        "samples_per_s": summary.rows_written / wall,
        "bytes_per_sample": summary.bytes_per_sample,
        "jpeg_bytes_per_sample": summary.jpeg_bytes / summary.rows_written,
    }


def zeroth_order_entropy_bytes(codes: np.ndarray) -> float:
    counts = np.bincount(codes.reshape(-1), minlength=PAPER_CODEBOOK)
    p = counts[counts > 0] / codes.size
    return float(-(p * np.log2(p)).sum()) * PAPER_GRID * PAPER_GRID / 8


def bench_storage() -> dict:
    """Shards of synthetic 32x32 grids (1024 codes, 8192-code book): the format at the paper's scale."""
    from pipeline.core.shard_format import DatasetFacts, VQGANIdentity, build_shard_table, shard_to_bytes

    rng = np.random.default_rng(0)
    facts = DatasetFacts(PAPER_CODEBOOK, PAPER_GRID, PAPER_GRID, 256, VQGANIdentity("synthetic", "-", "-", "-"))
    shape = (PAPER_ROWS, PAPER_GRID, PAPER_GRID)
    grids = {
        "uniform": rng.integers(0, PAPER_CODEBOOK, shape),
        # Zipf-skewed usage with shuffled code ids, as a trained codebook's usage is.
        "zipf a=1.2": rng.permutation(PAPER_CODEBOOK)[(rng.zipf(1.2, shape) - 1) % PAPER_CODEBOOK],
    }
    rows = {
        "key": [str(i) for i in range(PAPER_ROWS)],
        "caption": ["a caption of typical length for a LAION image"] * PAPER_ROWS,
        "url": [f"https://example.com/images/{i:08d}.jpg" for i in range(PAPER_ROWS)],
        "original_width": [640] * PAPER_ROWS,
        "original_height": [480] * PAPER_ROWS,
        "NSFW": ["UNLIKELY"] * PAPER_ROWS,
        "similarity": [0.31] * PAPER_ROWS,
        "license": [None] * PAPER_ROWS,
    }
    results = {}
    for name, codes in grids.items():
        table = build_shard_table(rows, codes, facts)
        entry = {"entropy_bytes": zeroth_order_entropy_bytes(codes)}
        for label, level in (("default", None), ("fast", FAST_BROTLI_LEVEL)):
            start = time.perf_counter()
            data = shard_to_bytes(table) if level is None else shard_to_bytes(table, level)
            entry[label] = {
                "bytes_per_sample": len(data) / PAPER_ROWS,
                "rows_per_s": PAPER_ROWS / (time.perf_counter() - start),
            }
        results[name] = entry
    return results


def bench_full_vqgan(images: int = 8, batch_size: int = 4) -> dict:
    import torch

    from pipeline.vqgan.codec import build_vqgan, encode, first_stage_config

    model_config = first_stage_config(FULL_VQGAN_CONFIG)
    model = build_vqgan(model_config["target"], model_config["params"]).eval()
    pixels = torch.rand(images, 3, 256, 256) * 2 - 1
    results = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        encode(model, pixels[:1])
        _, seconds = timed(lambda: [encode(model, pixels[i : i + batch_size]) for i in range(0, images, batch_size)])
        results[f"{threads} thread(s)"] = images / seconds
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=6000, help="rows of the embedded sample")
    parser.add_argument("--shards", type=int, default=24)
    parser.add_argument("--port", type=int, default=18799, help="sample server port (the cold run uses port+1)")
    parser.add_argument("--latency", type=float, default=0.3, help="seconds the image server waits per image")
    parser.add_argument("--full-vqgan", action="store_true", help="also time the full-size f=8 GumbelVQ (slow)")
    args = parser.parse_args()

    started = time.perf_counter()
    results = measure(args.rows, args.shards, args.port, args.latency, args.full_vqgan)
    print_results(results)
    save_results("preprocess", results, started, console)


def measure(rows: int, shards: int, port: int, latency: float, full_vqgan: bool) -> dict:
    """Every stage alone on the same rows, then the whole pipeline, then storage at the paper's scale."""
    from pipeline.preprocess.metadata import read_metadata
    from pipeline.preprocess.options import ColumnMap
    from pipeline.sample.domain import serve_folder, write_sample

    with tempfile.TemporaryDirectory(prefix="ttt-bench-sample-") as folder:
        with serve_folder(Path(folder), port) as url:
            metadata = write_sample(Path(folder), url, rows)
            table = read_metadata([metadata], ColumnMap(), needs_size=True, needs_nsfw=True)
            stages = bench_stages(table, shards)
        warm = bench_warm_cluster(metadata, shards, port, latency)
    bound = cpu_bound(stages, warm["workers"])
    results = {
        "rows": rows,
        "shards": shards,
        "latency_seconds": latency,
        "stages_alone": stages,
        "cpu_bound": bound,
        "warm_cluster": warm,
        "cpu_bound_ratio": warm["no_delay"]["samples_per_s"] / bound,
        "latency_ratio": warm["latency"]["samples_per_s"] / warm["no_delay"]["samples_per_s"],
        "cold_run": bench_cold_run(rows, shards, port + 1),
        "storage_paper_scale": bench_storage(),
    }
    if full_vqgan:
        results["full_vqgan_images_per_s"] = bench_full_vqgan()
    return results


def print_results(results: dict) -> None:
    stages, warm, cold = results["stages_alone"], results["warm_cluster"], results["cold_run"]
    latency = results["latency_seconds"]
    title = f"ttt preprocess: {results['rows']} sample rows, {results['shards']} shards, {warm['workers']} workers"
    table = Table(title=title)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for stage, rate in stages.items():
        table.add_row(f"{stage} alone (samples/s, 1 core)", f"{rate:,.0f}")
    table.add_row(
        f"CPU bound: {warm['workers']} / (1/download + 1/encode + 1/write) (samples/s)", f"{results['cpu_bound']:,.1f}"
    )
    table.add_row("end to end, warm cluster, no delay (samples/s)", f"{warm['no_delay']['samples_per_s']:,.1f}")
    table.add_row(
        f"end to end, warm cluster, {latency} s per image (samples/s)", f"{warm['latency']['samples_per_s']:,.1f}"
    )
    table.add_row("ratio: no delay / CPU bound (goal >= 0.8)", f"{results['cpu_bound_ratio']:.2f}")
    table.add_row(f"ratio: {latency} s per image / no delay (goal >= 0.9)", f"{results['latency_ratio']:.2f}")
    table.add_row("same shards with latency as without", str(warm["same_shards_with_latency"]))
    for name in ("no_delay", "latency"):
        rates = " / ".join(f"{rate:,.0f}" for rate in warm[name]["stage_rates_in_pipeline"].values())
        table.add_row(f"download / encode / write in the pipeline, {name} (samples/s per worker)", rates)
    table.add_row("end to end, cold `ttt preprocess` of the sample (samples/s)", f"{cold['samples_per_s']:,.1f}")
    bound = 8 * 8 * math.log2(512) / 8  # the sample's 8x8 grid of a 512-code book
    table.add_row("sample: bytes/sample on disk (all columns)", f"{cold['bytes_per_sample']:,.1f}")
    table.add_row("sample: uniform-code entropy bound (8x8 x 9 bit)", f"{bound:,.1f}")
    table.add_row(
        "sample: JPEG bytes downloaded / bytes on disk",
        f"{cold['jpeg_bytes_per_sample'] / cold['bytes_per_sample']:.1f}x",
    )
    for name, entry in results["storage_paper_scale"].items():
        default, fast = entry["default"], entry["fast"]
        table.add_row(
            f"32x32 {name}: bytes/sample, Brotli 11 (vs 13-bit bound 1664, entropy {entry['entropy_bytes']:,.0f})",
            f"{default['bytes_per_sample']:,.0f} ({default['rows_per_s']:,.0f} rows/s)",
        )
        table.add_row(
            f"32x32 {name}: bytes/sample, Brotli {FAST_BROTLI_LEVEL}",
            f"{fast['bytes_per_sample']:,.0f} ({fast['rows_per_s']:,.0f} rows/s)",
        )
        table.add_row(
            f"32x32 {name}: quoted 30 KB photo JPEG / bytes on disk",
            f"{QUOTED_PHOTO_JPEG_BYTES / default['bytes_per_sample']:.1f}x",
        )
    for threads, rate in results.get("full_vqgan_images_per_s", {}).items():
        table.add_row(f"full-size f=8 GumbelVQ encode at 256 px, {threads} (images/s)", f"{rate:.2f}")
    console.print(table)


if __name__ == "__main__":
    main()
