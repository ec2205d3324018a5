"""Benchmark of the streaming loader on this machine, all in one run on the same files.

For 1024-code rows (256 px at f=8, codebook 8192, Brotli 11 as `ttt preprocess` writes them)
and for the embedded sample's rows (64 codes, made by `ttt preprocess`):

1. the loader on one core (decode, shuffle buffer, byte tokenizer, collate to tensors);
2. plain pyarrow reading the same columns of the same row groups (the floor);
3. `datasets` streaming of the same files, iterating rows and unpacking the codes (without our layer);
4. the loader with 2 DataLoader workers; bytes read per sample;
5. the loader on one core reading the blocks of each epoch it leased, as a peer of a swarm reads
   (training/swarm/leases.py): a DHT of its own, so every lease request is real and none waits on another peer.

Prints a table and writes every figure to bench/results/stream.json.

    .venv/bin/python -m bench.stream [--rows 8192] [--seconds 5]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from bench.common import save_results
from pipeline.core.stream import CodeStream
from pipeline.core.stream_bench import loader_rate, pyarrow_rate
from tests.support.datasets import write_paper_scale, write_sample

console = Console(width=160)


def datasets_rate(files: list[str], seconds: float) -> float:
    """`datasets` streaming of the same files: rows as dicts, codes unpacked with numpy."""
    import datasets

    datasets.disable_progress_bars()
    stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
    samples, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for row in stream:
            np.frombuffer(row["code"], dtype="<i2").astype(np.int64)
            row["caption"].encode()
            samples += 1
            if samples % 256 == 0 and time.perf_counter() - start >= seconds:
                break
    return samples / (time.perf_counter() - start)


def leased_rate(folder: Path, seconds: float) -> float:
    """The loader on one core from leased blocks (5. above)."""
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator

    from training.swarm.leases import LeaseBook, LeaseSource

    signer = RSASignatureValidator()
    dht = hivemind.DHT(start=True, record_validators=[signer])
    try:
        book = LeaseBook(dht, f"bench-stream-{folder.name}", signer.local_public_key)
        stream = CodeStream(folder, batch_size=64, text_len=64, seed=0)
        source = LeaseSource(book, [unit.rows for unit in stream.index.units], seed=0)
        return loader_rate(CodeStream(folder, batch_size=64, text_len=64, seed=0, blocks=source), seconds)
    finally:
        dht.shutdown()


def bench_dataset(folder: Path, seconds: float) -> dict:
    stream = CodeStream(folder, batch_size=64, text_len=64)
    rows = sum(unit.rows for unit in stream.index.units)
    result = {
        "rows": rows,
        "codes_per_sample": stream.grid[0] * stream.grid[1],
        "bytes_per_sample": sum(stream.index.bytes_per_unit) / rows,
        "loader_1_core": loader_rate(stream, seconds),
        "pyarrow_floor": pyarrow_rate(stream, seconds),
        "datasets_streaming": datasets_rate(stream.index.files, seconds),
        "loader_2_workers": loader_rate(CodeStream(folder, batch_size=64, text_len=64, num_workers=2), seconds),
        "loader_leased_1_core": leased_rate(folder, seconds),
    }
    console.print(f"  {folder.name}: " + ", ".join(f"{k} {v:,.0f}" for k, v in result.items()))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8192, help="1024-code rows to write (multiple of 1024)")
    parser.add_argument("--sample-rows", type=int, default=2400, help="embedded sample rows to preprocess")
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory(prefix="ttt-bench-stream-") as tmp:
        paper, sample = Path(tmp) / "1024-codes", Path(tmp) / "sample-64-codes"
        console.print(f"writing {args.rows:,} rows of 1024 codes (Brotli 11) and preprocessing the sample")
        write_paper_scale(paper, args.rows)
        write_sample(sample, args.sample_rows)
        for folder in (paper, sample):
            results[folder.name] = bench_dataset(folder, args.seconds)

    table = Table(title="streaming loader, samples/s on this CPU (batch 64, text 64, shuffle buffer 10,000)")
    for column in (
        "rows",
        "loader, 1 core",
        "pyarrow floor",
        "loader / floor",
        "datasets streaming",
        "loader / datasets",
        "loader, 2 workers",
        "leased, 1 core",
        "leased / loader",
        "bytes/sample",
    ):
        table.add_column(column, justify="right")
    for name, r in results.items():
        table.add_row(
            f"{name} ({r['rows']:,})",
            f"{r['loader_1_core']:,.0f}",
            f"{r['pyarrow_floor']:,.0f}",
            f"{r['loader_1_core'] / r['pyarrow_floor']:.2f}",
            f"{r['datasets_streaming']:,.0f}",
            f"{r['loader_1_core'] / r['datasets_streaming']:.1f}x",
            f"{r['loader_2_workers']:,.0f}",
            f"{r['loader_leased_1_core']:,.0f}",
            f"{r['loader_leased_1_core'] / r['loader_1_core']:.2f}",
            f"{r['bytes_per_sample']:,.0f}",
        )
    console.print(table)
    save_results("stream", results, started, console)


if __name__ == "__main__":
    main()
