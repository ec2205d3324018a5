"""Stage 5: turn an encoded shard into Brotli parquet bytes (in the task), then write it atomically.

Serialising in the Dask task and writing in the driver means workers need no shared
storage with the output folder: a remote cluster only sends back a few MB per shard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.files import sha256_bytes, write_atomic
from pipeline.core.shard_format import (
    DEFAULT_COMPRESSION_LEVEL,
    DatasetFacts,
    build_shard_table,
    shard_path,
    shard_to_bytes,
)
from pipeline.preprocess.encode import CodeBatch
from pipeline.preprocess.manifest import ShardRecord

# Canonical metadata column -> shard column.
ROW_COLUMNS = {
    "key": "key",
    "caption": "caption",
    "url": "url",
    "width": "original_width",
    "height": "original_height",
    "nsfw": "NSFW",
    "similarity": "similarity",
    "license": "license",
}


@dataclass(frozen=True)
class WriteSettings:
    facts: DatasetFacts
    num_shards: int
    compression_level: int = DEFAULT_COMPRESSION_LEVEL


@dataclass
class ShardBlob:
    index: int
    data: bytes
    record: ShardRecord


def serialize_shard(encoded: CodeBatch, settings: WriteSettings, index: int, planned_rows: int) -> ShardBlob:
    start = time.perf_counter()
    rows = encoded.images.rows
    table = build_shard_table({ROW_COLUMNS[c]: rows[c] for c in ROW_COLUMNS}, encoded.codes, settings.facts)
    data = shard_to_bytes(table, settings.compression_level)
    record = ShardRecord(
        path=shard_path(index, settings.num_shards),
        rows=table.num_rows,
        bytes=len(data),
        sha256=sha256_bytes(data),
        planned_rows=planned_rows,
        jpeg_bytes=sum(len(j) for j in encoded.images.jpegs),
        failures=dict(encoded.images.failures),
        seconds={
            "download": encoded.images.seconds,
            "encode": encoded.seconds,
            "write": time.perf_counter() - start,
        },
    )
    return ShardBlob(index, data, record)


def write_shard(folder: Path, blob: ShardBlob) -> ShardRecord:
    """Put the shard in place atomically (temp + fsync + rename); the manifest records it afterwards."""
    start = time.perf_counter()
    write_atomic(folder / blob.record.path, blob.data)
    blob.record.seconds["write"] += time.perf_counter() - start
    return blob.record
