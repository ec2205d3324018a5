"""The streaming loader: feed a trainer from published code shards, resumable to the exact sample.

    stream = CodeStream("./ttt-data", batch_size=64, text_len=64, peer=my_peer_id)
    for batch in stream:        # {"text": [B, T], "codes": [B, H*W] (int64), "caption": [...], "key": [...]}
        ...
    state = stream.state_dict() # JSON-able; CodeStream(...).load_state_dict(state) continues exactly

How it reads. A dataset is a list of parquet files (`sources.list_files`: a local folder
or glob, a Hub repository through the Hub's fsspec filesystem, or any fsspec URL); their
row groups (1024 rows in `ttt preprocess` output) are the units of reading, and only the
footers are read up front. Epoch e visits every unit once, in an order shuffled with
(seed, e). Reading happens in slots: each of `world_size` ranks has one reader per DataLoader
worker (one without workers), each reader of each rank is one slot, and slot k takes every
k-th unit of the epoch's order, so slots never overlap. Rows then pass through a shuffle
buffer: each new row replaces a random buffered one, which is emitted. Independent
volunteers each read the whole dataset in their own order (their seed comes from their peer
identity).

How it resumes. A slot's state is where it stands (epoch, unit, rows taken from it), the
shuffle buffer as row coordinates, and the buffer's random state. Each batch carries its
slot's state; the loader keeps the state of the last batch it handed out per slot, so
batches prefetched but never consumed are produced again after a resume, and rows that
sat in the buffer are read back by coordinate. The DataLoader takes batches from its workers
in turn, always starting with worker 0 and skipping those that ran out, so the state also
records which reader is due next, and a resumed loader's worker w runs reader (due + w) mod
readers: the turn goes on where it stopped. What was consumed before a resume followed by what
is consumed after it is exactly an uninterrupted run's stream, batch for batch.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import queue
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipeline.core.blocks import Assignment, BlockFeeds, BlockReader, BlockSource, epoch_blocks
from pipeline.core.filters import FilterConfig
from pipeline.core.fingerprint import differing_keys
from pipeline.core.shard_format import SCHEMA_METADATA_KEY, DatasetFacts
from pipeline.core.sources import StreamError, list_files
from pipeline.core.text import ByteTokenizer, JsonTokenizer, load_tokenizer

STATE_VERSION = 2  # 2 adds the reader due next
BLOCKS_AHEAD = 2  # blocks leased and queued for each reader of a swarm's stream, beyond the one it reads
READ_COLUMNS = ("key", "caption", "code")
FILTER_COLUMNS = {"url", "URL", "original_width", "original_height", "NSFW"}
CORRUPT_CODE_LENGTH = "code of the wrong length"
CORRUPT_CODE_RANGE = "code outside the codebook"
CORRUPT_CAPTION = "undecodable caption"
CORRUPT_ROW_GROUP = "unreadable row group"


@dataclass(frozen=True)
class StreamSettings:
    """What defines a stream; everything here is in the resume fingerprint except the batch shape."""

    source: str
    batch_size: int = 64
    text_len: int = 64
    seed: int = 0
    shuffle_buffer: int = 10_000
    rank: int = 0
    world_size: int = 1
    num_workers: int = 0
    epochs: int | None = None  # None: forever
    drop_last: bool = False
    filters: FilterConfig | None = None  # on-the-fly filters, for the LAION layout
    tokenizer: str | None = None  # a tokenizers JSON; None: byte-level UTF-8
    retries: int = 5
    retry_delay: float = 0.5  # seconds, doubled after each failed attempt
    swarm_blocks: bool = False  # the epoch's blocks come from the swarm's leases (pipeline/core/blocks.py)

    def fingerprint(self) -> dict:
        kept = asdict(self)
        for name in ("batch_size", "text_len", "drop_last", "retries", "retry_delay", "tokenizer"):
            kept.pop(name)
        if not self.swarm_blocks:  # as streams saved it before there were swarm streams
            kept.pop("swarm_blocks")
        return kept


def peer_seed(peer: str) -> int:
    """A stable 63-bit seed from a peer's identity (e.g. its hivemind peer id)."""
    return int.from_bytes(hashlib.sha256(peer.encode()).digest()[:8], "little") >> 1


