"""What one refresh of the monitor makes of the run's metrics records: the swarm's figures right now.

Every trainer publishes a signed `PeerMetrics` record after each global step. A record that is recent and
not marked finished belongs to an active peer; the others stay on the leaderboard (training/monitor/history.py)
but no longer count as training. A record says what its peer claims: the figures bound each claim as averaging
does (`bounded_claims`), and leave out the peers the audits convicted (training/monitor/verified.py), which stay
on the leaderboard, marked.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass

from training.metrics import PeerRecord
from training.swarm.aggregation import bounded_claims


@dataclass(frozen=True)
class SwarmSummary:
    global_step: int
    loss: float | None  # mean of the active peers' last step losses, weighted by their samples (bounded claims)
    samples_per_second: float  # the swarm's: the sum of the active peers', each bounded as averaging bounds it
    active_peers: int
    distinct_hashes: int  # parameter hashes among recent peers at the global step (1: they agree)
    dropped: int  # contributions the global step's reducers dropped as poisoned, over all recent peers at it
    clipped: int  # contributions their CenteredClip clipped
    claims_capped: tuple[str, ...] = ()  # display names of active peers that claim more than the bound allows


def is_recent(record: PeerRecord, now: float, active_window: float) -> bool:
    return now - record.published_at <= active_window


def global_step(records: list[PeerRecord]) -> int:
    """The step at least half of the peers have reached: peers in step agree on it, and a record that
    claims a step far ahead of the others does not move it."""
    steps = sorted((record.metrics.step for record in records), reverse=True)
    return steps[(len(steps) - 1) // 2] if steps else 0


def summarize(
    records: list[PeerRecord], now: float, active_window: float, convicted: Collection[str] = ()
) -> SwarmSummary:
    """The swarm's figures from the recent records, but those of the `convicted` signing keys."""
    recent = [r for r in records if is_recent(r, now, active_window) and r.key not in convicted]
    active = [record for record in recent if not record.metrics.finished]
    step = global_step(active or recent)  # a run whose peers all finished shows where they ended
    # A peer publishes right after its step: its loss is that of the step before the one it is at.
    losses = [r.metrics for r in active if r.metrics.step >= step - 1 and r.metrics.samples_accumulated > 0]
    weights = bounded_claims([m.samples_accumulated for m in losses])  # a million samples claimed set no loss alone
    samples = sum(weights)
    at_step = [r.metrics for r in recent if r.metrics.step == step]
    hashes = Counter(m.parameters_hash for m in at_step if m.parameters_hash)
    claimed = [r.metrics.samples_per_second for r in active]
    rates = bounded_claims(claimed)
    return SwarmSummary(
        global_step=step,
        loss=sum(m.loss * weight for m, weight in zip(losses, weights, strict=True)) / samples if samples else None,
        samples_per_second=sum(rates),
        active_peers=len(active),
        distinct_hashes=len(hashes),
        dropped=sum(m.dropped for m in at_step),
        clipped=sum(m.clipped for m in at_step),
        claims_capped=tuple(r.metrics.display_name for r, c, b in zip(active, claimed, rates, strict=True) if b < c),
    )


def outliers_sent(records: list[PeerRecord]) -> dict[str, int]:
    """Peer key -> how many of that peer's contributions the others (its reducers) dropped or clipped.

    A record's own `dropped`/`clipped` tell what its peer did to the others' contributions; what it sent is known
    only from what its reducers' records say of its peer id. A record without a peer id cannot be named: 0.
    """
    reported: Counter[str] = Counter()
    for record in records:
        reported.update(record.metrics.outliers)
    return {r.key: reported[r.metrics.peer_id] if r.metrics.peer_id else 0 for r in records}
