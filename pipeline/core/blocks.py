"""An epoch cut into blocks that peers of a swarm take one by one: which rows a block holds, and in which order.

Every peer of a run computes the same plan from the run's seed and the dataset's row groups (`DatasetIndex.units`):

    plan = EpochPlan(units=[unit.rows for unit in index.units], seed=run_seed, epoch=e)
    plan.blocks             # how many blocks epoch e has
    plan.units_of(b)        # the row groups of block b (consecutive in the epoch's shuffled order of row groups)
    plan.row_order(b)       # (unit, row) of each of its rows, in the order they are handed out

A block's rows are handed out in an order fixed by (seed, epoch, block), so "rows 0..offset of block b are done" is
one number, and whoever takes the block over (its peer died, or left) continues at that offset with the same rows
a single reader would have read. That replaces the shuffle buffer of a peer's own order: a block mixes the rows
of BLOCK_UNITS row groups drawn at random from the whole dataset.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from typing import NamedTuple, Protocol

import numpy as np

BLOCK_UNITS = 8  # row groups per block (8,192 rows of `ttt preprocess` output)
BLOCKS_PER_SPLIT = 64  # a dataset of fewer row groups than BLOCK_UNITS x this gets smaller blocks (see block_units)


def block_units(units: int) -> int:
    """Row groups per block for a dataset of UNITS row groups: BLOCK_UNITS, or fewer for a small dataset, so that an
    epoch has enough blocks for several peers (the sample's 8 row groups: blocks of one)."""
    return max(1, min(BLOCK_UNITS, units // BLOCKS_PER_SPLIT))


class EpochPlan:
    """Epoch EPOCH of a dataset whose row groups hold UNITS rows each, cut into blocks (see the module docstring)."""

    def __init__(self, units: list[int], seed: int, epoch: int) -> None:
        self.units, self.seed, self.epoch = list(units), seed, epoch
        # The epoch's row groups, shuffled by (seed, epoch): a block is a run of this order.
        self.order = np.random.default_rng([seed, 0, epoch]).permutation(len(self.units)).tolist()

    @property
    def per_block(self) -> int:
        return block_units(len(self.units))

    @property
    def blocks(self) -> int:
        return math.ceil(len(self.units) / self.per_block)

    def units_of(self, block: int) -> list[int]:
        if not 0 <= block < self.blocks:
            raise IndexError(f"block {block} is outside epoch {self.epoch}'s {self.blocks} blocks")
        return self.order[block * self.per_block : (block + 1) * self.per_block]

    def rows_of(self, block: int) -> int:
        return sum(self.units[unit] for unit in self.units_of(block))

    def row_order(self, block: int) -> np.ndarray:
        """[rows, 2]: the (unit, row) coordinates of block BLOCK's rows, in the order they are handed out."""
        coordinates = np.concatenate(
            [np.stack([np.full(self.units[u], u), np.arange(self.units[u])], axis=1) for u in self.units_of(block)]
        )
        shuffle = np.random.default_rng([self.seed, 2, self.epoch, block]).permutation(len(coordinates))
        return coordinates[shuffle]


class Assignment(NamedTuple):
    """A block given to a reader: `offset` rows of it were handed out before (by this reader or another)."""

    epoch: int
    block: int
    offset: int


class BlockReader:
    """One reading position fed whole blocks (`next_block(finished)`: from the swarm's leases, or a queue its peer
    fills; `finished`: the blocks this reader handed out whole since it last asked): each block's rows in the
    block's order, from its offset. `decode(unit, count)` gives a row group's valid rows (each
    with its `.row`); `count`: whether its dropped rows are counted (once per block, when it starts at 0)."""

    def __init__(
        self,
        units: list[int],
        seed: int,
        next_block: Callable[[list[Assignment]], Assignment | None],
        decode: Callable[[int, bool], list],
    ) -> None:
        self.units, self.seed, self.next_block, self.decode = units, seed, next_block, decode
        self.plans: dict[int, EpochPlan] = {}
        self.current: Assignment | None = None  # the block being read, `offset`: its rows handed out so far
        self.finished: list[Assignment] = []  # blocks handed out whole and not yet reported (offset: their rows)
        self.reported = 0  # of `finished`, those given to `next_block` already

    def plan(self, epoch: int) -> EpochPlan:
        if epoch not in self.plans:
            self.plans = {epoch: EpochPlan(self.units, self.seed, epoch)}  # one epoch at a time is enough
        return self.plans[epoch]

    def rows(self) -> Iterator:
        """Rows until `next_block` has no more blocks."""
        while (assignment := self.next_block(self.finished[self.reported :])) is not None:
            self.reported = len(self.finished)
            plan = self.plan(assignment.epoch)
            order = plan.row_order(assignment.block)
            count = assignment.offset == 0
            units = plan.units_of(assignment.block)
            decoded = {unit: {row.row: row for row in self.decode(unit, count)} for unit in units}
            for position in range(assignment.offset, len(order)):
                self.current = assignment._replace(offset=position + 1)
                row = decoded[int(order[position][0])].get(int(order[position][1]))
                if row is not None:  # rows dropped as corrupt or filtered keep their place in the order
                    yield row
            self.finished.append(assignment._replace(offset=len(order)))
            self.current = None

    def report(self) -> dict:
        """Where this reader stands (after a batch): the block in progress and the blocks finished since the last
        report."""
        finished, self.finished, self.reported = self.finished, [], 0
        return {"current": list(self.current) if self.current else None, "finished": [list(f) for f in finished]}


class BlockSource(Protocol):
    """Where a swarm-wide stream's blocks come from (training/swarm/leases.py's `LeaseSource`: the run's DHT)."""

    def take(self, wait: bool = True) -> Assignment | None:
        """The next block to read, leased to this peer; None when the last epoch is done (or, without WAIT, when
        nothing can be taken now)."""

    def ended(self) -> bool:
        """Whether the last epoch is done."""

    def consumed(self, state: dict) -> None:
        """A batch of a reader with this state (`BlockReader.report()`) reached the trainer."""

    def close(self) -> None:
        """The peer leaves: its unfinished blocks go back to the swarm, at their offsets."""


class BlockFeeds:
    """The blocks each reader of a peer reads next, handed out by the main process (the DHT is its): a reader in the
    main process asks for its next block itself; readers in DataLoader workers get theirs through a queue each,
    which a thread keeps AHEAD blocks ahead of what they started.

    `handed[reader]`: the blocks handed to a reader, in order, from the one it is reading as of the last batch that
    reached the trainer (`consumed`). A stream's state keeps them: a resumed peer hands the same blocks out again,
    from the same offsets, and reads on exactly as if it had never stopped."""

    def __init__(self, source: BlockSource, readers: int, ahead: int) -> None:
        self.source, self.ahead = source, ahead
        self.handed: list[list[Assignment]] = [[] for _ in range(readers)]
        self.given = [0] * readers  # per reader in the main process: how many of `handed` it was given
        self.queues: list | None = None
        self.reports = None  # workers' finished blocks, to the main process (done once handed out, as above)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def load(self, handed: list[list[list[int]]]) -> None:
        self.handed = [[Assignment(*block) for block in blocks] for blocks in handed]
        self.given = [0] * len(self.handed)

    def next_block(self, reader: int, finished: list[Assignment]) -> Assignment | None:
        """In the reader's process: its next block. A reader in the main process reports the blocks it FINISHED
        here (it asks for the next one while the batch holding their last rows is still being filled: done once
        handed out); readers in workers report them with their batches (`consumed`)."""
        if self.queues is not None:
            if finished:
                self.reports.put([list(block) for block in finished])
            found = self.queues[reader].get()
            return None if found is None else Assignment(*found)
        if finished:
            self.source.consumed({"current": None, "finished": [list(block) for block in finished]})
        with self.lock:
            if self.given[reader] == len(self.handed[reader]):
                block = self.source.take()
                if block is None:
                    return None
                self.handed[reader].append(block)
            self.given[reader] += 1
            return self.handed[reader][self.given[reader] - 1]

    def consumed(self, reader: int, state: dict) -> None:
        """A batch of READER reached the trainer: forget the blocks it finished before it, record the offset."""
        self.source.consumed(state)
        current = state["current"]
        with self.lock:
            blocks, done = self.handed[reader], {(epoch, block) for epoch, block, _ in state["finished"]}
            while blocks and blocks[0][:2] in done:  # blocks are read in the order they were handed
                blocks.pop(0)
                self.given[reader] -= self.queues is None
            if current and blocks and blocks[0][:2] == tuple(current[:2]):
                blocks[0] = Assignment(*current)

    def start_workers(self, context) -> None:
        """Before the DataLoader forks its workers: a queue per reader, holding the blocks handed to it, and the
        thread that keeps them stocked."""
        self.queues = [context.Queue() for _ in self.handed]
        self.reports = context.Queue()
        for queue, blocks in zip(self.queues, self.handed, strict=True):
            for block in blocks:
                queue.put(tuple(block))
        self.stop.clear()
        self.thread = threading.Thread(target=self.stock, name="block-feeds", daemon=True)
        self.thread.start()

    def stock(self) -> None:
        """Keep each queue AHEAD blocks full and pass the workers' finished blocks on, until `stop_workers` or the
        end of the last epoch (then every reader gets an end). Never waits for a block: a worker's batches must go
        on reaching the trainer (a DataLoader waits for its workers in turn), and its finished blocks the swarm."""
        while not self.stop.is_set():
            while not self.reports.empty():
                self.source.consumed({"current": None, "finished": self.reports.get()})
            for reader, queue in enumerate(self.queues):
                block = self.source.take(wait=False) if queue.qsize() < self.ahead else None
                if block is not None:
                    queue.put(tuple(block))
                    with self.lock:
                        self.handed[reader].append(block)
            if self.source.ended():
                for queue in self.queues:
                    queue.put(None)
                return
            self.stop.wait(0.05)

    def stop_workers(self) -> None:
        """The loader is done with its workers: no more stocking."""
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
        self.queues = None
        self.given = [0] * len(self.handed)
