"""Leases on an epoch's blocks (pipeline/core/blocks.py), kept in the run's DHT: who reads which block, how far it
got, and which blocks are done, so that the swarm reads every row once per epoch.

Where. A split of BLOCKS_PER_SPLIT blocks is one DHT key, `{run_id}_blocks_e{epoch}_s{split}`; each peer writes one
entry under it, its subkey being its public key (signed: nobody else can write it), holding every block of the
split it took this epoch: `{"holder": id, "leases": {block: [claimed, until, offset, done]}}` (DHT times; `offset`:
rows of the block handed out). One read of a split tells a peer the state of 64 blocks. The holder id is the
stream's, kept in its state: a peer that resumes from a checkpoint (a new DHT key) is the same holder.

Who holds a block, the same answer on every peer that read the same entries (`block_state`):

- done, when an entry says so;
- else the live leases (`until` not past): the holder is the earliest `claimed`, then the smallest holder id;
- else nobody: free, from the furthest `offset` an entry recorded (its holder died or left: the next one goes on).

Two peers that take one block at the same moment: each reads the key again after its write, and the later one
withdraws. When the two writes crossed unseen, the next renewal settles it (the later one stops renewing), but a
block already handed to both readers is read to its end by both: rows read twice, never rows missed.

A convicted peer's entries count for nothing (`LeaseBook.ignored`: the keys this peer's audits convicted, see
training/audit/): its leases hold no block and its done marks finish none, so the rows it leased in an epoch still
open are read again, by honest peers, from the furthest offset an honest entry recorded.

A peer whose DHT does not answer a lease request within DHT_TIMEOUT reads on in its own order of the blocks (as
if alone) and says so once: a run goes on when its DHT does not.
"""

from __future__ import annotations

import math
import secrets
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from hivemind.utils import get_dht_time

from pipeline.core.blocks import BLOCKS_PER_SPLIT, Assignment, EpochPlan, split_of
from training.metrics import peer_key, read_latest

LEASE = 120.0  # seconds a lease lives unless renewed; its holder renews it (and records its offset) every quarter
RECHECK = 2.0  # seconds before a peer with nothing to take reads a split whose blocks others hold again
TAKE_ATTEMPTS = 3  # blocks a peer tries in one split before the next one, when others take them at the same moment
DHT_TIMEOUT = 20.0  # seconds a lease request may take before the peer reads in its own order
# Epochs past the oldest one with blocks left that a peer takes blocks of: a dataset of few blocks read by many
# peers (the sample's 8 blocks, each peer holding up to 3) spans several epochs at once.
EPOCHS_AHEAD = 16
REMEMBER = 7 * 24 * 3600.0  # seconds an entry stays in the DHT: what was done outlives the lease for an epoch's life


@dataclass
class Lease:
    """One peer's lease on one block."""

    claimed: float
    until: float
    offset: int
    done: bool = False

    def as_value(self) -> list:
        return [self.claimed, self.until, self.offset, self.done]

    @classmethod
    def from_value(cls, value: object) -> Lease | None:
        """A lease from an entry's value, or None for a malformed one (any peer can write anything)."""
        if not (isinstance(value, list | tuple) and len(value) == 4):
            return None
        claimed, until, offset, done = value
        if not (isinstance(claimed, float | int) and isinstance(until, float | int) and isinstance(done, bool)):
            return None
        if not isinstance(offset, int) or offset < 0:
            return None
        return cls(float(claimed), float(until), offset, done)


class BlockState(NamedTuple):
    holder: str | None  # the holding stream's id; None: done, or free
    offset: int  # rows handed out so far
    done: bool


class LeaseTimeout(Exception):
    """The DHT did not answer a lease request in time."""


def block_state(leases: dict[str, Lease], now: float, lease: float = LEASE) -> BlockState:
    """What the entries of every peer (holder id -> its lease on one block) say about that block at NOW (leases of
    LEASE seconds)."""
    furthest = max((entry.offset for entry in leases.values()), default=0)
    if any(entry.done for entry in leases.values()):
        return BlockState(None, furthest, True)
    # A lease longer than a renewal can give is none: a peer cannot hold a block for good by asking for it.
    live = sorted((entry.claimed, peer) for peer, entry in leases.items() if now < entry.until <= now + 2 * lease)
    return BlockState(live[0][1] if live else None, furthest, False)


