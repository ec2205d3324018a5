"""`ttt stream-bench`: how fast this machine can feed a trainer from a code dataset.

Measures, in one run on the same files: the streaming loader (decode, shuffle, tokenize,
collate) and plain pyarrow reading the same columns with no per-row work (the floor any
loader pays), plus bytes read per sample.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pipeline.core.console import ttt_console
from pipeline.core.stream import CodeStream


@dataclass
class StreamRates:
    loader_samples_per_s: float
    pyarrow_samples_per_s: float
    bytes_per_sample: float
    codes_per_sample: int
    dropped: dict


def loader_rate(stream: CodeStream, seconds: float) -> float:
    """Samples/s the loader hands out, over at least `seconds` (the first batch, which opens files, excluded)."""
    batches = iter(stream)
    next(batches)
    samples, start = 0, time.perf_counter()
    for batch in batches:
        samples += len(batch["key"])
        if time.perf_counter() - start >= seconds:
            break
    return samples / (time.perf_counter() - start)


def pyarrow_rate(stream: CodeStream, seconds: float) -> float:
    """Samples/s of reading the same row groups and columns with pyarrow alone: the floor."""
    index = stream.index
    samples, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for unit in index.units:
            table = index.parquet(unit.file).read_row_group(unit.row_group, columns=index.columns)
            samples += table.num_rows
    return samples / (time.perf_counter() - start)


def bench_stream(
    source: str | Path,
    *,
    batch_size: int,
    text_len: int,
    num_workers: int,
    shuffle_buffer: int,
    seconds: float,
    console: Console | None = None,
) -> StreamRates:
    """Measure the loader against the pyarrow floor on `source`; print and return the figures."""
    console = console or ttt_console()
    stream = CodeStream(
        source, batch_size=batch_size, text_len=text_len, num_workers=num_workers, shuffle_buffer=shuffle_buffer
    )
    rows = sum(unit.rows for unit in stream.index.units)
    rates = StreamRates(
        loader_samples_per_s=loader_rate(stream, seconds),
        pyarrow_samples_per_s=pyarrow_rate(stream, seconds),
        bytes_per_sample=sum(stream.index.bytes_per_unit) / max(rows, 1),
        codes_per_sample=stream.grid[0] * stream.grid[1],
        dropped=stream.stats()["dropped"],
    )
    table = Table(title=f"ttt stream-bench {source}", show_header=False)
    table.add_row("rows in the dataset", f"{rows:,} ({rates.codes_per_sample} codes each)")
    table.add_row("readers", f"{num_workers} DataLoader workers" if num_workers else "in-process (one core)")
    table.add_row("loader: decode + shuffle + tokenize + collate", f"{rates.loader_samples_per_s:,.0f} samples/s")
    table.add_row("pyarrow alone, same columns (the floor)", f"{rates.pyarrow_samples_per_s:,.0f} samples/s")
    table.add_row("loader / pyarrow", f"{rates.loader_samples_per_s / rates.pyarrow_samples_per_s:.2f}")
    table.add_row("bytes read per sample (compressed)", f"{rates.bytes_per_sample:,.0f}")
    table.add_row("rows dropped", ", ".join(f"{k}: {v}" for k, v in rates.dropped.items()) or "none")
    console.print(table)
    return rates