class Unit(NamedTuple):
    file: int  # index into DatasetIndex.files
    row_group: int
    rows: int


class Row(NamedTuple):
    key: str
    caption: str
    codes: np.ndarray  # int16 [H*W], a view into its row group's code buffer
    unit: int  # index into DatasetIndex.units
    row: int  # row within the row group


@dataclass
class DatasetIndex:
    """The files of a dataset, their row groups and their facts, from the footers alone."""

    source: str
    files: list[str]
    units: list[Unit]
    facts: DatasetFacts | None  # None for datasets without ttt facts (the public LAION code layout)
    codebook_size: int | None
    grid: tuple[int, int]
    columns: list[str]
    bytes_per_unit: list[int]  # compressed bytes of the columns read
    filesystem: Any = None  # an fsspec filesystem for remote sources; None for local files
    _open: dict = field(default_factory=dict, repr=False)

    def __getstate__(self) -> dict:  # open file handles stay in their process
        return {**self.__dict__, "_open": {}}

    @property
    def identity(self) -> str:
        """What the dataset holds, wherever it is read from (a folder, the Hub, a local copy): its rows, its row
        groups and its facts, as a short hash."""
        layout = [self.facts.to_json() if self.facts else "", [unit.rows for unit in self.units]]
        digest = hashlib.sha256(repr(layout).encode()).hexdigest()[:12]
        return f"({sum(unit.rows for unit in self.units):,} rows, sha256 {digest})"

    def parquet(self, file: int) -> pq.ParquetFile:
        if file not in self._open:
            path = self.files[file]
            # Remote files without fsspec's read-ahead (5 MB past every read): pyarrow asks for exactly the footer
            # and then one row group's columns, and each becomes one HTTP range request of that size.
            handle = self.filesystem.open(path, "rb", cache_type="none") if self.filesystem is not None else path
            self._open[file] = pq.ParquetFile(handle)
        return self._open[file]

    def read_unit(self, unit_id: int, retries: int, retry_delay: float) -> pa.Table | None:
        """One row group, retried with backoff on I/O errors; None when its bytes are corrupt."""
        unit = self.units[unit_id]
        for attempt in range(retries + 1):
            try:
                return self.parquet(unit.file).read_row_group(unit.row_group, columns=self.columns)
            except OSError as err:  # a network hiccup, a file replaced mid-read: reopen and retry
                self._open.pop(unit.file, None)
                if attempt == retries:
                    raise StreamError(
                        f"cannot read {self.files[unit.file]} after {retries + 1} attempts: {err}"
                    ) from None
                time.sleep(retry_delay * 2**attempt)
            except pa.ArrowInvalid:  # corrupt pages: its rows are counted as corrupt, the stream goes on
                return None
        raise AssertionError("unreachable")


