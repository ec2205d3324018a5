"""The swarm's holds for joining peers: every peer keeps its progress tracker from ending a global step before the
latest `joining_until` that any peer of the run published (the protocol is in training/swarm/optimizer.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

import hivemind
from hivemind.utils import get_dht_time

from training.config import MAX_JOIN_HOLD
from training.metrics import PeerMetrics, metrics_key, unrevoked_records
from training.swarm.optimizer import SwarmProgressTracker

REFRESH = 0.5  # seconds between reads of the run's metrics records


class JoinHolds:
    """Keeps a tracker's `hold_until` at the latest `joining_until` that any peer of the run has published, and the
    records of its latest read in `records`."""

    def __init__(
        self, dht: hivemind.DHT, run_id: str, tracker: SwarmProgressTracker, revoked: Callable[[], Collection[str]]
    ) -> None:
        self.dht, self.key, self.tracker, self.revoked = dht, metrics_key(run_id), tracker, revoked
        self.own_hold = 0.0  # this peer's own joining_until, applied at once rather than after a read
        self.pending = None  # the DHT read in flight
        self.next_read = 0.0
        self.records: list[PeerMetrics] = []
        self.published_at: dict[str, float] = {}  # peer id -> the DHT time its record in `records` was published

    def hold(self, until: float) -> None:
        """This peer's own hold (DHT time), in effect at once; the next read adds the others'."""
        self.own_hold = self.tracker.hold_until = until

    def refresh(self) -> None:
        """Apply a finished read and start the next one when it is time; never waits for the DHT."""
        if self.pending is not None and self.pending.done():
            try:
                found = unrevoked_records(self.pending.result(), self.revoked())
            except Exception:  # a failed read holds nothing; the next one comes in REFRESH seconds
                found = []
            records = [record.metrics for record in found]
            horizon = get_dht_time() + MAX_JOIN_HOLD  # a record asking for more is broken or hostile: ignored
            latest = max((r.joining_until for r in records if r.joining_until <= horizon), default=0.0)
            self.tracker.hold_until = max(latest, self.own_hold)
            self.records, self.pending = records, None
            self.published_at = {record.metrics.peer_id: record.published_at for record in found}
        if self.pending is None and time.monotonic() >= self.next_read:
            self.pending = self.dht.get(self.key, latest=True, return_future=True)
            self.next_read = time.monotonic() + REFRESH
