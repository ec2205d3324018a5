"""Swarm-wide reading of an epoch: the blocks every peer computes alike, who holds a block, and leases taken,
renewed, taken over and finished through a real hivemind DHT."""

from __future__ import annotations

import json
import queue
import threading
from concurrent.futures import Future
from pathlib import Path

import hivemind
import numpy as np
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from pipeline.core.blocks import BLOCKS_PER_SPLIT, Assignment, BlockFeeds, EpochPlan, block_units
from pipeline.core.stream import CodeStream, index_dataset
from tests.test_stream import write_dataset
from training.metrics import peer_key
from training.swarm.leases import LEASE, Lease, LeaseBook, LeaseSource, block_state, epoch_coverage


def test_an_epoch_plan_covers_every_row_once_and_is_the_same_on_every_peer():
    units = [1024] * 700 + [311]
    plan = EpochPlan(units, seed=7, epoch=3)
    assert plan.per_block == block_units(len(units)) == 8 and plan.blocks == 88
    rows = np.concatenate([plan.row_order(b) for b in range(plan.blocks)])
    assert len(rows) == sum(units) and len({(int(u), int(r)) for u, r in rows}) == sum(units)
    again = EpochPlan(units, seed=7, epoch=3)
    assert again.units_of(5) == plan.units_of(5) and (again.row_order(5) == plan.row_order(5)).all()
    assert EpochPlan(units, seed=7, epoch=4).units_of(5) != plan.units_of(5)  # another epoch, another order
    assert EpochPlan([25] * 8, seed=0, epoch=0).blocks == 8  # the sample: blocks of one row group
    with pytest.raises(IndexError, match="outside epoch 3's 88 blocks"):
        plan.units_of(88)


def test_the_holder_is_the_earliest_live_lease_and_an_expired_one_leaves_its_offset():
    now = 1000.0
    assert block_state({}, now) == (None, 0, False)
    two = {"b": Lease(10.0, now + 60, 64), "a": Lease(12.0, now + 60, 0)}
    assert block_state(two, now).holder == "b"  # claimed first
    assert block_state({**two, "c": Lease(10.0, now + 60, 0)}, now).holder == "b"  # a tie: the smaller key
    expired = {"b": Lease(10.0, now - 1, 640)}
    assert block_state(expired, now) == (None, 640, False)  # free, from where its holder got
    assert block_state({**two, "d": Lease(5.0, now - 1, 8192, done=True)}, now).done
    greedy = {"z": Lease(1.0, now + 10 * LEASE, 0)}
    assert block_state(greedy, now).holder is None  # nobody holds a block for longer than a renewal gives


@pytest.fixture(scope="module")
def books():
    """Three peers' lease books on one DHT: three nodes, each signing its own entries."""
    validators = [RSASignatureValidator(RSAPrivateKey()) for _ in range(3)]  # one key per peer, as in 3 processes
    first = hivemind.DHT(start=True, record_validators=[validators[0]])
    others = [
        hivemind.DHT(start=True, initial_peers=first.get_visible_maddrs(), record_validators=[validator])
        for validator in validators[1:]
    ]
    dhts = [first, *others]
    yield [LeaseBook(dht, "leases-test", v.local_public_key) for dht, v in zip(dhts, validators, strict=True)]
    for dht in dhts:
        dht.shutdown()


def test_peers_take_different_blocks_renew_them_and_a_dead_peers_block_is_taken_over_where_it_stopped(books):
    a, b, c = books
    plan = EpochPlan([25] * 8, seed=0, epoch=0)
    taken_a, taken_b = a.take(plan), b.take(plan)
    assert taken_a is not None and taken_b is not None and taken_a[0] != taken_b[0]
    assert a.renew(0, 0, {taken_a[0]: 10}) == [] and b.renew(0, 0, {taken_b[0]: 5}) == []
    a.finish(0, 0, {taken_a[0]: 25})
    a.flush()  # (a peer's next lease on the split carries its done marks, or its next renewal)
    # B dies: its lease runs out (here: it is made to), and C goes on from B's offset
    b.own[(0, 0)][taken_b[0]].until = get_dht_time() - 1
    b.write(0, 0)
    taken = {c.take(plan) for _ in range(plan.blocks - 1)}
    assert (taken_b[0], 5) in taken and taken_a[0] not in {block for block, _ in taken if block is not None}
    assert c.take(plan) is None  # every block is done or held
    assert b.renew(0, 0, {taken_b[0]: 7}) == [taken_b[0]]  # B comes back too late: C holds its block now
    assert c.requests <= 3 * len(taken) + 2  # per block taken: a read, the lease, a read to confirm it
    seen = epoch_coverage(c.dht, "leases-test", 0, plan.blocks)  # what the monitor shows
    assert seen == {"epoch": 0, "blocks": 8, "done": 1, "reading": 7, "left": 0, "not_started": 0, "taken_over": 1}
    assert BLOCKS_PER_SPLIT >= plan.blocks  # (the sample's epoch is one split)


