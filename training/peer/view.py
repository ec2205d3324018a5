"""A peer's view of its run: the other peers' records, read in the background, and what keeps that view alive.

Every peer publishes a signed metrics record (training/metrics.py). A peer reads them all every half second (less
often in a run of over 8 peers: training/swarm/joins.py's `read_period`) without ever waiting for the DHT
(`JoinHolds`, which also holds this peer's global step for the joining peers); the loop, the rounds and the report
ask this view who else is training and where. Between batches, `tick()` also renews the access token and pings the
initial peers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence

from rich.console import Console

from training.auth.guard import RunAccess
from training.config import MAX_JOIN_HOLD, PROTOCOL, AgreedValue, disagreement, ttt_version
from training.metrics import PeerMetrics
from training.peer.setup import TrainError
from training.swarm.dht import dht_time, peer_id_of, ping
from training.swarm.joins import JoinHolds, read_period, settle_time
from training.swarm.member import SwarmMember

# A peer frozen for a few seconds (a laptop's sleep, a swapping machine) and the peers it knew drop each other from
# their DHT tables; two peers then no longer read each other's records, and each trains alone for good (seen with two
# peers, one frozen 12 s). Pinging the initial peers every so often puts them back.
REJOIN_EVERY = 10.0  # seconds between pings of --initial-peers


class RunView:
    """The run's records as this peer last read them; `member.step` says where this peer is."""

    def __init__(
        self,
        dht,
        run_id: str,
        initial_peers: Sequence[str],
        member: SwarmMember,
        access: RunAccess | None,
        convicted: Collection[str] = frozenset(),
    ) -> None:
        self.dht, self.run_id, self.member, self.access = dht, run_id, member, access
        self.peer_id = dht.peer_id.to_base58()
        self.joins = JoinHolds(dht, run_id, member.hold_step_until, self.revoked, convicted)
        self.initial_peer_ids = [peer_id_of(address) for address in initial_peers]
        self.next_rejoin = time.monotonic() + REJOIN_EVERY

    def revoked(self) -> Collection[str]:
        """The users the organiser removed from this run (none in an open run)."""
        return self.access.state.revocations().revoked if self.access else ()

    def tick(self) -> None:
        """What the training loop does between batches besides training: read the run's records, renew the token,
        greet the initial peers again."""
        self.joins.refresh()
        if self.access:
            self.access.tick()
        if self.initial_peer_ids and time.monotonic() >= self.next_rejoin:
            self.next_rejoin = time.monotonic() + REJOIN_EVERY
            ping(self.dht, self.initial_peer_ids, wait=False)

    def wait_for_peers(
        self,
        wanted: int,
        agreed: Mapping[str, AgreedValue],
        console: Console,
        stopping: Callable[[], bool],
        keep_record: Callable[[], object],
    ) -> None:
        """--wait-for-peers N: the run's first peers start together instead of the first one training alone; this
        peer's record is kept alive meanwhile (`keep_record`), however long the others take to come."""
        if wanted <= 1:
            return
        console.print(f"waiting until {wanted} peers of run {self.run_id!r} are here (Ctrl-C to leave)")
        while not stopping():
            records = self.read_now()
            check_same_settings(records, agreed, self.run_id, self.peer_id)
            present = sum(not m.finished for m in records)
            if present >= wanted:
                console.print(f"{present} peers are here: training")
                return
            keep_record()
            time.sleep(1.0)

    def read_now(self) -> list[PeerMetrics]:
        """Every live peer's record, read now (blocking): for moments outside the loop."""
        if self.access:
            self.access.tick()
        return self.joins.read_now()

    @property
    def records(self) -> list[PeerMetrics]:
        """Every peer's record, this one's too, as of the last background read."""
        return self.joins.records

    def others(self, finished_too: bool = False) -> list[PeerMetrics]:
        """The other peers of the run still training (with `finished_too`, also those that finished), as of the last
        read of their records."""
        return [m for m in self.joins.records if m.peer_id != self.peer_id and (finished_too or not m.finished)]

    def swarm_ahead(self, wait: float = 0.0, finished_too: bool = False) -> bool:
        """Whether another peer is at a later outer step than this one, as of the latest read; with `wait`, look for
        so many seconds. With `finished_too`, a peer that finished counts as well (it waits for the peers behind it,
        as in the final agreement, training/peer/health.py)."""
        deadline = time.monotonic() + wait
        while True:
            self.tick()
            if any(m.step > self.member.step for m in self.others(finished_too)):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def record_age(self, record: PeerMetrics) -> float:
        """Seconds since that peer published its record, as of the last read (0 when it is not known)."""
        published = self.joins.published_at.get(record.peer_id)
        return 0.0 if published is None else max(0.0, dht_time() - published)

    def answering(self, records: Sequence[PeerMetrics]) -> list[PeerMetrics]:
        """Those of these peers that answer a ping now: still running, however old their records."""
        if not records:
            return []
        answered = ping(self.dht, [m.peer_id for m in records])
        return [m for m in records if m.peer_id in answered]

    def read_period(self) -> float:
        """Seconds between this peer's reads of the records (0.5 s in a run of up to 40 peers)."""
        return read_period(len(self.joins.records))

    def settle_time(self) -> float:
        """Seconds until every peer has read a record this peer publishes now (2 s in a run of up to 40 peers)."""
        return settle_time(len(self.joins.records))

    def join_held(self) -> bool:
        """Whether another peer asked the swarm to hold its round while it downloads the state."""
        now = dht_time()
        return any(now < m.joining_until <= now + MAX_JOIN_HOLD for m in self.others())

    def hold(self, until: float) -> None:
        """This peer's own hold of the global step (DHT time), in effect at once."""
        self.joins.hold(until)


def check_same_protocol(others: Sequence[PeerMetrics], run_id: str) -> None:
    """Peers of another protocol would misread each other's messages: refuse to join them, naming both versions."""
    theirs = [m for m in others if m.protocol != PROTOCOL]
    if theirs:
        version = theirs[0].version or "an older version"
        raise TrainError(
            f"run {run_id!r} runs ttt {version} (protocol {theirs[0].protocol}), this peer ttt {ttt_version()} "
            f"(protocol {PROTOCOL}): install the run's version (its monitor's Join page has the line) and join again"
        )


def check_same_settings(
    records: Sequence[PeerMetrics], agreed: Mapping[str, AgreedValue], run_id: str, peer_id: str
) -> None:
    """Every peer of a run trains with the run's settings (training/config.py's RunSettings): a peer set otherwise is
    refused before it takes part in any round or downloads a state, with the option and both values."""
    others = [m for m in records if m.peer_id != peer_id]
    check_same_protocol([m for m in others if not m.finished], run_id)
    # A peer that finished still says what the run trained with: one that arrives as the last ones leave is refused
    # all the same, rather than told nothing and let through.
    for record in [m for m in others if m.protocol == PROTOCOL]:
        differs = disagreement(run_id, record.run_settings, agreed)
        if differs:
            raise TrainError(f"{differs}; join with the run's setting")
