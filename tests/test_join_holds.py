"""How often a peer reads the run's metrics records (training/swarm/joins.py): twice a second in a run of up to 8
peers, less often in a larger one, so that the copies each peer downloads stay within READ_BUDGET instead of growing
with the run (docs/scale.md); a newcomer's waits grow with the read period."""

from __future__ import annotations

from concurrent.futures import Future
from itertools import pairwise

import pytest
from hivemind.utils import ValueWithExpiration, get_dht_time

from tests.support.dht_copies import copies_received, hivemind_read
from training.metrics import METRICS_EXPIRATION, READ_BEAM, PeerMetrics, metrics_key, peer_key, read_latest
from training.swarm import joins
from training.swarm.joins import READ_BUDGET, JoinHolds, read_period, settle_time


def test_the_read_period_keeps_a_peers_reads_within_the_budget():
    assert read_period(0) == read_period(8) == 0.5
    assert read_period(32) == pytest.approx(2.0) and settle_time(32) == pytest.approx(3.5)
    assert read_period(100) == pytest.approx(6.25) and read_period(1000) == pytest.approx(62.5)
    for peers in (9, 100, 1000, 10_000):  # every copy a read downloads: one from each of the READ_BEAM nodes it visits
        downloaded = peers * READ_BEAM * joins.METRICS_ENTRY_BYTES
        assert downloaded / read_period(peers) == pytest.approx(READ_BUDGET)
    assert settle_time(1000) == pytest.approx(64.0)


class MetricsDHT:
    """A run's metrics key holding `peers` records, one of them asking for a hold; notes the times it is read."""

    def __init__(self, peers: int, clock: list[float], hold_until: float) -> None:
        expiration = get_dht_time() + METRICS_EXPIRATION
        self.found = ValueWithExpiration(
            {
                f"peer-{i}".encode(): ValueWithExpiration(record(i, hold_until if i == 0 else 0.0).dict(), expiration)
                for i in range(peers)
            },
            expiration,
        )
        self.clock, self.reads = clock, []

    def get(self, key: str, latest: bool, beam_size: int, return_future: bool = False) -> Future | ValueWithExpiration:
        assert key == metrics_key("run") and latest and beam_size == READ_BEAM
        self.reads.append(self.clock[0])
        if not return_future:
            return self.found
        found = Future()
        found.set_result(self.found)
        return found


def record(i: int, joining_until: float) -> PeerMetrics:
    return PeerMetrics(
        step=3, samples_per_second=1.0, samples_accumulated=8, total_samples=80, loss=1.0, mini_steps=1,
        display_name=f"peer-{i}", peer_id=f"peer-{i}", joining_until=joining_until,
    )  # fmt: skip


@pytest.mark.parametrize("peers", [4, 200])
def test_a_peer_reads_the_records_once_a_read_period_and_holds_for_a_newcomer(monkeypatch, peers):
    clock = [100.0]
    monkeypatch.setattr(joins.time, "monotonic", lambda: clock[0])
    hold_until = get_dht_time() + 30.0
    dht, held = MetricsDHT(peers, clock, hold_until), []
    holds = JoinHolds(dht, "run", held.append, revoked=lambda: ())
    while clock[0] < 130.0:  # the training loop asks between batches, every 0.1 s
        holds.refresh()
        clock[0] += 0.1
    periods = [later - earlier for earlier, later in pairwise(dht.reads[1:])]  # the first read sees nobody
    assert periods and min(periods) == pytest.approx(read_period(peers), abs=0.11)
    assert len(holds.records) == peers and held[-1] == hold_until  # the newcomer's hold, in effect


def test_a_newcomers_first_read_sizes_its_waits_before_any_background_read(monkeypatch):
    """A newcomer reads the records once, waiting (`read_now`: its settings checked against the others'), then
    announces its hold: its wait is the large run's, not the 2 s of a peer that has read nobody yet."""
    clock = [100.0]
    monkeypatch.setattr(joins.time, "monotonic", lambda: clock[0])
    held = []
    holds = JoinHolds(MetricsDHT(1000, clock, hold_until=0.0), "run", held.append, revoked=lambda: ())
    assert len(holds.read_now()) == 1000 and held == [0.0]
    assert settle_time(len(holds.records)) == pytest.approx(64.0)
    holds.refresh()
    assert holds.next_read == pytest.approx(100.0 + 62.5)  # and the background reads go at the large run's period


def test_a_convicted_peers_record_counts_for_nothing(monkeypatch):
    """The keys this peer's audits convicted (a set they fill as they go): such a peer's record is no longer among
    the run's, and its hold holds nothing (an attacker could otherwise hold the swarm's step for MAX_JOIN_HOLD, and
    keep the finished peers waiting for it)."""
    clock, held, convicted = [100.0], [], set()
    monkeypatch.setattr(joins.time, "monotonic", lambda: clock[0])
    hold_until = get_dht_time() + 30.0
    holds = JoinHolds(MetricsDHT(3, clock, hold_until), "run", held.append, revoked=lambda: (), convicted=convicted)
    assert len(holds.read_now()) == 3 and held == [hold_until]
    convicted.add(peer_key(b"peer-0"))  # the one asking for the hold
    assert [m.peer_id for m in holds.read_now()] == ["peer-1", "peer-2"] and held[-1] == 0.0


def test_a_read_of_the_runs_keys_downloads_one_copy_from_each_node_of_its_beam():
    """On 8 real DHT nodes that each stored a record and read the key (so each caches it): a read of ttt's finds
    every record in READ_BEAM copies, where hivemind's default beam downloads one from each of the other 7 nodes."""
    assert copies_received(8, read_latest) <= READ_BEAM
    assert copies_received(8, hivemind_read) == 7
