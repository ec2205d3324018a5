"""Leases on an epoch's blocks (pipeline/core/blocks.py), kept in the run's DHT: who reads which block, how far it
got, and which blocks are done, so that the swarm reads every row once per epoch.

Where. A split of BLOCKS_PER_SPLIT blocks is one DHT key, `{run_id}_blocks_e{epoch}_s{split}`; each peer writes one
entry under it, its subkey being its public key (signed: nobody else can write it), holding every block of the
split it took this epoch: `{block: [claimed, until, offset, done]}` (DHT times; `offset`: rows of the block handed
out). One read of a split tells a peer the state of 64 blocks.

Who holds a block, the same answer on every peer that read the same entries (`block_state`):

- done, when an entry says so;
- else the live leases (`until` not past): the holder is the earliest `claimed`, then the smallest subkey;
- else nobody: free, from the furthest `offset` an entry recorded (its holder died or left: the next one goes on).

Two peers that take one block at the same moment both read it until the next renewal, where the later one sees
the earlier lease and gives the block up: a few batches read twice, never rows missed.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from hivemind.utils import get_dht_time

from pipeline.core.blocks import BLOCKS_PER_SPLIT, Assignment, EpochPlan

LEASE = 120.0  # seconds a lease lives unless renewed; its holder renews it (and records its offset) every quarter
RECHECK = 2.0  # seconds before a peer with nothing to take reads a split whose blocks others hold again
TAKE_ATTEMPTS = 3  # blocks a peer tries in one split before the next one, when others take them at the same moment
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
    holder: str | None  # the holding peer's key (see `entry_key`); None: done, or free
    offset: int  # rows handed out so far
    done: bool


def entry_key(subkey: bytes) -> str:
    """A short name of the peer that wrote an entry (its subkey: the public key that signed it)."""
    return hashlib.sha256(bytes(subkey)).hexdigest()[:16]


def block_state(leases: dict[str, Lease], now: float, lease: float = LEASE) -> BlockState:
    """What the entries of every peer (peer key -> its lease on one block) say about that block at NOW (leases of
    LEASE seconds)."""
    furthest = max((entry.offset for entry in leases.values()), default=0)
    if any(entry.done for entry in leases.values()):
        return BlockState(None, furthest, True)
    # A lease longer than a renewal can give is none: a peer cannot hold a block for good by asking for it.
    live = sorted((entry.claimed, peer) for peer, entry in leases.items() if now < entry.until <= now + 2 * lease)
    return BlockState(live[0][1] if live else None, furthest, False)


def split_of(block: int) -> int:
    return block // BLOCKS_PER_SPLIT


def split_key(run_id: str, epoch: int, split: int) -> str:
    return f"{run_id}_blocks_e{epoch}_s{split}"


def parse_split(found: object) -> dict[int, dict[str, Lease]]:
    """A `dht.get` of a split: block -> {peer key: lease}, malformed entries left out."""
    blocks: dict[int, dict[str, Lease]] = {}
    entries = getattr(found, "value", None)
    if not isinstance(entries, dict):
        return blocks
    for subkey, entry in entries.items():
        value = getattr(entry, "value", None)
        if not isinstance(value, dict):
            continue
        for block, raw in value.items():
            lease = Lease.from_value(raw)
            if lease is not None and isinstance(block, str) and block.isdigit():
                blocks.setdefault(int(block), {})[entry_key(subkey)] = lease
    return blocks


class LeaseBook:
    """This peer's side: take a free block, renew it with its offset, mark it done, give it back (see above)."""

    def __init__(self, dht, run_id: str, public_key: bytes, lease: float = LEASE) -> None:
        self.dht, self.run_id, self.public_key, self.lease = dht, run_id, public_key, lease
        self.me = entry_key(public_key)
        self.own: dict[tuple[int, int], dict[int, Lease]] = {}  # (epoch, split) -> this peer's leases there
        # (epoch, split) -> when to look at it again (never: every block done), and whether it is settled: every
        # block done or this peer's (which it finishes without anyone's help)
        self.full_splits: dict[tuple[int, int], tuple[float, bool]] = {}
        self.requests = 0  # DHT gets and stores, for the bench's count per block

    def read(self, epoch: int, split: int) -> dict[int, dict[str, Lease]]:
        self.requests += 1
        found = self.dht.get(split_key(self.run_id, epoch, split), latest=True)
        blocks = parse_split(found)
        for block, lease in self.own.get((epoch, split), {}).items():  # what this peer knows of its own best
            blocks.setdefault(block, {})[self.me] = lease
        return blocks

    def write(self, epoch: int, split: int) -> None:
        self.requests += 1
        value = {str(block): lease.as_value() for block, lease in self.own[(epoch, split)].items()}
        key = split_key(self.run_id, epoch, split)
        self.dht.store(key, subkey=self.public_key, value=value, expiration_time=get_dht_time() + REMEMBER)

    def take(self, plan: EpochPlan) -> tuple[int, int] | None:
        """A free block of PLAN's epoch, leased to this peer: (block, offset to start at); None when every block is
        done or held by another peer. Each peer tries the splits, and the blocks of a split, in an order of its own,
        so that peers starting together rarely ask for the same block; when two do, the check after the write
        leaves it to one of them."""
        splits = -(-plan.blocks // BLOCKS_PER_SPLIT)
        mine = np.random.default_rng(int(self.me, 16))
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
        blocks = self.read(epoch, split)
        now = get_dht_time()
        states = [(block, block_state(blocks.get(block, {}), now, self.lease)) for block in candidates]
        for block, state in states:
            if not state.done and state.holder is None:
                self.own.setdefault((epoch, split), {})[block] = Lease(now, now + self.lease, state.offset)
                self.write(epoch, split)
                return block, state.offset
        all_done = all(state.done for _, state in states)
        settled = all(state.done or state.holder == self.me for _, state in states)
        self.full_splits[(epoch, split)] = (math.inf if all_done else now + min(self.lease / 4, RECHECK), settled)
        return None

    def confirm(self, epoch: int, block: int, offset: int) -> bool:
        """Whether this peer holds BLOCK after its write (another may have taken it at the same moment, earlier):
        if not, its lease is withdrawn."""
        split = split_of(block)
        if block_state(self.read(epoch, split).get(block, {}), get_dht_time(), self.lease).holder == self.me:
            return True
        self.own[(epoch, split)][block].until = get_dht_time()
        self.write(epoch, split)
        return False

    def epoch_settled(self, plan: EpochPlan) -> bool:
        """Whether every block of PLAN's epoch was seen done or held by this peer (as of its last reads): nothing
        there is left for it to take or to wait for."""
        splits = -(-plan.blocks // BLOCKS_PER_SPLIT)
        return all(self.full_splits.get((plan.epoch, split), (0.0, False))[1] for split in range(splits))

    def renew(self, epoch: int, block: int, offset: int) -> bool:
        """Record OFFSET and extend the lease; False when another peer holds the block now (it took it at the same
        moment, earlier by its clock; or this peer's lease expired and it was taken over): give it up."""
        split = split_of(block)
        now = get_dht_time()
        state = block_state(self.read(epoch, split).get(block, {}), now, self.lease)
        lease = self.own[(epoch, split)][block]
        if state.holder not in (None, self.me) or state.done:
            lease.until = now  # no longer this peer's
            return False
        lease.until, lease.offset = now + self.lease, max(lease.offset, offset)
        self.write(epoch, split)
        return True

    def finish(self, epoch: int, block: int, rows: int) -> None:
        """Every row of BLOCK was handed out."""
        split = split_of(block)
        lease = self.own[(epoch, split)][block]
        lease.offset, lease.done, lease.until = rows, True, get_dht_time()
        self.write(epoch, split)

    def give_back(self, epoch: int, block: int, offset: int) -> None:
        """This peer stops reading BLOCK at OFFSET (it leaves): the next peer takes it from there."""
        split = split_of(block)
        lease = self.own[(epoch, split)][block]
        lease.offset, lease.until = max(lease.offset, offset), get_dht_time()
        self.write(epoch, split)


class LeaseSource:
    """A peer stream's blocks (pipeline/core/blocks.py's BlockSource) from the run's leases: the oldest epoch with a
    free block first; the next epoch while the last blocks of this one are being read by others (never further)."""

    def __init__(self, book: LeaseBook, units: list[int], seed: int, epochs: int | None = None) -> None:
        self.book, self.units, self.seed, self.epochs = book, units, seed, epochs
        self.epoch = 0  # the oldest epoch that may have blocks to read
        self.plans: dict[int, EpochPlan] = {}
        self.held: dict[tuple[int, int], int] = {}  # this peer's unfinished blocks -> rows of them consumed
        self.renewed = time.monotonic()
        self.lost: set[tuple[int, int]] = set()  # blocks another peer holds now (this one kept none of its rows)
        self.finished: set[tuple[int, int]] = set()  # blocks this peer handed out whole
        self.lock = threading.Lock()

    def plan(self, epoch: int) -> EpochPlan:
        if epoch not in self.plans:
            self.plans[epoch] = EpochPlan(self.units, self.seed, epoch)
        return self.plans[epoch]

    def take(self, wait: bool = True) -> Assignment | None:
        while not self.ended():
            with self.lock:  # the stream's feeding thread takes, its main thread reports consumed batches
                found = self.take_now()
            if found is not None or not wait:
                return found
            time.sleep(1.0)  # every block is held: one will be done, or its lease will run out
        return None

    def ended(self) -> bool:
        return self.epochs is not None and self.epoch >= self.epochs

    def take_now(self) -> Assignment | None:
        """A free block of this epoch or the next, if there is one now."""
        for epoch in (self.epoch, self.epoch + 1):
            if self.epochs is not None and epoch >= self.epochs:
                break
            found = self.book.take(self.plan(epoch))
            if found is not None:
                self.held[(epoch, found[0])] = found[1]
                return Assignment(epoch, *found)
            if epoch == self.epoch and self.book.epoch_settled(self.plan(epoch)):
                self.plans.pop(epoch, None)
                self.epoch += 1
                return self.take_now()
        return None

    def consumed(self, state: dict) -> None:
        """Blocks finished, and the offset of the one in progress; renews this peer's leases when it is time."""
        with self.lock:
            for epoch, block, rows in state["finished"]:
                if self.held.pop((epoch, block), None) is not None:
                    self.book.finish(epoch, block, rows)
                    self.finished.add((epoch, block))
            if state["current"] and tuple(state["current"][:2]) not in self.finished:
                epoch, block, offset = state["current"]
                self.held[(epoch, block)] = offset
            if time.monotonic() - self.renewed >= self.book.lease / 4:
                self.renew()

    def renew(self) -> None:
        for (epoch, block), offset in list(self.held.items()):
            if not self.book.renew(epoch, block, offset):
                self.lost.add((epoch, block))
                del self.held[(epoch, block)]
        self.renewed = time.monotonic()

    def close(self) -> None:
        with self.lock:
            for (epoch, block), offset in self.held.items():
                self.book.give_back(epoch, block, offset)
            self.held.clear()
