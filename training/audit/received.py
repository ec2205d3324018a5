"""A reducer's check: what each sender sent it, against what the sender committed to (the sketch liar).

An audit recomputes a microbatch and compares it with the sketch its peer committed; that says nothing of what the
peer then sent to the reducers. A peer that commits its honest sketches and sends something else passes every audit.
Here the reducers close that gap. hivemind sends a peer's accumulated gradient, sum_i (b_i / b_0) g_i / n over the
n microbatches of sizes b_i since the last reset (its `GradientAverager.accumulate_grads_` and
`load_accumulators_into_averager_`), and a sketch is linear: the sketch of what the peer sent is the same sum of
its committed sketches. Each reducer received one slice of that gradient and summed the sketch's coordinates in it,
region by region (training/swarm/received.py); it compares the regions that lie wholly in its slice with the sums
the commitments give.

Which microbatches a round took, the commitments do not say: the reducer tries every run of consecutive committed
microbatches around the sender's step whose rows add up to the samples the sender claimed, and passes the sender if one
of them matches. The sender's step is the one it gathered for the round, which the members need not share (a peer that
looks for its group before a download gathers the step the download brings, the swarm's, which a reducer still at an
earlier one does not), or the reducer's own if the sender committed nothing near it (`judged_step`). If no run matches,
the sender either claimed more samples than it sent the work of (its sums are those of a run of fewer rows: an
overclaim, which buys it weight in the mean) or sent something else (its sums are no run's); the verdict says which.
Sums that no run of the claimed rows gives and no run at all gives either are not judged (a claim this reducer cannot
follow). It judges a round once the sender has published a later step's commitment.

The sums are judged within RECEIVED_TOLERANCE, not the audits' AUDIT_TOLERANCE: an audit's recomputation differs from
the commitment by a machine's arithmetic (8% at most), a reducer's sums from the committed run by the codec's noise
alone, and an overclaim's from the run of its claimed rows by how much microbatches' gradients differ, which is about
half their length for the sample's microbatches of 16 rows: within AUDIT_TOLERANCE, an overclaimer passed about one
round in two (docs/training.md#checked-work has the figures).

A failed check is a failed verdict like an audit's (records.py), marked `received`: nobody else can recompute it
(only this reducer saw those bytes), so nobody re-checks it, and a conviction still takes two auditors, the reader
among them: two reducers that each saw the liar's pieces, or one of them and an auditor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import NamedTuple

import torch

from training.audit.ledger import Ledger
from training.audit.records import (
    AUDIT_LAG,
    COMMITMENTS_KEPT,
    Commitment,
    CommitmentRecord,
    Verdict,
    claimed_ids,
    unaudited_keys,
)
from training.audit.sketch import SKETCH_SIZE, sketch_distance

# Received sums this far from every committed run of the claimed rows (relative to the run's length) fail the check.
# The codec's noise moved a gradient's sketch by 0.0047 (median) and 0.029 at most (bench.compression: 600
# gradients), and put honest senders' sums 0.0046 (median) and 0.013 at most from their runs in 12 runs of the audit
# swarm test (356 checks); a 2x overclaimer's lay 0.31-1.19 from the nearest run of its claimed rows (24 checks).
RECEIVED_TOLERANCE = 0.1


def committed_runs(commitments: Sequence[Commitment], step: int) -> list[tuple[int, list[float]]]:
    """What a peer that committed `commitments` may have sent in the round of `step`: (rows, sketch) for each run of
    its consecutive microbatches (those committed at steps step - 1 to step + 1, in order). Which microbatches a
    round took is not in the commitments: its accumulator starts again after a download, and a microbatch is
    committed at the step the peer was at when it computed it, which a round that ends meanwhile may leave behind (an
    honest peer that had downloaded the state was once convicted when only the last microbatches of its step were
    tried)."""
    microbatches = [m for c in commitments if abs(c.step - step) <= 1 for m in c.microbatches]
    if not microbatches:
        return []
    rows = torch.tensor([len(microbatch.rows) for microbatch in microbatches], dtype=torch.float64)
    sketches = torch.tensor([microbatch.sketch for microbatch in microbatches], dtype=torch.float64)
    weighted = torch.cat([torch.zeros(1, SKETCH_SIZE, dtype=torch.float64), (rows[:, None] * sketches).cumsum(0)])
    runs = []
    for first in range(len(microbatches)):
        # hivemind's sum_i (b_i / b_0) g_i / n over the runs that start here, one per last microbatch
        counts = torch.arange(1, len(microbatches) - first + 1, dtype=torch.float64)
        sent = (weighted[first + 1 :] - weighted[first]) / rows[first] / counts[:, None]
        runs += zip(rows[first:].cumsum(0).int().tolist(), sent.tolist(), strict=True)
    return runs


def holds_the_round(steps: Sequence[Commitment], step: int) -> bool:
    """Whether a sender's record still holds every microbatch the round of `step` may have taken (those of steps
    step - 1 to step + 1): it does unless it is full (COMMITMENTS_KEPT steps) and its oldest step is later than
    step - 1. A reducer that reads the record late, when the sender has gone on for several steps, may find the
    round's first microbatches dropped; then no run of what is left holds what was sent, and an honest sender would
    fail."""
    return len(steps) < COMMITMENTS_KEPT or min(commitment.step for commitment in steps) <= step - 1


class ReceivedFailure(NamedTuple):
    """A sender whose sums a reducer received fail its check (the evidence of a `received` verdict)."""

    key: str  # the sender's signing key
    peer_id: str
    step: int  # the step its runs were tried around (`judged_step`)
    lineage: str
    committed: list[float]  # the sums of the committed run it is judged against
    received: list[float]
    distance: float  # sketch_distance(committed, received)
    claim: float  # the samples it claimed in the round (its weight)
    rows: int | None  # an overclaim: the rows of the committed run its sums are; None: it sent something else


def judge_sums(
    runs: Sequence[tuple[int, list[float]]], weight: float, received: list[float], regions: set[int]
) -> tuple[list[float], float, int | None] | None:
    """None if the received sums pass: some committed run of `weight` rows gives them. Else the evidence (committed
    sums, distance, rows): an overclaim when they are a run of fewer rows than the claim (rows: that run's); that
    the sender sent something else when they are no run's (rows None, against the nearest run of the claimed rows).
    Received sums that are a run of more rows than claimed (harmless) pass, and so do sums no run of the claimed rows
    gives when they are no run's either (the claim is not one this reducer can follow)."""
    scored = []
    for rows, sketch in runs:
        committed = [value if region in regions else 0.0 for region, value in enumerate(sketch)]
        scored.append((sketch_distance(received, committed), rows, committed))
    by_distance = itemgetter(0)
    # the nearest run of the claimed rows (rows are whole, a weight a float), if any holds them
    at_claim = min((score for score in scored if abs(score[1] - weight) < 0.5), key=by_distance, default=None)
    if at_claim is not None and at_claim[0] <= RECEIVED_TOLERANCE:
        return None
    distance, rows, committed = min(scored, key=by_distance)
    if distance <= RECEIVED_TOLERANCE:
        return (committed, distance, rows) if rows < weight else None
    return None if at_claim is None else (at_claim[2], at_claim[0], None)


def judged_step(steps: Sequence[Commitment], gathered: int | None, own: int) -> int:
    """The step a sender's runs are tried around: the one it gathered for the round, if it committed a microbatch
    within a step of it (an honest sender gathered the step of the microbatches it sends, which a reducer need not
    share), else the reducer's own (a sender may gather any step: one it committed nothing near would escape the
    check)."""
    if gathered is not None and any(abs(c.step - gathered) <= 1 and c.microbatches for c in steps):
        return gathered
    return own


def received_failures(
    round_: Mapping, commitments: Mapping[str, CommitmentRecord]
) -> tuple[list[ReceivedFailure], set[str]]:
    """The senders of one reduced round (training/swarm/received.py's record: the reducer's step, the regions checked,
    sender peer id -> (weight, sums), and sender peer id -> the step it gathered) whose sums fail `judge_sums`
    against the runs of their committed microbatches around the step `judged_step` picks; and the peer ids not
    judged for want of a commitment of a later step (their record may not hold that round's last microbatches yet).
    A sender whose record no longer holds the round's first microbatches (`holds_the_round`) is not judged."""
    keys = {peer_id: key for key, peer_id in claimed_ids(commitments).items()}
    regions = set(round_["regions"])
    failures, unjudged = [], set()
    for peer_id, (weight, sums) in round_["senders"].items():
        key = keys.get(peer_id)
        steps = [] if key is None else commitments[key].steps
        step = judged_step(steps, round_["gathered"].get(peer_id), round_["step"])
        if not any(commitment.step > step for commitment in steps):
            unjudged.add(peer_id)
            continue
        if not holds_the_round(steps, step) or not regions:
            continue
        runs = committed_runs(steps, step)
        if not runs:
            continue
        received = [value if region in regions else 0.0 for region, value in enumerate(sums)]
        evidence = judge_sums(runs, weight, received, regions)
        if evidence is not None:
            lineage = [c.lineage for c in steps if c.step == step] or [steps[-1].lineage]
            committed, distance, rows = evidence
            failures.append(
                ReceivedFailure(key, peer_id, step, lineage[-1], committed, received, distance, weight, rows)
            )
    return failures, unjudged


def failure_line(failure: ReceivedFailure) -> str:
    """What a reducer's console says of a failed check, after the sender's short id."""
    if failure.rows is None:
        return (
            f"sent this reducer something else than it committed at step {failure.step} "
            f"(sketch off by {failure.distance:.3g} of its length)"
        )
    return f"claimed {failure.claim:g} samples at step {failure.step} for a gradient of {failure.rows} committed rows"


@dataclass
class ReducerCheck:
    """The gradient rounds this peer reduced, checked against their senders' commitments once those are read; and
    the senders nobody can audit now (records.py's `unaudited_keys`), whom its reducers count for nothing."""

    # the rounds reduced since the last call (SwarmMember.received_rounds: training/swarm/received.py's sums)
    received_rounds: Callable[[], list[dict]] = list
    leave_out: Callable[[list[str]], None] = lambda peer_ids: None  # SwarmMember.leave_out_unaudited: the averagers
    pending: list[dict] = field(default_factory=list)  # reduced rounds whose senders' commitments are not read yet
    left_out: set[str] = field(default_factory=set)  # the signing keys left out so far

    def collect(self) -> bool:
        """Take the rounds reduced since the last call; whether any round is due a check."""
        self.pending += self.received_rounds()
        return bool(self.pending)

    def check(self, step: int, commitments: dict[str, CommitmentRecord], ledger: Ledger) -> None:
        """Judge each sender of the pending rounds (`received_failures`) into `ledger`; a sender whose record holds
        no later step yet is checked again at the next step, up to AUDIT_LAG steps after the round's."""
        pending, self.pending = self.pending, []
        for round_ in pending:
            failures, unjudged = received_failures(round_, commitments)
            for failure in failures:
                ledger.verdicts.append(Verdict(
                    step=failure.step, accused=failure.key, accused_peer_id=failure.peer_id, microbatch=0,
                    lineage=failure.lineage, distance=failure.distance, passed=False, claimed=failure.committed,
                    recomputed=failure.received, received=True,
                    samples_claimed=None if failure.rows is None else failure.claim, rows_committed=failure.rows,
                ))  # fmt: skip
                ledger.console.print(f"audit: ...{failure.peer_id[-8:]} {failure_line(failure)}: verdict published")
            if unjudged and round_["step"] >= step - AUDIT_LAG:
                self.pending.append({**round_, "senders": {p: round_["senders"][p] for p in unjudged}})
        self.leave_out_unaudited(commitments, ledger)

    def leave_out_unaudited(self, commitments: dict[str, CommitmentRecord], ledger: Ledger) -> None:
        """Tell the averagers whom nobody can audit now, by the peer id only that key names, with a line for each newly
        left out: a peer proven once would otherwise keep a proven peer's weight (training/audit/standing.py)."""
        unaudited = unaudited_keys(commitments) - {ledger.key}
        if unaudited == self.left_out:
            return
        ids = claimed_ids(commitments)
        self.leave_out(sorted(ids[key] for key in unaudited if key in ids))
        for key in sorted(unaudited - self.left_out):
            ledger.console.print(
                f"audit: ...{commitments[key].peer_id[-8:]} commits under lineages no other peer holds: nobody can "
                "audit its work, so this peer's reducers count its gradients for nothing until they can"
            )
        self.left_out = unaudited