def split_key(run_id: str, epoch: int, split: int) -> str:
    return f"{run_id}_blocks_e{epoch}_s{split}"


def split_entries(found: object) -> Iterator[tuple[str, str, int, Lease]]:
    """A `dht.get` of a split, entry by entry: (writer's signing key (`peer_key`), holder id, block, lease), the
    malformed ones left out (any peer can write anything under its own subkey)."""
    entries = getattr(found, "value", None)
    if not isinstance(entries, dict):
        return
    for subkey, entry in entries.items():
        value = getattr(entry, "value", None)
        if not (isinstance(value, dict) and isinstance(value.get("leases"), dict)):
            continue
        holder = value.get("holder")
        if not (isinstance(holder, str) and 0 < len(holder) <= 32):
            continue
        for block, raw in value["leases"].items():
            lease = Lease.from_value(raw)
            if lease is not None and isinstance(block, str) and block.isdigit():
                yield peer_key(subkey), holder, int(block), lease


def parse_split(found: object, ignored: Collection[str] = ()) -> dict[int, dict[str, Lease]]:
    """A `dht.get` of a split: block -> {holder: lease}, those of IGNORED signing keys left out; two entries of one
    holder (before and after it resumed) count as one lease, as far as the further of them."""
    blocks: dict[int, dict[str, Lease]] = {}
    for key, holder, block, lease in split_entries(found):
        if key not in ignored:
            seen = blocks.setdefault(block, {})
            seen[holder] = merged(seen[holder], lease) if holder in seen else lease
    return blocks


def lessees(
    dht, run_id: str, splits: Collection[tuple[int, int]], timeout: float
) -> dict[tuple[int, int], set[str]] | None:
    """(epoch, block) -> the signing keys whose entries name it (whatever became of their leases), for every block of
    these (epoch, split)s: whom the audits let have read its rows (training/audit/leased.py); None when the DHT did
    not answer them all within TIMEOUT seconds."""
    futures = {
        (epoch, split): read_latest(dht, split_key(run_id, epoch, split), return_future=True) for epoch, split in splits
    }
    found: dict[tuple[int, int], set[str]] = {}
    deadline = time.monotonic() + timeout
    try:
        for (epoch, _), future in futures.items():
            for key, _, block, _ in split_entries(future.result(max(0.0, deadline - time.monotonic()))):
                found.setdefault((epoch, block), set()).add(key)
    except FutureTimeout:
        return None
    return found


def merged(one: Lease, other: Lease) -> Lease:
    claimed, until = min(one.claimed, other.claimed), max(one.until, other.until)
    return Lease(claimed, until, max(one.offset, other.offset), one.done or other.done)