def test_a_convicted_peers_leases_hold_no_block_and_its_done_marks_finish_none(books):
    a, b, _ = books
    convicted: set[str] = set()  # what the peer's audits fill (Audits.convicted)
    honest = LeaseBook(a.dht, "convicted", a.public_key, ignored=convicted)
    rogue = LeaseBook(b.dht, "convicted", b.public_key)
    plan = EpochPlan([25] * 8, seed=0, epoch=0)
    held, finished = rogue.take(plan), rogue.take(plan)
    assert held is not None and finished is not None
    rogue.renew(0, 0, {held[0]: 10})
    rogue.finish(0, 0, {finished[0]: 25})
    rogue.flush()
    taken = {honest.take(plan) for _ in range(plan.blocks - 2)}
    assert {block for block, _ in taken} == set(range(plan.blocks)) - {held[0], finished[0]}
    assert honest.take(plan) is None  # before the conviction: the rogue's blocks are its own
    convicted.add(peer_key(b.public_key))
    honest.full_splits.clear()  # (it reads the split again RECHECK seconds later)
    assert {honest.take(plan), honest.take(plan)} == {(held[0], 0), (finished[0], 0)}  # read again, from the start
    assert rogue.renew(0, 0, {held[0]: 20}) == []  # the rogue reads on (nothing stops it), for nothing


def lease_books(count: int, lease: float) -> tuple[list, list[LeaseBook]]:
    """COUNT peers' lease books of run "coverage", each on its own DHT node with its own key."""
    keys = [RSASignatureValidator(RSAPrivateKey()) for _ in range(count)]
    dhts = [hivemind.DHT(start=True, record_validators=[keys[0]])]
    for key in keys[1:]:
        dhts.append(hivemind.DHT(start=True, initial_peers=dhts[0].get_visible_maddrs(), record_validators=[key]))
    return dhts, [LeaseBook(dht, "coverage", key.local_public_key, lease) for dht, key in zip(dhts, keys, strict=True)]


def swarm_stream(folder: Path, book: LeaseBook, workers: int = 0) -> CodeStream:
    units = [unit.rows for unit in index_dataset(str(folder)).units]
    source = LeaseSource(book, units, seed=3, epochs=1)
    return CodeStream(folder, batch_size=4, seed=3, epochs=1, num_workers=workers, blocks=source)


