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
microbatches around the round's step whose rows add up to the samples the sender claimed, and passes the sender if
one of them matches. It judges a round once the sender has published a later step's commitment. A claim that no run
holds is not judged here. The codec's noise is 0.5% of a gradient (bench/compression.py): an honest sender's sums
land within AUDIT_TOLERANCE with a wide margin.

A failed check is a failed verdict like an audit's (records.py), marked `received`: nobody else can recompute it
(only this reducer saw those bytes), so nobody re-checks it, and a conviction still takes two auditors, the reader
among them: two reducers that each saw the liar's pieces, or one of them and an auditor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from training.audit.records import COMMITMENTS_KEPT, Commitment, CommitmentRecord, claimed_ids
from training.audit.sketch import AUDIT_TOLERANCE, sketch_distance


def sent_sketches(commitments: Sequence[Commitment], step: int, weight: float) -> list[list[float]]:
    """The sketches of what a peer that committed `commitments` may have sent in the round of `step` with `weight`
    samples: one for each run of its consecutive microbatches (those committed at steps step - 1 to step + 1, in
    order) that holds `weight` rows. Which microbatches a round took is not in the commitments: its accumulator
    starts again after a download, and a microbatch is committed at the step the peer was at when it computed it,
    which a round that ends meanwhile may leave behind (an honest peer that had downloaded the state was once
    convicted when only the last microbatches of its step were tried)."""
    microbatches = [m for c in commitments if abs(c.step - step) <= 1 for m in c.microbatches]
    rows = [len(microbatch.rows) for microbatch in microbatches]
    sketches = torch.tensor([microbatch.sketch for microbatch in microbatches], dtype=torch.float64)
    found = []
    for first in range(len(microbatches)):
        total = 0
        for last in range(first, len(microbatches)):
            total += rows[last]
            if abs(total - weight) < 0.5:  # hivemind's sum_i (b_i / b_0) g_i / n over the run
                scales = torch.tensor(rows[first : last + 1], dtype=torch.float64) / rows[first]
                found.append((scales @ sketches[first : last + 1] / (last + 1 - first)).tolist())
            if total > weight:
                break
    return found


def holds_the_round(steps: Sequence[Commitment], step: int) -> bool:
    """Whether a sender's record still holds every microbatch the round of `step` may have taken (those of steps
    step - 1 to step + 1): it does unless it is full (COMMITMENTS_KEPT steps) and its oldest step is later than
    step - 1. A reducer that reads the record late, when the sender has gone on for several steps, may find the
    round's first microbatches dropped; then no run of what is left holds what was sent, and an honest sender would
    fail."""
    return len(steps) < COMMITMENTS_KEPT or min(commitment.step for commitment in steps) <= step - 1


def received_failures(
    round_: Mapping, commitments: Mapping[str, CommitmentRecord]
) -> tuple[list[tuple[str, str, str, list[float], list[float], float]], set[str]]:
    """The senders of one reduced round (training/swarm/received.py's record: its step, the regions checked, and
    sender peer id -> (weight, sums)) whose sums are what none of the runs of their committed microbatches gives:
    (key, peer id, lineage, committed sums (the nearest run's), received sums, distance) each; and the peer ids not
    judged for want of a commitment of a later step (their record may not hold that round's last microbatches yet).
    A sender whose record no longer holds the round's first microbatches (`holds_the_round`) is not judged."""
    keys = {peer_id: key for key, peer_id in claimed_ids(commitments).items()}
    regions = set(round_["regions"])
    failures, unjudged = [], set()
    for peer_id, (weight, sums) in round_["senders"].items():
        key = keys.get(peer_id)
        steps = [] if key is None else commitments[key].steps
        if not any(commitment.step > round_["step"] for commitment in steps):
            unjudged.add(peer_id)
            continue
        if not holds_the_round(steps, round_["step"]):
            continue
        received = [value if region in regions else 0.0 for region, value in enumerate(sums)]
        candidates = [
            [value if region in regions else 0.0 for region, value in enumerate(sketch)]
            for sketch in sent_sketches(steps, round_["step"], weight)
        ]
        if not candidates or not regions:
            continue
        distance, committed = min((sketch_distance(received, c), c) for c in candidates)
        if distance > AUDIT_TOLERANCE:
            lineage = [c.lineage for c in steps if c.step == round_["step"]] or [steps[-1].lineage]
            failures.append((key, peer_id, lineage[-1], committed, received, distance))
    return failures, unjudged
