"""The swarm's reading of its data, as the monitor shows it: the coverage of the oldest data epoch that live peers
still read (training/swarm/leases.py), read from the run's leases every COVERAGE_REFRESH seconds."""

from __future__ import annotations

import time

from training.metrics import PeerRecord
from training.monitor.aggregate import is_recent
from training.swarm.leases import epoch_coverage

COVERAGE_REFRESH = 10.0  # seconds: an epoch's leases are one DHT read per 64 blocks; an epoch lasts hours


class CoverageWatch:
    def __init__(self, dht, run_id: str, active_window: float) -> None:
        self.dht, self.run_id, self.active_window = dht, run_id, active_window
        self.coverage: dict | None = None  # the last one read (`epoch_coverage`); None before any peer read blocks
        self.read_at = -float("inf")

    def refresh(self, records: list[PeerRecord], now: float) -> dict | None:
        """The coverage, read again when it is COVERAGE_REFRESH old."""
        if time.monotonic() - self.read_at < COVERAGE_REFRESH:
            return self.coverage
        live = [record.metrics for record in records if is_recent(record, now, self.active_window)]
        reading = [metrics for metrics in live if metrics.epoch_blocks and not metrics.finished]
        if reading:
            epoch = min(metrics.data_epoch for metrics in reading)
            blocks = max(metrics.epoch_blocks for metrics in reading)
            self.coverage = epoch_coverage(self.dht, self.run_id, epoch, blocks)
        self.read_at = time.monotonic()
        return self.coverage
