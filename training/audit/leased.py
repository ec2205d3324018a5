"""Whether a committed microbatch's rows were its peer's to read (the wrong-rows check).

The run's leases (training/swarm/leases.py) give each block of an epoch to one peer at a time, so that the swarm
reads every row once per epoch. A peer that trains on rows it did not lease (another peer's block, a block already
done, rows of its own choosing) can commit honest sketches of them and pass every recomputation; what gives it away
is which rows they are.

A microbatch's rows pass when each lies in one of the blocks its commitment names (the block's row groups in the
plan of that epoch, pipeline/core/blocks.py, which every peer computes from the run's seed) and the accused's own
signed lease entry of that epoch names that block, whatever became of the lease since (it may have run out, or been
taken over, while rows of it were being read). An auditor whose DHT does not answer judges the rows passed: it never
convicts on what it could not read. A peer reading in its own order (its DHT did not answer its leases) commits
nothing (auditor.py).
"""

from __future__ import annotations

from collections.abc import Callable

from pipeline.core.blocks import EpochPlan, split_of
from training.audit.records import MicrobatchCommitment

PLANS_KEPT = 4  # epochs whose plans a check keeps (commitments span a few global steps: one or two epochs)
# (epoch, split)s -> (epoch, block) -> the signing keys whose lease entries name it; None when the DHT did not answer
# in time (training/swarm/leases.py's `lessees`, given by the peer: the audits do not reach into the swarm's room)
ReadLessees = Callable[[set[tuple[int, int]]], dict[tuple[int, int], set[str]] | None]


class LeaseCheck:
    """Tells whether a microbatch's rows were the accused's to read, from the plan of each epoch and the run's
    leases (the splits its blocks are in, read from the DHT at each check: one `get` per split)."""

    def __init__(self, read_lessees: ReadLessees, units: list[int], seed: int) -> None:
        self.read_lessees, self.units, self.seed = read_lessees, units, seed
        self.plans: dict[int, EpochPlan] = {}

    def units_of(self, epoch: int, block: int) -> list[int]:
        """The row groups of a block (none for a block outside its epoch)."""
        if epoch not in self.plans:
            if len(self.plans) == PLANS_KEPT:
                del self.plans[next(iter(self.plans))]  # the oldest: a plan holds a number per row group
            self.plans[epoch] = EpochPlan(self.units, self.seed, epoch)
        plan = self.plans[epoch]
        return plan.units_of(block) if 0 <= block < plan.blocks else []

    def why_not_leased(self, accused: str, microbatch: MicrobatchCommitment) -> str | None:
        """Why the microbatch's rows were not the ACCUSED's (a signing key, `peer_key`) to read, in words; None when
        they were, or when the leases could not be read in time."""
        blocks_of: dict[int, list[tuple[int, int]]] = {}  # row group -> the named blocks that hold it
        for epoch, block in microbatch.blocks:
            for unit in self.units_of(epoch, block):
                blocks_of.setdefault(unit, []).append((epoch, block))
        rows = [(unit, row, blocks_of.get(unit, [])) for unit, row in microbatch.rows]
        for unit, row, candidates in rows:
            if not candidates:
                return f"its row {row} of row group {unit} is in none of the blocks it names"
        leases = self.read_lessees({(epoch, split_of(block)) for *_, candidates in rows for epoch, block in candidates})
        if leases is None:
            return None
        for unit, row, candidates in rows:
            if not any(accused in leases.get((epoch, block), ()) for epoch, block in candidates):
                epoch, block = candidates[0]
                return f"its row {row} of row group {unit} is in block {block} of epoch {epoch}, which it did not lease"
        return None
