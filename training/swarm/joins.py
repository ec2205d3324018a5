"""The swarm's holds for joining peers: every peer keeps its progress tracker from ending a global step before the
latest `joining_until` that any peer of the run published.

Letting newcomers in. A newcomer has to download the state and compute a batch before it can take part in
a round; when the swarm's global step is shorter than that, it arrives after every round and chases the
swarm from download to download. So the swarm holds a step for it:

1. the newcomer publishes `joining_until` (its metrics record: hold until at most now + `join_timeout`),
   waits until the others can have read it (`settle_time`), then downloads the state: the state of the step they
   now hold;
2. every peer reads the run's records (`JoinHolds.refresh`, a DHT read in flight at a time, never blocking
   the training loop, every `read_period`) and does not end the global step before the latest `joining_until`; it
   goes on computing batches meanwhile, so the held step simply gathers more samples;
3. with its first batch computed, the newcomer publishes a release time a little ahead (`settle_time`: long
   enough for everyone to read it), so that all peers, the newcomer included, end the step at the same
   moment and meet in the same matchmaking, and the newcomer's gradients are in the round.

A newcomer that never arrives holds the swarm for `join_timeout` at most; no peer holds longer than
`MAX_JOIN_HOLD` for a record, whatever it asks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

import hivemind
from hivemind.utils import ValueWithExpiration, get_dht_time

from training.config import MAX_JOIN_HOLD
from training.metrics import READ_BEAM, PeerMetrics, metrics_key, read_latest, unrevoked_records

REFRESH = 0.5  # seconds between reads of the run's metrics records, in a run of up to 8 peers
# What a peer spends on those reads, at most, in a larger run (1.3 Mbit/s, 6% of a 20 Mbit/s home link): read every
# REFRESH, each of N peers would download N records from each of the key's holders it visits twice a second.
READ_BUDGET = 160_000  # bytes per second: a read every REFRESH up to 8 peers
METRICS_ENTRY_BYTES = 2_000  # one record as a read returns it: value, subkey, signature (`python -m bench.records`)
SETTLE_MARGIN = 1.5  # seconds for a record just published to reach the key's replicas, on top of a read period


def copies_per_read(records: int) -> int:
    """Copies of each record a read of a key holding this many downloads: one from each node it visits (READ_BEAM of
    them, every one a holder: a node that read the key caches it), never its own."""
    return min(max(records - 1, 1), READ_BEAM)


def read_period(records: int) -> float:
    """Seconds between a peer's reads of a run's metrics key that holds this many records: REFRESH, or longer in a
    large run, so that the reads stay within READ_BUDGET (2.5 s at 40 peers, 62.5 s at 1,000)."""
    return max(REFRESH, records * copies_per_read(records) * METRICS_ENTRY_BYTES / READ_BUDGET)


def settle_time(records: int) -> float:
    """Seconds until every peer of such a run has read a record published now: a newcomer waits that long after it
    announces its hold, and releases the step that far ahead (2 s in a run of up to 40 peers)."""
    return read_period(records) + SETTLE_MARGIN


class JoinHolds:
    """Keeps the global step held (`hold_step_until`: `SwarmMember`'s) until the latest `joining_until` that any peer
    of the run has published, and the records of its latest read in `records`."""

    def __init__(
        self,
        dht: hivemind.DHT,
        run_id: str,
        hold_step_until: Callable[[float], None],
        revoked: Callable[[], Collection[str]],
        convicted: Collection[str] = frozenset(),
    ) -> None:
        self.dht, self.key, self.hold_step_until, self.revoked = dht, metrics_key(run_id), hold_step_until, revoked
        self.convicted = convicted  # the keys of peers this peer's audits convicted (filled as they do): ignored
        self.own_hold = 0.0  # this peer's own joining_until, applied at once rather than after a read
        self.pending = None  # the DHT read in flight
        self.next_read = 0.0
        self.records: list[PeerMetrics] = []
        self.published_at: dict[str, float] = {}  # peer id -> the DHT time its record in `records` was published

    def hold(self, until: float) -> None:
        """This peer's own hold (DHT time), in effect at once; the next read adds the others'."""
        self.own_hold = until
        self.hold_step_until(until)

    def refresh(self) -> None:
        """Apply a finished read and start the next one when it is time; never waits for the DHT."""
        if self.pending is not None and self.pending.done():
            try:
                found = self.pending.result()
            except Exception:  # a failed read holds nothing; the next one comes a read period later
                found = None
            self.pending = None
            self.apply(found)
        if self.pending is None and time.monotonic() >= self.next_read:
            self.pending = read_latest(self.dht, self.key, return_future=True)
            self.next_read = time.monotonic() + read_period(len(self.records))

    def read_now(self) -> list[PeerMetrics]:
        """Read the records now, waiting for the DHT (for moments outside the training loop), and apply them: a
        newcomer's first waits (`settle_time`) then count the run's peers before its first background read."""
        self.apply(read_latest(self.dht, self.key))
        return self.records

    def apply(self, found: ValueWithExpiration | None) -> None:
        """Take in a read of the run's records: who is there, and the latest hold any of them asks for. A convicted
        peer's record counts for nothing: it holds no step, is no lineage, and no finished peer waits for it."""
        records = [r for r in unrevoked_records(found, self.revoked()) if r.key not in self.convicted]
        horizon = get_dht_time() + MAX_JOIN_HOLD  # a record asking for more is broken or hostile: ignored
        latest = max((r.metrics.joining_until for r in records if r.metrics.joining_until <= horizon), default=0.0)
        self.hold_step_until(max(latest, self.own_hold))
        self.records = [record.metrics for record in records]
        self.published_at = {record.metrics.peer_id: record.published_at for record in records}
