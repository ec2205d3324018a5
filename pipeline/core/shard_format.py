"""The shard format: the contract between preprocessing and training.

A published dataset is a directory that is also a Hugging Face dataset repository:

    README.md                               the data card (Hub YAML header + the run's facts)
    ttt_manifest.json                       every shard with its row count and sha256
    data/train-00000-of-000NN.parquet       Brotli-compressed parquet shards

Each row holds one image as VQGAN codes. The `code` column keeps the layout of the
public LAION VQGAN-code datasets: the little-endian int16 bytes of the row-major code
grid (1024 codes = 2048 bytes for 256 px at f=8). Dataset-level facts (codebook size,
grid shape, image size, which VQGAN) live in the parquet schema metadata under the key
`ttt`, so a loader can refuse a dataset that does not match its model.

This module imports only numpy and pyarrow so that training peers can read shards
without the preprocessing stack.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.layout import DATA_DIR, DEFAULT_COMPRESSION_LEVEL, SPLIT

FORMAT_VERSION = 1
SCHEMA_METADATA_KEY = b"ttt"
# int16 codes: the largest codebook the format can hold.
MAX_CODEBOOK_SIZE = 2**15
ROWS_PER_ROW_GROUP = 1024

ROW_FIELDS = [
    pa.field("key", pa.string(), nullable=False),
    pa.field("caption", pa.string()),
    pa.field("code", pa.binary(), nullable=False),
    pa.field("url", pa.string()),
    pa.field("original_width", pa.int32()),
    pa.field("original_height", pa.int32()),
    pa.field("NSFW", pa.string()),
    pa.field("similarity", pa.float64()),
    pa.field("license", pa.string()),
]
ROW_SCHEMA = pa.schema(ROW_FIELDS)


@dataclass(frozen=True)
class VQGANIdentity:
    """Which VQGAN produced the codes: enough to refuse a mismatched decoder."""

    target: str  # e.g. taming.models.vqgan.GumbelVQ
    config_name: str
    config_sha256: str
    ckpt_sha256: str


@dataclass(frozen=True)
class DatasetFacts:
    """Dataset-level facts stored in every shard's schema metadata and in the data card."""

    codebook_size: int
    grid_height: int
    grid_width: int
    image_size: int
    vqgan: VQGANIdentity
    format_version: int = FORMAT_VERSION
    code_dtype: str = "<i2"

    @property
    def codes_per_image(self) -> int:
        return self.grid_height * self.grid_width

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> DatasetFacts:
        raw = json.loads(text)
        raw["vqgan"] = VQGANIdentity(**raw["vqgan"])
        return cls(**raw)


def shard_path(index: int, num_shards: int) -> str:
    """Relative path of shard `index`, in the Hub's `split-XXXXX-of-YYYYY` naming."""
    return f"{DATA_DIR}/{SPLIT}-{index:05d}-of-{num_shards:05d}.parquet"


def codes_to_binary(codes: np.ndarray, codebook_size: int) -> pa.Array:
    """Pack a batch of code grids [N, H, W] into a binary array of little-endian int16 rows.

    Values are checked against the codebook so that a broken encoder never writes a shard.
    """
    if codes.ndim != 3:
        raise ValueError(f"expected codes of shape [N, H, W], got {codes.shape}")
    if codes.size and (codes.min() < 0 or codes.max() >= codebook_size):
        raise ValueError(f"codes out of range for a codebook of {codebook_size}: min {codes.min()}, max {codes.max()}")
    # An explicit row width: a shard whose every download failed has no rows, and -1 cannot infer it.
    flat = np.ascontiguousarray(codes.reshape(len(codes), codes.shape[1] * codes.shape[2]), dtype="<i2")
    row_bytes = flat.shape[1] * 2
    offsets = np.arange(len(codes) + 1, dtype=np.int32) * row_bytes
    return pa.Array.from_buffers(pa.binary(), len(codes), [None, pa.py_buffer(offsets), pa.py_buffer(flat)])


def binary_to_codes(blob: bytes, grid_height: int, grid_width: int) -> np.ndarray:
    """Unpack one row's `code` bytes into an int64 grid [H, W]."""
    expected = grid_height * grid_width * 2
    if len(blob) != expected:
        raise ValueError(f"code blob has {len(blob)} bytes, expected {expected} for a {grid_height}x{grid_width} grid")
    return np.frombuffer(blob, dtype="<i2").astype(np.int64).reshape(grid_height, grid_width)


def build_shard_table(rows: Mapping[str, Sequence], codes: np.ndarray, facts: DatasetFacts) -> pa.Table:
    """Assemble one shard: row columns (all but `code`, lists or pandas Series; NaN/NA become null)
    plus the packed codes, with the facts attached."""
    if codes.shape[1:] != (facts.grid_height, facts.grid_width):
        raise ValueError(
            f"code grid {tuple(codes.shape[1:])} does not match the dataset's {facts.grid_height}x{facts.grid_width}"
        )
    columns = {}
    for schema_field in ROW_FIELDS:
        if schema_field.name == "code":
            columns["code"] = codes_to_binary(codes, facts.codebook_size)
        else:
            columns[schema_field.name] = pa.array(rows[schema_field.name], type=schema_field.type, from_pandas=True)
    schema = ROW_SCHEMA.with_metadata({SCHEMA_METADATA_KEY: facts.to_json().encode()})
    return pa.Table.from_pydict(columns, schema=schema)


def shard_to_bytes(table: pa.Table, compression_level: int = DEFAULT_COMPRESSION_LEVEL) -> bytes:
    """Serialize a shard as Brotli parquet. Deterministic for the same table and level."""
    sink = io.BytesIO()
    pq.write_table(
        table,
        sink,
        compression="brotli",
        compression_level=compression_level,
        row_group_size=ROWS_PER_ROW_GROUP,
        # Codes are high-entropy and unique per row: dictionary pages only cost space there.
        use_dictionary=[name for name in table.column_names if name != "code"],
    )
    return sink.getvalue()


def read_facts(parquet_path: str | Path) -> DatasetFacts:
    """Read the dataset facts from a shard's schema metadata (reads only the footer)."""
    metadata = pq.read_schema(parquet_path).metadata or {}
    if SCHEMA_METADATA_KEY not in metadata:
        raise ValueError(f"{parquet_path} has no ttt dataset facts in its schema metadata")
    return DatasetFacts.from_json(metadata[SCHEMA_METADATA_KEY])