def index_dataset(
    source: str, codebook_size: int | None = None, grid: tuple[int, int] | None = None, filtering: bool = False
) -> DatasetIndex:
    """Read the footers of a dataset, and refuse one whose codebook or grid differs from what the caller expects.

    Only the columns a batch needs are read, plus the metadata columns when `filtering`."""
    filesystem, files = list_files(source)
    index = DatasetIndex(source, files, [], None, None, (0, 0), [], [], filesystem)
    try:
        names = set(index.parquet(0).schema_arrow.names)
    except (OSError, pa.ArrowInvalid) as err:
        raise StreamError(f"cannot read the parquet footer of {files[0]}: {err}") from None
    if not {"code", "caption"} <= names:
        raise StreamError(f"{files[0]} has no `code` and `caption` columns: not a VQGAN-code dataset")
    wanted = set(READ_COLUMNS) | (FILTER_COLUMNS if filtering else set())
    index.columns = sorted(names & wanted)
    all_facts = []
    for file_index in range(len(files)):
        try:
            metadata = index.parquet(file_index).metadata
        except (OSError, pa.ArrowInvalid) as err:
            raise StreamError(f"cannot read the parquet footer of {files[file_index]}: {err}") from None
        raw = (metadata.metadata or {}).get(SCHEMA_METADATA_KEY)
        all_facts.append(DatasetFacts.from_json(raw) if raw else None)
        positions = [i for i in range(metadata.num_columns) if metadata.schema.column(i).name in index.columns]
        for group in range(metadata.num_row_groups):
            row_group = metadata.row_group(group)
            index.units.append(Unit(file_index, group, row_group.num_rows))
            index.bytes_per_unit.append(sum(row_group.column(i).total_compressed_size for i in positions))
    if any(f != all_facts[0] for f in all_facts):
        raise StreamError(f"the files of {source} disagree about their dataset facts (mixed VQGANs or grids)")
    index.facts = all_facts[0]
    index.codebook_size, index.grid = check_facts(index, codebook_size, grid)
    return index


def check_facts(
    index: DatasetIndex, codebook_size: int | None, grid: tuple[int, int] | None
) -> tuple[int | None, tuple[int, int]]:
    """The dataset's codebook and grid, checked against the caller's expectation."""
    facts = index.facts
    if facts is None:  # the LAION code layout: the grid comes from the caller or from the first row's length
        found_codebook = codebook_size
        found_grid = grid or infer_grid(index)
    else:
        found_codebook, found_grid = facts.codebook_size, (facts.grid_height, facts.grid_width)
    codebook_differs = codebook_size is not None and codebook_size != found_codebook
    if codebook_differs or (grid is not None and tuple(grid) != found_grid):
        raise StreamError(
            f"{index.source} holds codes from a codebook of {found_codebook} on a {found_grid[0]}x{found_grid[1]} "
            f"grid, but the model expects a codebook of {codebook_size} on a "
            f"{'x'.join(map(str, grid)) if grid else 'any'} grid; train on a dataset made with the model's VQGAN"
        )
    return found_codebook, found_grid