def read_in_threads(streams: list[CodeStream], timeout: float = 300.0) -> list[list[str] | None]:
    """Each stream read to its end in a thread of its own (as peers in processes of their own would); None for one
    still reading after TIMEOUT seconds. Plain threads, not a ThreadPoolExecutor's: a DataLoader worker forked from an
    executor's thread failed its exit (Python's exit joins the executor's threads, the one that forked included:
    "cannot join current thread") with code 1, which torch reported as the worker's failure (1 run in 6 of three test
    files here, and clean-clone runs 43 and stop 60's CI)."""
    read: list[list[str] | None] = [None] * len(streams)
    errors: list[BaseException] = []

    def read_one(index: int) -> None:
        try:
            read[index] = [key for batch in streams[index] for key in batch["key"]]
        except BaseException as error:  # noqa: BLE001 (raised again in the test's thread)
            errors.append(error)

    threads = [threading.Thread(target=read_one, args=(index,), daemon=True) for index in range(len(streams))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    if errors:
        raise errors[0]
    return read


@pytest.mark.parametrize("workers", [0, 2])
def test_two_peers_read_every_row_of_an_epoch_once_between_them(tmp_path, workers):
    folder = tmp_path / "data"
    every = write_dataset(folder)  # 24 row groups of 10 rows: 24 blocks
    dhts, books = lease_books(2, lease=30.0)
    try:
        read = read_in_threads([swarm_stream(folder, book, workers) for book in books])
    finally:
        for dht in dhts:
            dht.shutdown()
    assert sorted(read[0] + read[1]) == sorted(every) and min(map(len, read)) >= 40, list(map(len, read))


class BlocksInOrder:
    """The blocks of one epoch handed out in their order to a peer alone: what a LeaseSource does without a swarm,
    so that a test knows which reader holds which block."""

    epochs = 1

    def __init__(self, blocks: int) -> None:
        self.blocks, self.taken, self.held = blocks, 0, set()

    def take(self) -> Assignment | None:
        if self.taken == self.blocks:
            return None
        self.taken += 1
        self.held.add(self.taken - 1)
        return Assignment(0, self.taken - 1, 0)

    def leased(self) -> bool:
        return False

    def ended(self) -> bool:
        return self.taken == self.blocks and not self.held

    def consumed(self, state: dict) -> None:
        self.held -= {block for _, block, _ in state["finished"]}

    def keep(self) -> None:
        pass


class ResumableBlocksInOrder(BlocksInOrder):
    """BlocksInOrder with a state, whose feeding thread has not passed any report on."""

    def state_dict(self, finished: set[tuple[int, int]]) -> dict:
        return {"epoch": 0, "finished": sorted([epoch, block] for epoch, block in finished)}

    def load_state_dict(self, state: dict) -> None:
        pass

    def adopt(self, blocks: list[Assignment]) -> list[Assignment]:
        return blocks


def test_a_streams_state_names_a_block_finished_as_soon_as_the_trainer_got_its_last_batch():
    """The blocks handed out and the blocks finished, as of one batch, whatever the feeding thread passed on yet:
    a block finished just before a checkpoint was once in neither (the source learnt of it later), and the resumed
    peer read it again. A resumed stream's next state still names the blocks its checkpoint did."""
    feeds = BlockFeeds(ResumableBlocksInOrder(3), readers=1, ahead=2)
    feeds.handed = [[Assignment(0, 0, 0), Assignment(0, 1, 0)]]
    feeds.reports = queue.Queue()  # no feeding thread: the reports wait there
    feeds.consumed(0, {"current": [0, 1, 3], "finished": [[0, 0, 40]]})
    state = feeds.state_dict()
    assert state == {"blocks": [[[0, 1, 3]]], "source": {"epoch": 0, "finished": [[0, 0]]}}
    resumed = BlockFeeds(ResumableBlocksInOrder(3), readers=1, ahead=2)
    resumed.load(state["blocks"], state["source"])
    assert resumed.state_dict() == state


def test_a_peers_loader_workers_end_the_epoch_when_its_last_blocks_are_another_workers(tmp_path):
    """Worker 1 runs out of blocks mid-batch while worker 0 holds the epoch's last one, and the DataLoader waits for
    worker 1's batch before it takes more of worker 0's: worker 1 must end there, not wait for worker 0's block to
    be finished (both waited for good: 1 run in 25 of the two peers' test above)."""
    folder = tmp_path / "data"
    every = write_dataset(folder, files=1, rows_per_file=120, row_group=40)  # 3 blocks: worker 0 gets 0 and 2
    stream = CodeStream(folder, batch_size=6, seed=3, epochs=1, num_workers=2, blocks=BlocksInOrder(3))
    [read] = read_in_threads([stream], timeout=60)
    if read is None:
        stream.feeds.source.held.clear()  # (lets the workers end)
        raise AssertionError("the stream's two workers waited for each other")
    assert sorted(read) == sorted(every)


def test_a_resumed_stream_with_a_new_dht_key_reads_on_exactly_where_its_checkpoint_stopped(tmp_path):
    """A peer killed after its checkpoint resumes with a new DHT key (a new process) within its leases' life: the
    holder id in the stream's state makes it the same holder, and its batches are those the killed one read."""
    folder = tmp_path / "data"
    write_dataset(folder)
    dhts, books = lease_books(2, lease=120.0)  # no renewal (every 30 s) records the killed one's later offsets
    try:
        first = swarm_stream(folder, books[0])
        batches = iter(first)
        for _ in range(4):
            next(batches)
        state = json.loads(json.dumps(first.state_dict()))
        killed_read = [key for _ in range(6) for key in next(batches)["key"]]  # then SIGKILL: no goodbye
        resumed = swarm_stream(folder, books[1])
        resumed.load_state_dict(state)
        assert [key for _, batch in zip(range(6), resumed, strict=False) for key in batch["key"]] == killed_read
    finally:
        for dht in dhts:
            dht.shutdown()


class SilentDHT:
    """A DHT whose requests never answer (a peer cut off from the swarm)."""

    def get(self, *args, **kwargs) -> Future:
        return Future()

    store = get


def test_a_peer_whose_dht_does_not_answer_reads_every_row_in_its_own_order_and_says_so_once(tmp_path):
    folder = tmp_path / "data"
    every = write_dataset(folder)
    said = []
    book = LeaseBook(SilentDHT(), "cut-off", b"key", timeout=0.2)
    units = [unit.rows for unit in index_dataset(str(folder)).units]
    source = LeaseSource(book, units, seed=3, epochs=2, say=said.append, own_seed=11)
    stream = CodeStream(folder, batch_size=4, seed=3, epochs=2, blocks=source)
    batches = list(stream)
    read = [key for batch in batches for key in batch["key"]]
    assert sorted(read) == sorted(every * 2) and read[: len(every)] != read[len(every) :]
    assert not any("blocks" in batch for batch in batches)  # no lease holds them: its audits commit nothing
    assert len(said) == 1 and "the run's data leases do not answer" in said[0] and "own order" in said[0]
