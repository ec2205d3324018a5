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

IDLE_POLL = 0.01  # seconds between looks at the readers' queues when none needed a block
BLOCK_UNITS = 8  # row groups per block (8,192 rows of `ttt preprocess` output)
BLOCKS_PER_SPLIT = 64  # a dataset of fewer row groups than BLOCK_UNITS x this gets smaller blocks (see block_units)


def block_units(units: int) -> int:
    """Row groups per block for a dataset of UNITS row groups: BLOCK_UNITS, or fewer for a small dataset, so that an
    epoch has enough blocks for several peers (the sample's 8 row groups: blocks of one)."""
    return max(1, min(BLOCK_UNITS, units // BLOCKS_PER_SPLIT))


def split_of(block: int) -> int:
    """The split (the DHT key of BLOCKS_PER_SPLIT blocks: training/swarm/leases.py) a block's leases are in."""
    return block // BLOCKS_PER_SPLIT


def epoch_blocks(units: int) -> int:
    """The blocks an epoch of a dataset of UNITS row groups is cut into."""
    return math.ceil(units / block_units(units))


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
        return epoch_blocks(len(self.units))

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
    """Where a swarm-wide stream's blocks come from (training/swarm/leases.py's `LeaseSource`: the run's DHT). Only
    the feeding thread of `BlockFeeds` calls it, apart from `state_dict`, `adopt` and `close`."""

    epochs: int | None  # the epochs the stream reads; None: for ever

    def take(self) -> Assignment | None:
        """The next block to read, leased to this peer; None when nothing can be taken now."""

    def leased(self) -> bool:
        """Whether the blocks it hands out now are leased to this peer in the swarm (not: read in an order of its
        own, as when the DHT does not answer)."""

    def ended(self) -> bool:
        """Whether the last epoch is done, and no block of it is left to this peer's readers."""

    def consumed(self, state: dict) -> None:
        """A batch of a reader with this state (`BlockReader.report()`) reached the trainer."""

    def keep(self) -> None:
        """Tell the swarm what the readers finished, and renew this peer's leases when it is time, batches or not (a
        trainer may wait minutes for a round)."""

    def adopt(self, blocks: list[Assignment]) -> list[Assignment]:
        """A resumed stream's blocks: those still this peer's to read (the others went to other peers)."""

    def state_dict(self, finished: set[tuple[int, int]]) -> dict:
        """What a resumed peer needs to be the same holder of its blocks (JSON-able), with the blocks it FINISHED as
        the trainer saw them (`BlockFeeds.consumed`: in step with the blocks handed out, which the source's own
        reports are not) under "finished": those a resumed stream must mark done again."""

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None:
        """The peer leaves: its unfinished blocks go back to the swarm, at their offsets."""


class FeedError(RuntimeError):
    """The feeding thread failed: the stream cannot go on (its cause is chained)."""


class BlockFeeds:
    """The blocks each reader of a peer reads next, taken by a thread of the main process (the DHT is its) ahead of
    the readers, so that no batch waits on the DHT: each reader gets its blocks through a queue (a process's queue
    for a reader in a DataLoader worker, a thread's for one in the main process), which the thread keeps AHEAD blocks
    ahead of the one it reads. Readers report the blocks they finish through another queue, as soon as they handed
    out their last rows: the swarm learns of them even while the trainer waits for another worker.

    `handed[reader]`: the blocks handed to a reader, in order, from the one it is reading as of the last batch that
    reached the trainer (`consumed`). A stream's state keeps them: a resumed peer hands the same blocks out again,
    from the same offsets, and reads on exactly as if it had never stopped."""

    def __init__(self, source: BlockSource, readers: int, ahead: int) -> None:
        self.source, self.ahead = source, ahead
        self.handed: list[list[Assignment]] = [[] for _ in range(readers)]
        self.queues: list | None = None
        self.reports = None  # finished blocks and batch states, for the source (in the feeding thread)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.ended: set[int] = set()  # readers told that no more blocks come (`others_read_on`)
        self.asked = [0] * readers  # blocks each reader asked for (`next_block`), as the feeding thread learnt
        self.given = [0] * readers  # blocks put in each reader's queue
        # Blocks whose last batch reached the trainer (`consumed`), in step with `handed`: the source learns of them
        # in the feeding thread, later, so a state that took its finished blocks from the source alone could miss
        # one that `handed` no longer holds, and a resumed peer read it again (1 run in 48 of test_leases' resume).
        self.finished: set[tuple[int, int]] = set()

    def load(self, handed: list[list[list[int]]], source_state: dict) -> None:
        self.source.load_state_dict(source_state)
        self.finished = {(epoch, block) for epoch, block in source_state["finished"]}  # (for the next state)
        kept = set(self.source.adopt([Assignment(*block) for blocks in handed for block in blocks]))
        self.handed = [[Assignment(*block) for block in blocks if Assignment(*block) in kept] for blocks in handed]

    def next_block(self, reader: int, finished: list[Assignment]) -> Assignment | None:
        """In the reader's process: its next block, after reporting the blocks it FINISHED (done once handed out)
        and that it asks for one."""
        self.reports.put({"asked": reader, "current": None, "finished": [list(block) for block in finished]})
        found = self.queues[reader].get()
        return None if found is None else Assignment(*found)

    def consumed(self, reader: int, state: dict) -> None:
        """A batch of READER reached the trainer: forget the blocks it finished before it, record the offset."""
        self.reports.put({"current": state["current"], "finished": state["finished"]})
        current = state["current"]
        with self.lock:
            blocks, done = self.handed[reader], {(epoch, block) for epoch, block, _ in state["finished"]}
            while blocks and blocks[0][:2] in done:  # blocks are read in the order they were handed
                blocks.pop(0)
            self.finished |= done
            if current and blocks and blocks[0][:2] == tuple(current[:2]):
                blocks[0] = Assignment(*current)

    def state_dict(self) -> dict:
        """The blocks handed to each reader and the source's state, both as of the last batch that reached the
        trainer."""
        with self.lock:
            handed = [[list(block) for block in blocks] for blocks in self.handed]
            source = self.source.state_dict(set(self.finished))
            self.finished = {(epoch, block) for epoch, block in source["finished"]}  # the rest is settled: forgotten
        return {"blocks": handed, "source": source}

    def start(self, queues: Callable[[], object]) -> None:
        """Before the readers start (and a DataLoader forks its workers): a queue per reader (made by QUEUES),
        holding the blocks handed to it, and the thread that keeps them stocked."""
        self.queues = [queues() for _ in self.handed]
        self.reports = queues()
        for queue, blocks in zip(self.queues, self.handed, strict=True):
            for block in blocks:
                queue.put(tuple(block))
        self.stop.clear()
        self.error = None
        self.ended = set()
        self.asked, self.given = [0] * len(self.handed), [len(blocks) for blocks in self.handed]
        self.thread = threading.Thread(target=self.feed, name="block-feeds", daemon=True)
        self.thread.start()

    def feed(self) -> None:
        """`stock` until stopped; a failure ends every reader's blocks (the stream then raises it: `check`)."""
        try:
            self.stock()
        except Exception as error:  # noqa: BLE001 (handed to the stream's thread, which raises it)
            self.error = error
        if self.error is not None or self.source.ended():
            for queue in self.queues:
                queue.put(None)

    def stock(self) -> None:
        """Keep each queue AHEAD blocks full, pass the readers' reports on and renew the leases, until `finish`
        or the end of the last epoch. Never waits for a block: a worker's batches must go on reaching the trainer
        (a DataLoader waits for its workers in turn), and its finished blocks the swarm."""
        while not self.stop.is_set() and not self.source.ended():
            self.pass_reports_on()
            stocked = False
            for reader, queue in enumerate(self.queues):
                if reader in self.ended or queue.qsize() >= self.ahead:
                    continue
                block = self.source.take()
                if block is not None:
                    with self.lock:
                        self.handed[reader].append(block)
                    queue.put(tuple(block))
                    self.given[reader] += 1
                    stocked = True
                elif self.asked[reader] > self.given[reader] and self.others_read_on(reader):
                    self.ended.add(reader)
                    queue.put(None)
            self.source.keep()
            if not stocked:  # nothing to take, or every queue full: look again soon (a block can last milliseconds)
                self.stop.wait(IDLE_POLL)

    def pass_reports_on(self) -> None:
        """The readers' reports to the source; count the blocks each reader asked for."""
        while not self.reports.empty():
            report = self.reports.get()
            if "asked" in report:
                self.asked[report["asked"]] += 1
            self.source.consumed(report)

    def others_read_on(self, reader: int) -> bool:
        """Whether READER, waiting for a block with none to take, ends now: the stream's epochs are counted and
        another reader of this peer has not ended. Waiting would not do: the DataLoader hands batches out in its
        workers' turn, so a reader still reading waits for this one's next batch, and this one for the end of its
        blocks (seen: two workers, each waiting for the other, for good). A reader ends only once it waits: one that
        still reads its last block counts as reading on (ended while it read, it left the other waiting for good: 1
        run in 60). The last reader waits on, and takes the blocks a dead peer's leases leave when they run out."""
        if self.source.epochs is None:  # a run reads for ever: the epochs after this one have free blocks
            return False
        return any(other not in self.ended for other in range(len(self.queues)) if other != reader)

    def check(self) -> None:
        if self.error is not None:
            raise FeedError(f"the stream's blocks stopped coming: {self.error}") from self.error

    def finish(self) -> None:
        """The readers are done: no more stocking; the reports they left reach the source."""
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.reports is not None:
            self.pass_reports_on()
        self.source.keep()  # what those reports finished, for the swarm
        self.queues = self.reports = None
