"""Benchmark of reading a dataset from the Hub: the bytes the Hub serves for the streaming loader's reads, against
`datasets` streaming of the same files, in one run through the real clients (huggingface_hub's HfFileSystem,
`datasets`) and a local stand-in for the Hub's API (tests/support/hub_stand_in.py), which counts every byte it serves.

The dataset: files of 1024-code rows (random codes from 8192, Brotli 11, row groups of 1,024 rows, as
`ttt preprocess` writes them), 2 files of 8 row groups by default. Measured, each as the bytes of file data
served (LFS storage), the requests for it, and the share of the files' size:

- the loader's first batch: it reads every file's footer to index the dataset, then one row group;
- one epoch of the loader;
- `datasets.load_dataset(..., streaming=True)`: its first row, and all rows (the baseline).

Prints a table and writes every figure to bench/results/hub.json.

    .venv/bin/python -m bench.hub [--rows-per-file 8192] [--files 2]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.common import save_results
from tests.support.datasets import write_paper_scale
from tests.support.hub_stand_in import HubStandIn, folder_files

console = Console(width=130)
REPO = "bench/codes"


def bytes_served(hub: HubStandIn, lfs_objects: set[str], read: Callable[[], object]) -> dict:
    """What `read()` made the Hub serve of the dataset's files: bytes and requests."""
    seen = len(hub.log)
    read()
    data = [s for s in hub.log[seen:] if s.path.lstrip("/") in lfs_objects and s.method == "GET"]
    return {"bytes": sum(s.sent for s in data), "requests": len(data), "ranged": sum(s.range is not None for s in data)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows-per-file", type=int, default=8192, help="a multiple of 1024 (one row group each)")
    parser.add_argument("--files", type=int, default=2)
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ttt-bench-hub-") as tmp, HubStandIn(root=Path(tmp) / "hub") as hub:
        folder = Path(tmp) / "codes"
        console.print(f"writing {args.files} files of {args.rows_per_file:,} rows of 1024 codes (Brotli 11)")
        write_paper_scale(folder, args.files * args.rows_per_file, args.rows_per_file)
        repo = hub.create("dataset", REPO, folder_files(folder))
        size = sum((repo.folder / path).stat().st_size for path in repo.lfs)
        # huggingface_hub and datasets read the endpoint when they are imported: only now.
        os.environ.update(hub.environ(None, Path(tmp) / "hf-home"))
        import datasets

        from pipeline.core.stream import CodeStream

        source, rows = f"hf://datasets/{REPO}", args.files * args.rows_per_file

        def first_batch() -> None:
            next(iter(CodeStream(source, batch_size=64, shuffle_buffer=64, seed=0)))

        def one_epoch() -> None:
            assert sum(len(batch["key"]) for batch in CodeStream(source, batch_size=512, epochs=1)) == rows

        def datasets_first_row() -> None:
            next(iter(datasets.load_dataset(REPO, streaming=True, split="train")))

        def datasets_all_rows() -> None:
            assert sum(1 for _ in datasets.load_dataset(REPO, streaming=True, split="train")) == rows

        lfs_objects = set(repo.lfs.values())
        reads = {
            "loader: first batch": first_batch,
            "loader: one epoch": one_epoch,
            "datasets streaming: first row": datasets_first_row,
            "datasets streaming: all rows": datasets_all_rows,
        }
        results = {name: bytes_served(hub, lfs_objects, read) for name, read in reads.items()}
    groups = args.files * args.rows_per_file // 1024
    table = Table(title=f"bytes the Hub served of {args.files} files ({size / 1e6:,.1f} MB, {groups} row groups)")
    for column in ("read", "bytes served", "of the files", "requests", "of them ranged"):
        table.add_column(column, justify="right")
    for name, result in results.items():
        result["share"] = result["bytes"] / size
        table.add_row(name, f"{result['bytes'] / 1e6:,.2f} MB", f"{result['share']:.1%}", str(result["requests"]),
                      str(result["ranged"]))  # fmt: skip
    console.print(table)
    first, whole = results["loader: first batch"]["bytes"], results["datasets streaming: first row"]["bytes"]
    console.print(f"to its first batch the loader read {whole / first:.1f}x fewer bytes than datasets to its first row")
    save_results("hub", {"dataset_bytes": size, "files": args.files, "rows_per_file": args.rows_per_file, **results},
                 started, console)  # fmt: skip


if __name__ == "__main__":
    main()
