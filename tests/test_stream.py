"""The streaming loader: round trip, exact resume, peers, workers, faults, refusals."""

import itertools
import json
import signal
import subprocess
import sys
from collections import Counter
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.core.filters import FilterConfig
from pipeline.core.shard_format import DatasetFacts, VQGANIdentity, build_shard_table, shard_path
from pipeline.core.stream import (
    CORRUPT_CAPTION,
    CORRUPT_CODE_LENGTH,
    CORRUPT_CODE_RANGE,
    CodeStream,
    StreamError,
    index_dataset,
)
from pipeline.core.text import PAD_ID, ByteTokenizer, load_tokenizer
from tests.support.commands import run_ttt

GRID, CODEBOOK = 4, 64
IDENTITY = VQGANIdentity("taming.models.vqgan.VQModel", "m.yaml", "a" * 64, "b" * 64)
FACTS = DatasetFacts(CODEBOOK, GRID, GRID, 32, IDENTITY)


def write_dataset(folder: Path, files: int = 6, rows_per_file: int = 40, row_group: int = 10) -> list[str]:
    """A ttt dataset with small row groups (many reading units); returns every key."""
    keys = []
    rng = np.random.default_rng(0)
    for index in range(files):
        names = [f"{index:02d}-{row:03d}" for row in range(rows_per_file)]
        rows = {
            "key": names,
            "caption": [f"caption of {name}" for name in names],
            "url": [f"http://x/{name}" for name in names],
            "original_width": [100] * rows_per_file,
            "original_height": [100] * rows_per_file,
            "NSFW": ["UNLIKELY"] * rows_per_file,
            "similarity": [0.3] * rows_per_file,
            "license": ["?"] * rows_per_file,
        }
        codes = rng.integers(0, CODEBOOK, (rows_per_file, GRID, GRID))
        path = folder / shard_path(index, files)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(build_shard_table(rows, codes, FACTS), path, row_group_size=row_group)
        keys += names
    return keys


@pytest.fixture
def dataset(tmp_path):
    folder = tmp_path / "codes"
    return folder, write_dataset(folder)


def read_all(stream) -> list[str]:
    return [key for batch in stream for key in batch["key"]]


def test_round_trip_against_ttt_preprocess_output(sample_dataset):
    stored = datasets.load_dataset(str(sample_dataset), split="train")
    by_key = {row["key"]: row for row in stored}
    stream = CodeStream(sample_dataset, batch_size=16, text_len=24, epochs=1, shuffle_buffer=50, seed=3)
    assert (stream.codebook_size, stream.grid, stream.vocab_size, stream.pad_id) == (512, (8, 8), 257, PAD_ID)
    seen = []
    for batch in stream:
        assert batch["codes"].shape[1] == 64 and batch["text"].shape[1] == 24
        columns = batch["key"], batch["caption"], batch["codes"], batch["text"]
        for key, caption, codes, text in zip(*columns, strict=True):
            row = by_key[key]
            assert caption == row["caption"]
            assert codes.tolist() == np.frombuffer(row["code"], "<i2").tolist()
            encoded = list(caption.encode()[:24])
            assert text.tolist() == encoded + [PAD_ID] * (24 - len(encoded))
        seen += batch["key"]
    assert sorted(seen) == sorted(by_key) and seen != stored["key"]  # every row once, shuffled
    assert stream.stats() == {"emitted": len(by_key), "dropped": {}}


CONSUMER = """
import json, os, signal, sys
from pipeline.core.stream import CodeStream
settings, state_path, keys_path, batches = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
stream = CodeStream(**settings)
if os.path.exists(state_path):
    stream.load_state_dict(json.load(open(state_path)))
keys = []
for index, batch in enumerate(stream):
    keys += batch["key"]
    if index + 1 == batches:
        json.dump(keys, open(keys_path, "w"))
        json.dump(stream.state_dict(), open(state_path, "w"))
        os.kill(os.getpid(), signal.SIGKILL)  # a crash: nothing after the saved state survives
json.dump(keys, open(keys_path, "w"))
"""