def infer_grid(index: DatasetIndex) -> tuple[int, int]:
    table = index.parquet(0).read_row_group(0, columns=["code"]) if index.units else None
    lengths = [len(b) for b in (table.column("code").to_pylist() if table is not None else []) if b]
    side = int(round((lengths[0] // 2) ** 0.5)) if lengths else 0
    if not lengths or side * side * 2 != lengths[0]:
        raise StreamError(f"cannot infer the code grid of {index.source}; pass grid=(height, width)")
    return side, side


def decode_unit(
    table: pa.Table, unit_id: int, index: DatasetIndex, filters: FilterConfig | None
) -> tuple[list[Row], Counter]:
    """A row group's valid rows, and why the others were dropped (corrupt or filtered)."""
    dropped: Counter = Counter()
    rows = table.num_rows
    keep = np.ones(rows, dtype=bool)
    code_length = index.grid[0] * index.grid[1]
    code = table.column("code").combine_chunks()
    offset_type = np.int64 if pa.types.is_large_binary(code.type) else np.int32
    offsets = np.frombuffer(code.buffers()[1], dtype=offset_type)[code.offset : code.offset + rows + 1]
    lengths = np.diff(offsets)
    valid = np.asarray(code.is_valid()) if code.null_count else np.ones(rows, dtype=bool)
    wrong_length = ~valid | (lengths != 2 * code_length)
    dropped[CORRUPT_CODE_LENGTH] += int(wrong_length.sum())
    keep &= ~wrong_length
    data = np.frombuffer(code.buffers()[2], dtype=np.uint8) if code.buffers()[2] is not None else np.empty(0, np.uint8)
    codes = np.zeros((rows, code_length), dtype="<i2")
    if keep.all():  # the common case: rows are contiguous, one view of the whole buffer
        codes = data[offsets[0] : offsets[-1]].view("<i2").reshape(rows, code_length)
    else:
        for row in np.flatnonzero(keep):
            codes[row] = data[offsets[row] : offsets[row + 1]].view("<i2")
    if index.codebook_size is not None and keep.any():
        out_of_range = keep & ((codes.min(axis=1) < 0) | (codes.max(axis=1) >= index.codebook_size))
        dropped[CORRUPT_CODE_RANGE] += int(out_of_range.sum())
        keep &= ~out_of_range
    captions = []
    for row, raw in enumerate(table.column("caption").cast(pa.binary()).to_pylist()):
        try:
            captions.append(raw.decode("utf-8") if raw is not None else "")
        except UnicodeDecodeError:
            captions.append("")
            if keep[row]:
                dropped[CORRUPT_CAPTION] += 1
                keep[row] = False
    if filters is not None:
        keep &= filter_mask(table, captions, keep, filters, dropped)
    keys = table.column("key").to_pylist() if "key" in table.column_names else [None] * rows
    unit = index.units[unit_id]
    return [
        Row(keys[r] if keys[r] is not None else f"{unit.file}:{unit.row_group}:{r}", captions[r], codes[r], unit_id, r)
        for r in np.flatnonzero(keep).tolist()
    ], +dropped  # without the zero counts


def filter_mask(
    table: pa.Table, captions: list[str], keep: np.ndarray, filters: FilterConfig, dropped: Counter
) -> np.ndarray:
    """The metadata filters of `ttt preprocess`, applied to a row group (URL dedup is global, so not here)."""
    import pandas as pd

    from pipeline.core.filters import apply_filters

    def column(*names: str) -> Any:
        name = next((n for n in names if n in table.column_names), None)
        return table.column(name).to_pandas() if name else pd.Series([None] * table.num_rows)

    frame = pd.DataFrame(
        {
            "url": column("url", "URL").fillna("(no url)"),
            "caption": captions,
            "width": column("original_width"),
            "height": column("original_height"),
            "nsfw": column("NSFW"),
            "row": np.arange(table.num_rows),
        }
    )[keep]
    config = FilterConfig(**{**asdict(filters), "dedupe_urls": False})
    kept, reasons = apply_filters(frame.reset_index(drop=True), config)
    for reason, count in reasons.items():
        dropped[f"filtered: {reason}"] += count
    mask = np.zeros(table.num_rows, dtype=bool)
    mask[kept["row"].to_numpy()] = True
    return mask


def read_rows(index: DatasetIndex, settings: StreamSettings, unit_id: int) -> tuple[list[Row], Counter]:
    """A row group's valid rows and why the others were dropped (all of them, when its bytes are corrupt)."""
    table = index.read_unit(unit_id, settings.retries, settings.retry_delay)
    if table is None:
        return [], Counter({CORRUPT_ROW_GROUP: index.units[unit_id].rows})
    return decode_unit(table, unit_id, index, settings.filters)


def collated_batches(
    next_row: Callable[[], Row | None], settings: StreamSettings, state_after: Callable[[int], dict]
) -> Iterator[tuple[dict, dict]]:
    """Batches of the rows NEXT_ROW hands out until it has none, each with `state_after(rows in it)`."""
    tokenizer = load_tokenizer(settings.tokenizer)
    while True:
        rows = []
        while len(rows) < settings.batch_size and (row := next_row()) is not None:
            rows.append(row)
        if not rows or (len(rows) < settings.batch_size and settings.drop_last):
            return
        yield collate(rows, tokenizer, settings.text_len), state_after(len(rows))


def collate(rows: list[Row], tokenizer: ByteTokenizer | JsonTokenizer, text_len: int) -> dict:
    """One batch of `rows`: text tokens, image codes, captions, keys, and where each row is in the dataset (its row
    group and row: what a peer's commitment names, training/audit/). Its tokens and codes are numpy arrays, which
    `with_tensors` turns into tensors in the process that uses them."""
    captions = [row.caption for row in rows]
    return {
        "text": tokenizer.encode_batch(captions, text_len),
        "codes": np.stack([row.codes for row in rows]).astype(np.int64),
        "caption": captions,
        "key": [row.key for row in rows],
        "at": [[row.unit, row.row] for row in rows],
    }


def with_tensors(batch: dict, pin_memory: bool = False) -> dict:
    """BATCH with its arrays as torch tensors (in pinned memory if asked), made where they are used.

    A loader worker sends numpy arrays, which cross to the main process by plain pickle. Tensors would cross as
    shared memory through torch's shm manager (hivemind sets the `file_system` strategy), and a batch whose sharing
    failed ("Shared memory manager connection has timed out", seen under a loaded suite) was dropped in the worker's
    queue feeder thread: the loader then waited for it forever, and its peer hung without a line."""
    tensors = {name: torch.from_numpy(v) for name, v in batch.items() if isinstance(v, np.ndarray)}
    if pin_memory:
        tensors = {name: tensor.pin_memory() for name, tensor in tensors.items()}
    return {**batch, **tensors}


class UnitRows:
    """A reader's row groups, decoded: their valid rows; the rows dropped (corrupt or filtered) are counted when
    COUNT says the unit is read for the first time in its epoch (not again at a resume)."""

    def __init__(self, index: DatasetIndex, settings: StreamSettings) -> None:
        self.index, self.settings = index, settings
        self.dropped: Counter = Counter()

    def __call__(self, unit_id: int, count: bool) -> list[Row]:
        rows, dropped = read_rows(self.index, self.settings, unit_id)
        if count:
            self.dropped.update(dropped)
        return rows


class Slot:
    """One reading position (a rank's DataLoader worker): its share of each epoch's units, shuffled rows."""

    def __init__(self, index: DatasetIndex, settings: StreamSettings, slot: int, slots: int) -> None:
        self.index, self.settings = index, settings
        self.slot, self.slots = slot, slots
        self.epoch, self.position, self.offset = 0, 0, 0
        self.order = self.epoch_order(0)
        self.pending: list[Row] | None = None
        self.buffer: list[Row] = []
        # A buffer larger than the slot's share of an epoch would hold the same rows several times.
        self.buffer_size = min(settings.shuffle_buffer, sum(unit.rows for unit in index.units) // slots)
        # The buffer's row coordinates (unit, row), kept alongside so a state costs one array copy per batch.
        self.coords = np.zeros((self.buffer_size, 2), dtype=np.int64)
        self.rng = np.random.default_rng([settings.seed, 1, slot])
        self.decode = UnitRows(index, settings)
        self.emitted = 0
        if not self.order:
            raise StreamError(
                f"{len(index.units)} row groups cannot feed {slots} readers (ranks x workers); use fewer workers"
            )

    def epoch_order(self, epoch: int) -> list[int]:
        permutation = np.random.default_rng([self.settings.seed, 0, epoch]).permutation(len(self.index.units))
        return permutation[self.slot :: self.slots].tolist()

    def next_incoming(self) -> Row | None:
        """The next row in reading order, or None when the last epoch is done."""
        empty_units = 0
        while True:
            if self.pending is None:
                if self.position == len(self.order):
                    if self.settings.epochs is not None and self.epoch + 1 >= self.settings.epochs:
                        return None
                    self.epoch, self.position, self.order = self.epoch + 1, 0, self.epoch_order(self.epoch + 1)
                self.pending = self.decode(self.order[self.position], count=self.offset == 0)
            if self.offset < len(self.pending):
                self.offset += 1
                return self.pending[self.offset - 1]
            self.pending, self.position, self.offset = None, self.position + 1, 0
            empty_units += 1
            if empty_units > 2 * len(self.order) + 1:
                raise StreamError(f"{self.index.source}: no valid rows in a whole epoch ({dict(self.decode.dropped)})")

    def next_row(self) -> Row | None:
        """The next row out of the shuffle buffer, or None when the stream is over."""
        size = self.buffer_size
        while True:
            incoming = self.next_incoming()
            if incoming is None:
                if not self.buffer:
                    return None
                pick, last = int(self.rng.integers(len(self.buffer))), len(self.buffer) - 1
                self.buffer[pick], self.buffer[last] = self.buffer[last], self.buffer[pick]
                self.coords[pick] = self.coords[last]
                return self.buffer.pop()
            if size == 0:
                return incoming
            if len(self.buffer) < size:
                self.coords[len(self.buffer)] = incoming.unit, incoming.row
                self.buffer.append(incoming)
                continue
            pick = int(self.rng.integers(size))
            row, self.buffer[pick] = self.buffer[pick], incoming
            self.coords[pick] = incoming.unit, incoming.row
            return row

    def batches(self) -> Iterator[tuple[dict, dict]]:
        """Collated batches, each with this slot's state right after it."""
        return collated_batches(self.next_row, self.settings, self.state_after)

    def state_after(self, rows: int) -> dict:
        self.emitted += rows
        return self.state_dict()

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "offset": self.offset,
            "buffer": self.coords[: len(self.buffer)].copy(),
            "rng": self.rng.bit_generator.state,
            "dropped": dict(self.decode.dropped),
            "emitted": self.emitted,
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position, self.offset = state["epoch"], state["position"], state["offset"]
        self.order = self.epoch_order(self.epoch)
        self.pending = None
        self.rng.bit_generator.state = state["rng"]
        self.decode.dropped, self.emitted = Counter(state["dropped"]), state["emitted"]
        # Read the buffered rows back by coordinate, one row group at a time.
        saved = np.asarray(state["buffer"], dtype=np.int64).reshape(-1, 2)  # (0, 2) too, for a reader that ran out
        coords = [(int(unit), int(row)) for unit, row in saved]
        wanted: dict[int, set[int]] = {}
        for unit, row in coords:
            wanted.setdefault(unit, set()).add(row)
        found = {}
        for unit, rows in wanted.items():
            found.update({(unit, r.row): r for r in self.decode(unit, count=False) if r.row in rows})
        missing = [c for c in coords if c not in found]
        if missing:
            raise StreamError(f"the saved shuffle buffer names rows the dataset no longer has (e.g. {missing[0]})")
        self.buffer = [found[c] for c in coords]
        self.coords[: len(saved)] = saved


class BlockSlot:
    """One reading position of a swarm-wide stream (pipeline/core/blocks.py): the blocks its peer leased, each read
    whole in the block's order; no shuffle buffer (a block mixes rows of several row groups drawn at random)."""

    def __init__(
        self, index: DatasetIndex, settings: StreamSettings, next_block: Callable[[list[Assignment]], Assignment | None]
    ) -> None:
        self.index, self.settings = index, settings
        self.decode = UnitRows(index, settings)
        self.reader = BlockReader([unit.rows for unit in index.units], settings.seed, next_block, self.decode)
        self.emitted = 0

    def batches(self) -> Iterator[tuple[dict, dict]]:
        """Each batch also names the blocks its rows came from, as [epoch, block] (the block it ends in, and any
        finished since the last batch: those that can hold its rows), for its peer's commitment (training/audit/)."""
        rows = self.reader.rows()
        for batch, state in collated_batches(lambda: next(rows, None), self.settings, self.state_after):
            current = [state["current"][:2]] if state["current"] else []
            yield {**batch, "blocks": [block[:2] for block in state["finished"]] + current}, state

    def state_after(self, rows: int) -> dict:
        self.emitted += rows
        return {**self.reader.report(), "dropped": dict(self.decode.dropped), "emitted": self.emitted}

    def load_state_dict(self, state: dict) -> None:
        self.decode.dropped, self.emitted = Counter(state["dropped"]), state["emitted"]


class SlotDataset(torch.utils.data.IterableDataset):
    """What each DataLoader worker runs: one reader's batches, tagged with the reader and its state.

    The loader asks its workers in turn from worker 0, so worker w runs reader (first_reader + w) mod readers:
    the reader due first is asked first."""

    def __init__(
        self,
        index: DatasetIndex,
        settings: StreamSettings,
        states: list[dict | None],
        first_reader: int,
        feeds: BlockFeeds | None = None,
    ) -> None:
        self.index, self.settings, self.states, self.first_reader = index, settings, states, first_reader
        self.feeds = feeds  # a swarm-wide stream's: where each reader's blocks come from

    def __iter__(self) -> Iterator[tuple[dict, int, dict]]:
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        settings = self.settings
        readers = len(self.states)
        reader = (self.first_reader + worker) % readers
        if self.feeds is not None:
            slot = BlockSlot(self.index, settings, partial(self.feeds.next_block, reader))
        else:
            slot = Slot(self.index, settings, settings.rank * readers + reader, settings.world_size * readers)
        if self.states[reader] is not None:
            slot.load_state_dict(self.states[reader])
        for batch, state in slot.batches():
            yield batch, reader, state


def as_is(item: Any) -> Any:
    return item


def leave_terminal_signals_to_the_main_process(worker_id: int) -> None:
    """A loader worker ignores Ctrl-C and hangups: they reach the whole process group, and the main process stops
    the loader (a worker that inherited a handler of the main process would act, and speak, once more)."""
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)


class CodeStream:
    """Batches of (text tokens, image codes) from a code dataset; see the module docstring."""

    def __init__(
        self,
        source: str | Path,
        *,
        batch_size: int = 64,
        text_len: int = 64,
        seed: int | None = None,
        peer: str | None = None,
        shuffle_buffer: int = 10_000,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        prefetch_factor: int = 4,
        epochs: int | None = None,
        drop_last: bool = False,
        codebook_size: int | None = None,
        grid: tuple[int, int] | None = None,
        filters: FilterConfig | None = None,
        tokenizer: str | None = None,
        retries: int = 5,
        retry_delay: float = 0.5,
        pin_memory: bool = False,
        index: DatasetIndex | None = None,
        blocks: BlockSource | None = None,
    ) -> None:
        """`index`: what `index_dataset` already read of `source` with the same codebook, grid and filtering,
        so that a caller who checked the dataset first does not read every footer again. `blocks`: a swarm's
        stream, which reads the blocks of each epoch its peer leased (`seed` must then be the run's)."""
        if not 0 <= rank < world_size:
            raise StreamError(f"rank {rank} is outside world_size {world_size}")
        if seed is None:  # independent peers differ by identity; an explicit split must share one seed
            seed = peer_seed(peer) if peer is not None and world_size == 1 else 0
        self.settings = StreamSettings(
            source=str(source),
            batch_size=batch_size,
            text_len=text_len,
            seed=seed,
            shuffle_buffer=shuffle_buffer,
            rank=rank,
            world_size=world_size,
            num_workers=num_workers,
            epochs=epochs,
            drop_last=drop_last,
            filters=filters,
            tokenizer=tokenizer,
            retries=retries,
            retry_delay=retry_delay,
            swarm_blocks=blocks is not None,
        )
        if index is None:
            index = index_dataset(str(source), codebook_size, grid, filtering=filters is not None)
        self.index = index
        self.tokenizer = load_tokenizer(tokenizer)
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        self.states: list[dict | None] = [None] * max(num_workers, 1)  # per reader of this rank
        self.next_reader = 0  # the reader whose turn it is to hand out the next batch
        self.feeds = BlockFeeds(blocks, len(self.states), BLOCKS_AHEAD) if blocks is not None else None

    @property
    def codebook_size(self) -> int | None:
        return self.index.codebook_size

    @property
    def grid(self) -> tuple[int, int]:
        return self.index.grid

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id

    @property
    def epoch(self) -> int:
        """The data epoch the readers are in (the furthest one)."""
        if self.feeds is not None:
            return max((blocks[0].epoch for blocks in self.feeds.handed if blocks), default=0)
        return max((state["epoch"] for state in self.states if state is not None), default=0)

    @property
    def blocks_per_epoch(self) -> int:
        """A swarm's stream: the blocks each epoch is cut into (pipeline/core/blocks.py); 0 otherwise."""
        return epoch_blocks(len(self.index.units)) if self.feeds is not None else 0

    def __iter__(self) -> Iterator[dict]:
        dataset = SlotDataset(self.index, self.settings, list(self.states), self.next_reader, self.feeds)
        workers = self.settings.num_workers
        if self.feeds is None:
            yield from self.batches(dataset, workers)
            return
        self.feeds.start(multiprocessing.get_context().Queue if workers else queue.Queue)
        try:
            yield from self.batches(dataset, workers)
        finally:
            self.feeds.finish()
        self.feeds.check()

    def close(self) -> None:
        """A swarm's stream gives its peer's unfinished blocks back to the swarm (the peer leaves)."""
        if self.feeds is not None:
            self.feeds.finish()  # (the loop over the stream may not have been closed yet: an error left it)
            self.feeds.source.close()

    def batches(self, dataset: SlotDataset, workers: int) -> Iterator[dict]:
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=None,
            num_workers=workers,
            prefetch_factor=self.prefetch_factor if workers else None,
            collate_fn=as_is,  # batches are collated in the slot; states must not be walked element by element
            worker_init_fn=leave_terminal_signals_to_the_main_process,
        )
        for batch, reader, state in loader:
            self.states[reader] = state
            self.next_reader = (reader + 1) % len(self.states)
            if self.feeds is not None:
                self.feeds.consumed(reader, state)
                if not self.feeds.source.leased():  # read in the peer's own order: no lease holds these blocks
                    batch.pop("blocks")
            yield with_tensors(batch, self.pin_memory)

    def fingerprint(self) -> dict:
        return {
            **self.settings.fingerprint(),
            "files": [Path(f).name for f in self.index.files],
            "rows": sum(unit.rows for unit in self.index.units),
        }

    def state_dict(self) -> dict:
        """Where each reader stands after the last batch handed out, and whose turn is next (JSON-able)."""
        workers = [s if s is None or "buffer" not in s else {**s, "buffer": s["buffer"].tolist()} for s in self.states]
        blocks = self.feeds.state_dict() if self.feeds is not None else {}
        return {
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint(),
            "workers": workers,
            "next_reader": self.next_reader,
            **blocks,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict()` of a stream with the same dataset and settings."""
        version = state.get("version")
        # Version 1 did not record the reader due next; with a single reader that is always reader 0.
        if version != STATE_VERSION and not (version == 1 and len(state["workers"]) == 1):
            raise StreamError(f"stream state version {version} is not {STATE_VERSION}")
        differing = differing_keys(state["fingerprint"], self.fingerprint())
        if differing:
            raise StreamError(f"the saved stream state belongs to a different stream: {', '.join(differing)} differ")
        self.states = list(state["workers"])
        if self.feeds is not None:
            self.feeds.load(state["blocks"], state["source"])
        self.next_reader = state.get("next_reader", 0)

    def stats(self) -> dict:
        """Rows handed out and rows dropped by reason, over all readers."""
        dropped: Counter = Counter()
        for state in self.states:
            dropped.update((state or {}).get("dropped", {}))
        return {"emitted": sum((s or {}).get("emitted", 0) for s in self.states), "dropped": dict(dropped)}
