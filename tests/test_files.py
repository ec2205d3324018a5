"""Atomic writes and checksums (pipeline.core.files): what every shard, checkpoint and PNG is written with."""

import hashlib

import pytest

from pipeline.core import files


def test_an_interrupted_atomic_write_leaves_neither_file(tmp_path, monkeypatch):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        files.write_atomic(tmp_path / "data" / "train-00000-of-00001.parquet", b"shard bytes")
    assert list((tmp_path / "data").iterdir()) == []


def test_an_atomic_write_replaces_the_whole_file_and_checksums_agree(tmp_path):
    path = tmp_path / "deep" / "file.bin"
    files.write_atomic(path, b"first version, longer")
    files.write_atomic(path, b"second")
    assert path.read_bytes() == b"second" and [p.name for p in path.parent.iterdir()] == ["file.bin"]
    data = bytes(range(256)) * 50_000  # larger than one read chunk
    path.write_bytes(data)
    expected = hashlib.sha256(data).hexdigest()
    assert files.sha256_file(path, chunk_size=1 << 16) == files.sha256_bytes(data) == expected
