"""Streaming hf://datasets/ORG/NAME through the real huggingface_hub client (and `datasets`) against the local
stand-in for the Hub's HTTP API: the same rows as the local folder, read by HTTP range, one row group at a time."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.stream import READ_COLUMNS, CodeStream
from tests.support.commands import run_ttt
from tests.support.datasets import write_paper_scale
from tests.support.hub_stand_in import HubStandIn, folder_files, run_client


def batches(stream: CodeStream) -> list[tuple[list[str], list[list[int]]]]:
    return [(batch["key"], batch["codes"].tolist()) for batch in stream]


READ_THROUGH_THE_HUB = """
import json, sys
import datasets
from pipeline.core.sources import local_copy
from pipeline.core.stream import CodeStream

rows = datasets.load_dataset(sys.argv[1], streaming=True, split="train")
stream = CodeStream(f"hf://datasets/{sys.argv[1]}", batch_size=32, epochs=1, seed=3)
print(json.dumps({
    "datasets": sorted([row["key"], row["caption"], row["code"].hex()] for row in rows),
    "stream": [(batch["key"], batch["codes"].tolist()) for batch in stream],
    "copy": local_copy(f"hf://datasets/{sys.argv[1]}"),  # what `ttt train --no-stream` trains from
}))
"""


def test_datasets_and_the_loader_read_the_same_rows_from_the_hub_as_from_the_folder(sample_dataset, tmp_path):
    local = pq.read_table(sample_dataset / "data", columns=["key", "caption", "code"]).to_pylist()
    expected = sorted([row["key"], row["caption"], row["code"].hex()] for row in local)
    with HubStandIn(root=tmp_path / "hub", page_size=3) as hub:  # 3 entries a page: listings paginate
        hub.create("dataset", "ttt-org/sample", folder_files(sample_dataset))
        read = run_client(READ_THROUGH_THE_HUB, hub.environ(None, tmp_path / "hf-home"), "ttt-org/sample")
        assert read.returncode == 0, read.stderr
        found = json.loads(read.stdout)
        tree_pages = [s for s in hub.log if "/tree/" in s.path]
    assert found["datasets"] == expected
    assert [tuple(b) for b in found["stream"]] == batches(CodeStream(sample_dataset, batch_size=32, epochs=1, seed=3))
    copy = Path(found["copy"])
    assert {p: data for p, data in folder_files(sample_dataset).items() if p.startswith("data/")} == {
        p.relative_to(copy).as_posix(): p.read_bytes() for p in sorted(copy.rglob("*.parquet"))
    }
    assert any("cursor=" in s.query for s in tree_pages) and all(s.status == 200 for s in tree_pages)


def row_group_ranges(data: bytes) -> list[str]:
    """The byte range of each row group's columns that the loader reads, as an HTTP Range header says it."""
    metadata = pq.ParquetFile(pa.BufferReader(data)).metadata
    ranges = []
    for group in range(metadata.num_row_groups):
        chunks = [metadata.row_group(group).column(i) for i in range(metadata.num_columns)]
        chunks = [c for c in chunks if c.path_in_schema in READ_COLUMNS]
        start = min(c.dictionary_page_offset or c.data_page_offset for c in chunks)
        end = max((c.dictionary_page_offset or c.data_page_offset) + c.total_compressed_size for c in chunks)
        ranges.append(f"bytes={start}-{end - 1}")
    return ranges


ONE_BATCH = """
from pipeline.core.stream import CodeStream
stream = CodeStream("hf://datasets/ttt-org/codes", batch_size=64, shuffle_buffer=64, seed=0)
print(len(next(iter(stream))["key"]))
"""
ONE_EPOCH = """
from pipeline.core.stream import CodeStream
print(sum(len(batch["key"]) for batch in CodeStream("hf://datasets/ttt-org/codes", batch_size=512, epochs=1)))
"""


def test_the_loader_reads_footers_and_row_groups_by_range_never_whole_files(tmp_path):
    write_paper_scale(tmp_path / "codes", 2 * 3 * 1024, 3 * 1024, grid=16, compression_level=1)
    files = folder_files(tmp_path / "codes")  # 2 files of 3 row groups of random codes (which do not compress)
    with HubStandIn(root=tmp_path / "hub") as hub:
        repo = hub.create("dataset", "ttt-org/codes", files)
        env = hub.environ(None, tmp_path / "hf-home")
        served = {}
        for name, code in (("one batch", ONE_BATCH), ("one epoch", ONE_EPOCH)):
            seen = len(hub.log)
            read = run_client(code, env)
            assert read.returncode == 0, read.stderr
            served[name] = [s for s in hub.log[seen:] if s.path.lstrip("/") in repo.lfs.values()]
    assert all(s.method == "GET" and s.status == 206 and s.range for s in served["one epoch"] + served["one batch"])
    sizes = [len(data) for data in files.values()]
    footers = {f"bytes={size - min(size, 64 * 1024)}-{size - 1}" for size in sizes}  # pyarrow reads the last 64 KB
    groups = [r for data in files.values() for r in row_group_ranges(data)]
    # The index reads every footer; one batch then takes one row group: a fifth of the bytes of the files.
    one_batch = [s.range for s in served["one batch"]]
    assert set(one_batch[:2]) == footers and len(one_batch) == 3 and one_batch[2] in groups
    assert sum(s.sent for s in served["one batch"]) < sum(sizes) / 4
    # A whole epoch takes each row group's columns once, and nothing of the columns it does not read.
    assert sorted(s.range for s in served["one epoch"]) == sorted([*footers, *groups])


def test_a_missing_dataset_a_refused_token_and_a_rate_limit_through_the_cli(sample_dataset, tmp_path):
    bench = ["stream-bench", "--seconds", "0.1"]
    with HubStandIn(root=tmp_path / "hub") as hub:
        hub.create("dataset", "ttt-org/sample", folder_files(sample_dataset))
        cases = [
            ("hf_ada", "hf://datasets/ttt-org/nothing", "cannot list hf://datasets/ttt-org/nothing: not found on the "
             "Hub, or private and the token may not read it (404 Repository not found)"),
            ("hf_forged", "hf://datasets/ttt-org/sample", "cannot list hf://datasets/ttt-org/sample: the Hub refused "
             "the token (401 Invalid credentials in Authorization header); set HF_TOKEN to a valid token from "
             "https://huggingface.co/settings/tokens"),
        ]  # fmt: skip
        for token, source, message in cases:
            refused = run_ttt(*bench, "--dataset", source, env=hub.environ(token, tmp_path / "hf-home"), check=False)
            assert refused.returncode == 1 and refused.stderr.strip().splitlines() == [f"Error: {message}"]
        # Reading the repository's info is a request huggingface_hub does not retry: the loader waits itself.
        hub.rate_limit("repo_info", 1)
        sample = "hf://datasets/ttt-org/sample"
        waited = run_ttt(*bench, "--dataset", sample, env=hub.environ("hf_ada", tmp_path / "hf-home"))
        assert "the Hub is rate limiting this client (429); waiting 1 s (attempt 1 of 5)" in waited.stderr
        assert "rows in the dataset" in waited.stdout