class LeaseBook:
    """This peer's side: take a free block, renew its leases with their offsets, mark a block done, give blocks back
    (see above). Each method is one or two DHT requests; LeaseTimeout when the DHT does not answer in time."""

    def __init__(
        self,
        dht,
        run_id: str,
        public_key: bytes,
        lease: float = LEASE,
        timeout: float = DHT_TIMEOUT,
        order_seed: int | None = None,
        ignored: Collection[str] = (),
    ) -> None:
        self.dht, self.run_id, self.public_key, self.lease, self.timeout = dht, run_id, public_key, lease, timeout
        self.ignored = ignored  # the signing keys whose entries count for nothing (convicted: kept up to date by ttt)
        self.me = secrets.token_hex(8)  # this stream's holder id (a resumed one's: `LeaseSource.load_state_dict`)
        # The order this peer tries blocks in (ttt train: from its peer identity, so that a peer that runs again
        # alone reads the same blocks in the same order); by default, from its holder id.
        self.order_seed = order_seed
        self.own: dict[tuple[int, int], dict[int, Lease]] = {}  # (epoch, split) -> this peer's leases there
        # (epoch, split) -> when to look at it again (never: every block done), and whether it is settled: every
        # block done or this peer's (which it finishes without anyone's help)
        self.full_splits: dict[tuple[int, int], tuple[float, bool]] = {}
        self.unwritten: set[tuple[int, int]] = set()  # splits with blocks marked done since this peer's last write
        self.requests = 0  # DHT gets and stores, for the bench's count per block

    def read(self, epoch: int, split: int) -> dict[int, dict[str, Lease]]:
        self.requests += 1
        future = read_latest(self.dht, split_key(self.run_id, epoch, split), return_future=True)
        blocks = parse_split(self.wait(future, "read"), self.ignored)
        for block, lease in self.own.get((epoch, split), {}).items():  # what this peer knows of its own best
            blocks.setdefault(block, {})[self.me] = lease
        return blocks

    def write(self, epoch: int, split: int) -> None:
        self.requests += 1
        leases = {str(block): lease.as_value() for block, lease in self.own[(epoch, split)].items()}
        future = self.dht.store(
            split_key(self.run_id, epoch, split),
            subkey=self.public_key,
            value={"holder": self.me, "leases": leases},
            expiration_time=get_dht_time() + REMEMBER,
            return_future=True,
        )
        self.wait(future, "write")
        self.unwritten.discard((epoch, split))

    def wait(self, future, what: str):
        try:
            return future.result(timeout=self.timeout)
        except FutureTimeout:
            future.cancel()
            raise LeaseTimeout(f"a lease {what} took over {self.timeout:.0f} s") from None

    def state(self, block: int, blocks: dict[int, dict[str, Lease]]) -> BlockState:
        return block_state(blocks.get(block, {}), get_dht_time(), self.lease)

    def take(self, plan: EpochPlan) -> tuple[int, int] | None:
        """A free block of PLAN's epoch, leased to this peer: (block, offset to start at); None when every block is
        done or held by another peer. Each peer tries the splits, and the blocks of a split, in an order of its own,
        so that peers starting together rarely ask for the same block; when two do, the check after the write
        leaves it to one of them."""
        splits = -(-plan.blocks // BLOCKS_PER_SPLIT)
        mine = np.random.default_rng(int(self.me, 16) if self.order_seed is None else self.order_seed)
        for split in mine.permutation(splits).tolist():
            if get_dht_time() < self.full_splits.get((plan.epoch, split), (0.0, False))[0]:
                continue
            candidates = range(split * BLOCKS_PER_SPLIT, min(plan.blocks, (split + 1) * BLOCKS_PER_SPLIT))
            for _ in range(TAKE_ATTEMPTS):
                found = self.take_in_split(plan.epoch, split, mine.permutation(list(candidates)).tolist())
                if found is None:
                    break
                if self.confirm(plan.epoch, *found):
                    return found
        return None

    def take_in_split(self, epoch: int, split: int, candidates: list[int]) -> tuple[int, int] | None:
        """Lease the first free block of CANDIDATES, as one read of SPLIT shows them; None when there is none."""
        blocks, now = self.read(epoch, split), get_dht_time()
        own = self.own.get((epoch, split), {})
        for block in candidates:
            offset = self.takeable(block, blocks.get(block, {}), own, now)
            if offset is not None:
                self.own.setdefault((epoch, split), {})[block] = Lease(now, now + self.lease, offset)
                self.write(epoch, split)
                return block, offset
        states = [self.state(block, blocks) for block in candidates]
        all_done = all(state.done for state in states)
        settled = all(state.done or state.holder == self.me for state in states)
        self.full_splits[(epoch, split)] = (math.inf if all_done else now + min(self.lease / 4, RECHECK), settled)
        return None

    def takeable(self, block: int, entries: dict[str, Lease], own: dict[int, Lease], now: float) -> int | None:
        """The offset this peer may take BLOCK from (ENTRIES: every holder's lease on it), or None: done, or held
        by another. An entry of this holder for a block this process never took is an earlier process's, which
        died after the checkpoint this one resumed from: this one reads the block again, whatever that one did."""
        if self.me in entries and block not in own:
            entries = {holder: lease for holder, lease in entries.items() if holder != self.me}
        state = block_state(entries, now, self.lease)
        return None if state.done or state.holder is not None else state.offset

    def confirm(self, epoch: int, block: int, offset: int) -> bool:
        """Whether this peer holds BLOCK after its write (another may have taken it at the same moment, earlier):
        if not, its lease is withdrawn."""
        split = split_of(block)
        if self.state(block, self.read(epoch, split)).holder == self.me:
            return True
        self.own[(epoch, split)][block].until = get_dht_time()
        self.write(epoch, split)
        return False

    def epoch_settled(self, plan: EpochPlan) -> bool:
        """Whether every block of PLAN's epoch was seen done or held by this peer (as of its last reads): nothing
        there is left for it to take or to wait for."""
        splits = -(-plan.blocks // BLOCKS_PER_SPLIT)
        return all(self.full_splits.get((plan.epoch, split), (0.0, False))[1] for split in range(splits))

    def renew(self, epoch: int, split: int, offsets: dict[int, int]) -> list[int]:
        """Record the OFFSETS of this peer's blocks of one split and extend their leases (one read, one write); the
        blocks another peer holds now (it took one at the same moment, earlier by its clock; or this peer's lease
        ran out and it was taken over), which this peer gives up."""
        blocks, now = self.read(epoch, split), get_dht_time()
        lost = []
        for block, offset in offsets.items():
            state, lease = self.state(block, blocks), self.own[(epoch, split)][block]
            if state.holder not in (None, self.me) or state.done:
                lease.until = now  # no longer this peer's
                lost.append(block)
            else:
                lease.until, lease.offset = now + self.lease, max(lease.offset, offset)
        self.write(epoch, split)
        return lost

    def adopt(self, epoch: int, split: int, offsets: dict[int, int]) -> list[int]:
        """A resumed peer's blocks of one split, with the offsets it resumes from: those it still holds, or that
        nobody else finished or holds now (leased to it again); the others went on without it."""
        blocks, now = self.read(epoch, split), get_dht_time()
        own, kept = self.own.get((epoch, split), {}), []
        for block, offset in offsets.items():
            entries = blocks.get(block, {})
            if self.takeable(block, entries, own, now) is None:
                continue
            claimed = entries[self.me].claimed if self.me in entries else now  # its place among takers, kept
            self.own.setdefault((epoch, split), {})[block] = Lease(claimed, now + self.lease, offset)
            kept.append(block)
        if kept:
            self.write(epoch, split)
        return kept

    def finish(self, epoch: int, split: int, rows: dict[int, int]) -> None:
        """Every row of these blocks of one split was handed out (ROWS: each block's): done, for every peer once
        written, by the peer's next lease on the split (a reader that finishes a block starts a queued one, and the
        peer takes the next at once) or by `flush`."""
        now = get_dht_time()
        for block, count in rows.items():
            self.own.setdefault((epoch, split), {})[block] = Lease(now, now, count, done=True)
        self.unwritten.add((epoch, split))

    def flush(self) -> None:
        """Write the done marks that no lease carried."""
        for epoch, split in sorted(self.unwritten):
            self.write(epoch, split)

    def give_back(self, epoch: int, split: int, offsets: dict[int, int]) -> None:
        """This peer stops reading these blocks of one split at their OFFSETS (it leaves): the next peer takes each
        from there."""
        for block, offset in offsets.items():
            lease = self.own[(epoch, split)][block]
            lease.offset, lease.until = max(lease.offset, offset), get_dht_time()
        self.write(epoch, split)


def by_split(blocks: dict[tuple[int, int], int]) -> dict[tuple[int, int], dict[int, int]]:
    """(epoch, block) -> offset, grouped as (epoch, split) -> {block: offset}: one DHT entry each."""
    grouped: dict[tuple[int, int], dict[int, int]] = {}
    for (epoch, block), offset in blocks.items():
        grouped.setdefault((epoch, split_of(block)), {})[block] = offset
    return grouped


class OwnOrder:
    """The blocks of each epoch in an order of this peer's own, leased to nobody: how a peer reads when the DHT
    does not answer (as each peer read before leases: the swarm's rows are then read about 1 - 1/e once)."""

    def __init__(self, units: list[int], seed: int, start_epoch: int) -> None:
        self.units, self.seed, self.epoch, self.position = units, seed, start_epoch, 0
        self.order: list[int] = []

    def take(self, epochs: int | None) -> Assignment | None:
        if self.position == len(self.order):
            if self.order:
                self.epoch += 1
            if epochs is not None and self.epoch >= epochs:
                return None
            blocks = EpochPlan(self.units, self.seed, self.epoch).blocks
            self.order = np.random.default_rng([self.seed, 3, self.epoch]).permutation(blocks).tolist()
            self.position = 0
        self.position += 1
        return Assignment(self.epoch, self.order[self.position - 1], 0)


class LeaseSource:
    """A peer stream's blocks (pipeline/core/blocks.py's BlockSource) from the run's leases: the oldest epoch with a
    free block first; later ones while the last blocks of this one are being read by others.
    SAY: where the one line goes when the DHT does not answer; OWN_SEED: the peer's own order then."""

    def __init__(
        self,
        book: LeaseBook,
        units: list[int],
        seed: int,
        epochs: int | None = None,
        say: Callable[[str], None] = print,
        own_seed: int = 0,
    ) -> None:
        self.book, self.units, self.seed, self.epochs = book, units, seed, epochs
        self.say, self.own_seed = say, own_seed
        self.epoch = 0  # the oldest epoch that may have blocks to read
        self.plans: dict[int, EpochPlan] = {}
        self.held: dict[tuple[int, int], int] = {}  # this peer's unfinished blocks -> rows of them consumed
        self.renewed = time.monotonic()
        self.finished: set[tuple[int, int]] = set()  # blocks this peer handed out whole
        self.alone: OwnOrder | None = None  # the DHT did not answer: blocks in this peer's own order

    def plan(self, epoch: int) -> EpochPlan:
        if epoch not in self.plans:
            self.plans[epoch] = EpochPlan(self.units, self.seed, epoch)
        return self.plans[epoch]

    def read_alone(self, error: LeaseTimeout) -> None:
        self.say(f"the run's data leases do not answer ({error}): this peer reads the data in its own order")
        self.alone, self.held = OwnOrder(self.units, self.own_seed, self.epoch), {}

    def take(self) -> Assignment | None:
        if self.alone is None:
            try:
                return self.take_now()
            except LeaseTimeout as error:
                self.read_alone(error)
        return self.alone.take(self.epochs)

    def leased(self) -> bool:
        return self.alone is None

    def ended(self) -> bool:
        """Past the last epoch, with no block of it left to read (its leases are kept until then)."""
        epoch = self.epoch if self.alone is None else self.alone.epoch
        return self.epochs is not None and epoch >= self.epochs and not self.held

    def take_now(self) -> Assignment | None:
        """A free block of the oldest epoch that has one now, among this one and the EPOCHS_AHEAD after it."""
        epoch = self.epoch
        while self.units and epoch <= self.epoch + EPOCHS_AHEAD and (self.epochs is None or epoch < self.epochs):
            found = self.book.take(self.plan(epoch))
            if found is not None:
                self.held[(epoch, found[0])] = found[1]
                return Assignment(epoch, *found)
            if epoch == self.epoch and self.book.epoch_settled(self.plan(epoch)):
                self.plans.pop(epoch)
                self.finished = {done for done in self.finished if done[0] > epoch}
                self.epoch += 1
            epoch += 1
        return None

    def consumed(self, state: dict) -> None:
        """Blocks finished, and the offset of the one in progress."""
        for epoch, block, rows in state["finished"]:
            if self.held.pop((epoch, block), None) is not None:
                self.finished.add((epoch, block))
                self.book.finish(epoch, split_of(block), {block: rows})
        if state["current"] and tuple(state["current"][:2]) not in self.finished:
            epoch, block, offset = state["current"]
            if (epoch, block) in self.held:
                self.held[(epoch, block)] = offset

    def keep(self) -> None:
        """Write the done marks no take carried; renew this peer's leases when it is time."""
        self.with_dht(self.book.flush)
        if self.alone is not None or time.monotonic() - self.renewed < self.book.lease / 4:
            return
        for (epoch, split), offsets in by_split(self.held).items():
            for block in self.with_dht(self.book.renew, epoch, split, offsets) or []:
                del self.held[(epoch, block)]  # another peer holds it now: its rows are that peer's to report
        self.renewed = time.monotonic()

    def with_dht(self, request: Callable, *args):
        """REQUEST's answer, or None once the DHT did not answer (then the peer reads alone)."""
        if self.alone is None:
            try:
                return request(*args)
            except LeaseTimeout as error:
                self.read_alone(error)
        return None

    def adopt(self, blocks: list[Assignment]) -> list[Assignment]:
        """The blocks of a resumed stream that are still its to read; the blocks it finished are marked done again
        (the DHT may have forgotten them: a peer alone, or a swarm that all restarted)."""
        finished = {(epoch, block): self.plan(epoch).rows_of(block) for epoch, block in self.finished}
        for (epoch, split), rows in by_split(finished).items():
            self.book.finish(epoch, split, rows)
        self.with_dht(self.book.flush)
        held = {(block.epoch, block.block): block.offset for block in blocks}
        kept = []
        for (epoch, split), offsets in by_split(held).items():
            kept += [(epoch, block) for block in self.with_dht(self.book.adopt, epoch, split, offsets) or []]
        if self.alone is not None:
            return blocks
        self.held = {key: held[key] for key in kept}
        self.epoch = min([epoch for epoch, _ in kept] + [self.epoch])
        return [block for block in blocks if (block.epoch, block.block) in self.held]

    def state_dict(self, finished: set[tuple[int, int]]) -> dict:
        """The holder id, the oldest epoch with blocks left, and the blocks of FINISHED since it. (Not this
        source's own `finished`, which the feeding thread changes, and learns of later than the trainer.)"""
        epoch = self.epoch
        return {"holder": self.book.me, "epoch": epoch, "finished": sorted([e, b] for e, b in finished if e >= epoch)}

    def load_state_dict(self, state: dict) -> None:
        self.book.me, self.epoch = state["holder"], state["epoch"]
        self.finished = {(epoch, block) for epoch, block in state["finished"]}

    def close(self) -> None:
        """Give this peer's unfinished blocks back, at the rows consumed (not waiting long: they run out anyway)."""
        self.book.timeout = min(self.book.timeout, 5.0)
        try:
            for (epoch, split), offsets in by_split(self.held if self.alone is None else {}).items():
                self.book.give_back(epoch, split, offsets)
            if self.alone is None:
                self.book.flush()
        except LeaseTimeout:
            pass
        self.held.clear()


def epoch_coverage(dht, run_id: str, epoch: int, blocks: int) -> dict:
    """What the run's leases say of EPOCH's BLOCKS blocks (a monitor's view): done, being read, left part-read by a
    peer that went away (the next one goes on from its offset), not started; and taken over (by a second holder)."""
    now, counts = get_dht_time(), Counter()
    for split in range(-(-blocks // BLOCKS_PER_SPLIT)):
        for block, leases in parse_split(read_latest(dht, split_key(run_id, epoch, split))).items():
            if block >= blocks:
                continue
            state = block_state(leases, now)
            counts["done" if state.done else "reading" if state.holder else "left" if state.offset else "free"] += 1
            counts["taken_over"] += len(leases) > 1
    started = counts["done"] + counts["reading"] + counts["left"]
    return {
        "epoch": epoch,
        "blocks": blocks,
        "done": counts["done"],
        "reading": counts["reading"],
        "left": counts["left"],
        "not_started": blocks - started,
        "taken_over": counts["taken_over"],
    }
