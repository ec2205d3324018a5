import io

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.core.shard_format import (
    DatasetFacts,
    VQGANIdentity,
    binary_to_codes,
    build_shard_table,
    codes_to_binary,
    read_facts,
    shard_path,
    shard_to_bytes,
)

FACTS = DatasetFacts(
    codebook_size=8192,
    grid_height=32,
    grid_width=32,
    image_size=256,
    vqgan=VQGANIdentity("taming.models.vqgan.GumbelVQ", "v.yaml", "a" * 64, "b" * 64),
)


def row_columns(n):
    return {
        "key": [str(i) for i in range(n)],
        "caption": [f"caption {i}" for i in range(n)],
        "url": [f"http://x/{i}" for i in range(n)],
        "original_width": [640] * n,
        "original_height": [480] * n,
        "NSFW": ["UNLIKELY"] * n,
        "similarity": [0.3] * n,
        "license": [None] * n,
    }


def test_codes_round_trip_little_endian_int16():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 8192, size=(5, 32, 32))
    packed = codes_to_binary(codes, 8192)
    assert len(packed[0].as_py()) == 2048  # 1024 codes x 2 bytes, the LAION VQGAN-code layout
    first = packed[0].as_py()
    assert first[:2] == int(codes[0, 0, 0]).to_bytes(2, "little")
    for i in range(5):
        np.testing.assert_array_equal(binary_to_codes(packed[i].as_py(), 32, 32), codes[i])


def test_codes_outside_the_codebook_are_refused():
    with pytest.raises(ValueError, match="out of range"):
        codes_to_binary(np.full((1, 2, 2), 8192), 8192)
    with pytest.raises(ValueError, match="out of range"):
        codes_to_binary(np.full((1, 2, 2), -1), 8192)


def test_wrong_blob_length_is_refused():
    with pytest.raises(ValueError, match="expected 2048"):
        binary_to_codes(b"\x00" * 2046, 32, 32)


def test_shard_carries_facts_and_is_deterministic(tmp_path):
    codes = np.random.default_rng(1).integers(0, 8192, size=(3, 32, 32))
    table = build_shard_table(row_columns(3), codes, FACTS)
    data = shard_to_bytes(table)
    assert data == shard_to_bytes(build_shard_table(row_columns(3), codes, FACTS))
    path = tmp_path / "x.parquet"
    path.write_bytes(data)
    assert read_facts(path) == FACTS
    metadata = pq.ParquetFile(io.BytesIO(data)).metadata
    assert metadata.row_group(0).column(2).compression == "BROTLI"
    back = pq.read_table(path)
    assert back.column("key").to_pylist() == ["0", "1", "2"]
    assert back.column("license").null_count == 3
    np.testing.assert_array_equal(binary_to_codes(back.column("code")[2].as_py(), 32, 32), codes[2])


def test_grid_mismatch_is_refused():
    with pytest.raises(ValueError, match="does not match"):
        build_shard_table(row_columns(1), np.zeros((1, 16, 16), int), FACTS)


def test_shard_path_uses_hub_split_naming():
    assert shard_path(3, 512) == "data/train-00003-of-00512.parquet"


def test_a_shard_whose_every_download_failed_is_written_empty(tmp_path):
    empty = {name: [] for name in row_columns(0)}
    data = shard_to_bytes(build_shard_table(empty, np.zeros((0, 32, 32), dtype=np.int64), FACTS))
    path = tmp_path / "empty.parquet"
    path.write_bytes(data)
    assert pq.read_table(path).num_rows == 0
    assert read_facts(path) == FACTS