def consume(settings: dict, state: Path, keys: Path, batches: int) -> tuple[int, list[str]]:
    result = subprocess.run(
        [sys.executable, "-c", CONSUMER, json.dumps(settings), str(state), str(keys), str(batches)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
        timeout=300,
    )
    assert result.returncode in (0, -signal.SIGKILL), result.stderr
    return result.returncode, json.loads(keys.read_text())


@pytest.mark.parametrize(
    "cut, workers",
    [
        (1, 0),  # mid-buffer: the buffer is still filling
        (9, 0),  # mid-epoch, buffer full
        (35, 0),  # in the second epoch, with rows of the first still in the buffer
        (7, 2),  # two DataLoader workers, batches prefetched but never consumed
    ],
)
def test_exact_resume_after_sigkill(dataset, tmp_path, cut, workers):
    folder, keys = dataset
    settings = {
        "source": str(folder),
        "batch_size": 8,
        "epochs": 2,
        "shuffle_buffer": 30,
        "seed": 11,
        "num_workers": workers,
    }
    _, uninterrupted = consume(settings, tmp_path / "none", tmp_path / "all.json", -1)
    assert Counter(uninterrupted) == Counter(keys * 2)
    code, before = consume(settings, tmp_path / "state.json", tmp_path / "before.json", cut)
    assert code == -signal.SIGKILL and len(before) == cut * 8
    code, after = consume(settings, tmp_path / "state.json", tmp_path / "after.json", -1)
    assert code == 0
    assert before + after == uninterrupted  # nothing repeated, nothing skipped, the same order


def take(stream: CodeStream, count: int | None = None) -> list[tuple[list[str], list[list[int]]]]:
    """The stream's next `count` batches (all of them when None) as what a trainer sees: (captions, codes)."""
    return [(batch["caption"], batch["codes"].tolist()) for batch in itertools.islice(stream, count)]


def resume(settings: dict, state: dict) -> CodeStream:
    """A fresh stream continuing from `state`, after the JSON round trip of a checkpoint."""
    stream = CodeStream(**settings)
    stream.load_state_dict(json.loads(json.dumps(state)))
    return stream


def reader_epochs(stream: CodeStream) -> set[int]:
    """The epochs the stream's readers are in (of those that handed out a batch)."""
    return {reader["epoch"] for reader in stream.state_dict()["workers"] if reader is not None}


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # more workers than this machine's cores
@pytest.mark.parametrize(
    "workers, rank, world_size, first_cut, second_cut",
    [
        (1, 0, 1, 5, 37),
        (3, 0, 1, 4, 40),
        (5, 0, 1, 7, 33),
        # The fifth reader has 4 row groups to the others' 5: at the second cut it has run out, and it is due next.
        (5, 0, 1, 3, 58),
        (3, 1, 2, 2, 20),  # the readers of the second of two ranks
    ],
)
def test_resume_with_workers_continues_the_same_order(dataset, workers, rank, world_size, first_cut, second_cut):
    """Cut in the first epoch and again, in the resumed stream, in the second: batch for batch the same stream."""
    folder, _ = dataset
    settings = {"source": folder, "batch_size": 8, "epochs": 2, "shuffle_buffer": 30, "seed": 11}
    settings.update(num_workers=workers, rank=rank, world_size=world_size)
    uninterrupted = take(CodeStream(**settings))
    stream = CodeStream(**settings)
    first = take(stream, first_cut)
    assert reader_epochs(stream) == {0}
    stream = resume(settings, stream.state_dict())
    second = take(stream, second_cut - first_cut)
    assert reader_epochs(stream) == {1}
    stream = resume(settings, stream.state_dict())
    assert first + second + take(stream) == uninterrupted


def test_peers_read_in_different_orders_and_each_reads_everything(dataset):
    folder, keys = dataset
    first = read_all(CodeStream(folder, batch_size=8, epochs=1, shuffle_buffer=20, peer="QmPeerOne"))
    second = read_all(CodeStream(folder, batch_size=8, epochs=1, shuffle_buffer=20, peer="QmPeerTwo"))
    assert sorted(first) == sorted(second) == sorted(keys)
    assert first != second
    again = read_all(CodeStream(folder, batch_size=8, epochs=1, shuffle_buffer=20, peer="QmPeerOne"))
    assert again == first  # a peer's order is reproducible


def test_epochs_are_reshuffled(dataset):
    folder, keys = dataset
    both = read_all(CodeStream(folder, batch_size=10, epochs=2, shuffle_buffer=0, seed=5))
    assert both[: len(keys)] != both[len(keys) :] and sorted(both[: len(keys)]) == sorted(keys)


@pytest.mark.parametrize("workers", [0, 2])
def test_explicit_split_ranks_and_workers_never_overlap(dataset, workers):
    folder, keys = dataset
    ranks = [
        read_all(CodeStream(folder, batch_size=8, epochs=1, rank=r, world_size=2, num_workers=workers, seed=7))
        for r in range(2)
    ]
    assert not set(ranks[0]) & set(ranks[1])
    assert sorted(ranks[0] + ranks[1]) == sorted(keys)


def test_dataloader_workers_do_not_duplicate(dataset):
    folder, keys = dataset
    seen = read_all(CodeStream(folder, batch_size=8, epochs=1, num_workers=2, seed=1))
    assert sorted(seen) == sorted(keys)


def fail_to_share(tensor):
    raise RuntimeError("Shared memory manager connection has timed out")


@pytest.mark.timeout(120)
def test_batches_reach_the_main_process_when_a_worker_cannot_share_tensor_memory(dataset, monkeypatch):
    """What hung a suite's peer: a worker's tensor whose sharing failed was dropped in its queue feeder thread, and
    the loader waited for that batch forever. Workers send arrays; the tensors are made in the main process."""
    monkeypatch.setitem(ForkingPickler._extra_reducers, torch.Tensor, fail_to_share)  # the forked workers see it
    folder, keys = dataset
    batches = list(CodeStream(folder, batch_size=8, epochs=1, num_workers=2, seed=1))
    assert sorted(key for batch in batches for key in batch["key"]) == sorted(keys)
    assert all(isinstance(batch["codes"], torch.Tensor) and batch["codes"].dtype == torch.int64 for batch in batches)


def test_corrupt_rows_are_skipped_and_counted(tmp_path):
    good = np.arange(GRID * GRID, dtype="<i2").tobytes()
    table = pa.table(
        {
            "key": ["ok", "short", "range", "caption", "null"],
            "caption": pa.array([b"fine", b"fine", b"fine", b"\xff\xfe bad", b"fine"], pa.binary()),
            "code": pa.array([good, good[:-2], np.full(16, 999, "<i2").tobytes(), good, None], pa.binary()),
        },
        metadata={b"ttt": FACTS.to_json().encode()},
    )
    pq.write_table(table, tmp_path / "part.parquet")
    stream = CodeStream(tmp_path / "part.parquet", batch_size=4, epochs=1)
    assert read_all(stream) == ["ok"]
    assert stream.stats()["dropped"] == {CORRUPT_CODE_LENGTH: 2, CORRUPT_CODE_RANGE: 1, CORRUPT_CAPTION: 1}


def test_the_laion_code_layout_with_on_the_fly_filters(tmp_path):
    """The public LAION VQGAN-code layout: no ttt facts, `code` int16 bytes, NSFW and original sizes."""
    codes = [np.full(GRID * GRID, i, "<i2").tobytes() for i in range(6)]
    table = pa.table(
        {
            "caption": ["a photo of a cat", "ok", "a wide panorama", "an nsfw one", "a dog", "a tree"],
            "code": codes,
            "NSFW": ["UNLIKELY", "UNLIKELY", "UNLIKELY", "NSFW", "UNLIKELY", "UNLIKELY"],
            "original_width": [256, 256, 1000, 256, 256, 256],
            "original_height": [256, 256, 200, 256, 256, 256],
            "url": [f"http://x/{i}" for i in range(6)],
        }
    )
    pq.write_table(table, tmp_path / "laion.parquet")
    stream = CodeStream(tmp_path / "laion.parquet", batch_size=8, epochs=1, filters=FilterConfig(), seed=0)
    batches = list(stream)
    assert stream.grid == (GRID, GRID) and stream.codebook_size is None  # grid inferred from the code length
    assert sorted(batches[0]["caption"]) == ["a dog", "a photo of a cat", "a tree"]
    dropped = stream.stats()["dropped"]
    assert dropped == {
        "filtered: caption too short": 1,
        "filtered: extreme aspect ratio": 1,
        "filtered: NSFW label not allowed": 1,
    }
    everything = CodeStream(tmp_path / "laion.parquet", batch_size=8, epochs=1)
    assert len(read_all(everything)) == 6  # filters only when asked


def test_a_mismatched_codebook_or_grid_is_refused_naming_both(sample_dataset):
    with pytest.raises(StreamError, match=r"codebook of 512 on a 8x8 grid, but the model expects a codebook of 8192"):
        CodeStream(sample_dataset, codebook_size=8192, grid=(32, 32))
    with pytest.raises(StreamError, match=r"expects a codebook of 512 on a 16x16 grid"):
        CodeStream(sample_dataset, codebook_size=512, grid=(16, 16))
    CodeStream(sample_dataset, codebook_size=512, grid=(8, 8))


def test_a_missing_dataset_is_one_clear_error(tmp_path):
    with pytest.raises(StreamError, match="no dataset at"):
        CodeStream(tmp_path / "nothing-here")
    with pytest.raises(StreamError, match="no dataset at"):
        CodeStream(f"file://{tmp_path}/nothing-here")


def test_an_fsspec_url_reads_like_a_local_folder(dataset):
    folder, keys = dataset
    remote = read_all(CodeStream(f"file://{folder}", batch_size=8, epochs=1, seed=2))
    local = read_all(CodeStream(folder, batch_size=8, epochs=1, seed=2))
    assert remote == local and sorted(local) == sorted(keys)


def test_transient_read_errors_are_retried_with_backoff(dataset, monkeypatch):
    folder, keys = dataset
    index = index_dataset(str(folder))
    real = pq.ParquetFile.read_row_group
    failures = {"left": 2}

    def flaky(self, *args, **kwargs):
        if failures["left"]:
            failures["left"] -= 1
            raise OSError("connection reset by peer")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", flaky)
    assert index.read_unit(0, retries=3, retry_delay=0.0).num_rows == 10
    failures["left"] = 5
    with pytest.raises(StreamError, match="after 3 attempts: connection reset"):
        index.read_unit(1, retries=2, retry_delay=0.0)


def test_a_state_from_another_stream_is_refused(dataset):
    folder, _ = dataset
    stream = CodeStream(folder, batch_size=8, seed=1)
    next(iter(stream))
    other = CodeStream(folder, batch_size=8, seed=2, shuffle_buffer=5)
    with pytest.raises(StreamError, match="different stream: seed, shuffle_buffer differ"):
        other.load_state_dict(stream.state_dict())


def as_version_1(state: dict) -> dict:
    """`state` as version 1 wrote it: without the reader due next."""
    return {**{key: value for key, value in state.items() if key != "next_reader"}, "version": 1}


def test_a_version_1_state_is_read_only_with_a_single_reader(dataset):
    """Version 1 did not record the reader due next: with one reader it is reader 0, with several it is unknown."""
    folder, _ = dataset
    settings = {"source": folder, "batch_size": 8, "seed": 1}
    uninterrupted = take(CodeStream(**settings), 5)
    stream = CodeStream(**settings)
    first = take(stream, 3)
    assert first + take(resume(settings, as_version_1(stream.state_dict())), 2) == uninterrupted
    settings["num_workers"] = 2
    stream = CodeStream(**settings)
    take(stream, 1)
    with pytest.raises(StreamError, match="stream state version 1 is not 2"):
        CodeStream(**settings).load_state_dict(as_version_1(stream.state_dict()))


def test_too_many_readers_for_the_row_groups(dataset):
    folder, _ = dataset
    with pytest.raises(StreamError, match="24 row groups cannot feed 32 readers"):
        next(iter(CodeStream(folder, world_size=32, rank=30, seed=0)))


def test_byte_and_json_tokenizers(tmp_path):
    tokens = ByteTokenizer().encode_batch(["héllo", ""], 4)
    assert tokens.tolist() == [[104, 195, 169, 108], [PAD_ID] * 4]
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, "red": 2, "circle": 3}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tok.json"))
    loaded = load_tokenizer(tmp_path / "tok.json")
    assert (loaded.vocab_size, loaded.pad_id) == (4, 0)
    assert loaded.encode_batch(["red circle blue"], 5).tolist() == [[2, 3, 1, 0, 0]]


def test_stream_bench_cli(sample_dataset, tmp_path):
    result = run_ttt("stream-bench", "--dataset", sample_dataset, "--seconds", 1)
    assert "samples/s" in result.stdout and "Traceback" not in result.stderr
    result = run_ttt("stream-bench", "--dataset", tmp_path / "missing", check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("Error: no dataset at")
