"""A peer's view of its run: the other peers' records, read in the background, and what keeps that view alive.

Every peer publishes a signed metrics record (training/metrics.py). A peer reads them all every `REFRESH` seconds
without ever waiting for the DHT (`JoinHolds`, which also applies the joining peers' holds to its progress
tracker); the loop, the rounds and the report ask this view who else is training and where. Between batches,
`tick()` also renews the access token and pings the initial peers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from functools import partial

from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr
from rich.console import Console

from training.auth.guard import RunAccess
from training.config import (
    MAX_JOIN_HOLD,
    PROTOCOL,
    PeerSettings,
    aggregation_flags,
    mode_flags,
    optimizer_flags,
    ttt_version,
)
from training.metrics import PeerMetrics, read_metrics
from training.peer.setup import TrainError
from training.swarm.dht import ping_peers
from training.swarm.joins import JoinHolds
from training.swarm.optimizer import SwarmProgressTracker

# A peer frozen for a few seconds (a laptop's sleep, a swapping machine) and the peers it knew drop each other from
# their DHT tables; two peers then no longer read each other's records, and each trains alone for good (seen with two
# peers, one frozen 12 s). Pinging the initial peers every so often puts them back.
REJOIN_EVERY = 10.0  # seconds between pings of --initial-peers


class RunView:
    """The run's records as this peer last read them; `step()` says where this peer is."""

    def __init__(
        self,
        dht,
        settings: PeerSettings,
        tracker: SwarmProgressTracker,
        access: RunAccess | None,
        step: Callable[[], int],
    ) -> None:
        self.dht, self.settings, self.access, self.step = dht, settings, access, step
        self.peer_id = dht.peer_id.to_base58()
        self.joins = JoinHolds(dht, settings.run_id, tracker, self.revoked)
        self.initial_peer_ids = [Multiaddr(address)["p2p"] for address in settings.initial_peers]
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
        if self.settings.initial_peers and time.monotonic() >= self.next_rejoin:
            self.next_rejoin = time.monotonic() + REJOIN_EVERY
            self.dht.run_coroutine(partial(ping_peers, self.initial_peer_ids), return_future=True)

    def wait_for_peers(
        self, aggregation: str, console: Console, stopping: Callable[[], bool], keep_record: Callable[[], None]
    ) -> None:
        """--wait-for-peers N: the run's first peers start together instead of the first one training alone; this
        peer's record is kept alive meanwhile (`keep_record`), however long the others take to come."""
        wanted = self.settings.wait_for_peers
        if wanted <= 1:
            return
        console.print(f"waiting until {wanted} peers of run {self.settings.run_id!r} are here (Ctrl-C to leave)")
        while not stopping():
            records = self.read_now()
            check_same_settings(records, self.settings, aggregation, self.peer_id)
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
        return read_metrics(self.dht, self.settings.run_id, self.revoked())

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
        as in `Peer.finish()`)."""
        deadline = time.monotonic() + wait
        while True:
            self.tick()
            if any(m.step > self.step() for m in self.others(finished_too)):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def record_age(self, record: PeerMetrics) -> float:
        """Seconds since that peer published its record, as of the last read (0 when it is not known)."""
        published = self.joins.published_at.get(record.peer_id)
        return 0.0 if published is None else max(0.0, get_dht_time() - published)

    def answering(self, records: Sequence[PeerMetrics]) -> list[PeerMetrics]:
        """Those of these peers that answer a ping now: still running, however old their records."""
        if not records:
            return []
        answered = self.dht.run_coroutine(partial(ping_peers, [m.peer_id for m in records]))
        return [m for m in records if m.peer_id in answered]

    def join_held(self) -> bool:
        """Whether another peer asked the swarm to hold its round while it downloads the state."""
        now = get_dht_time()
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


def check_same_settings(records: Sequence[PeerMetrics], settings: PeerSettings, aggregation: str, peer_id: str) -> None:
    """A run averages one way (every global step or every H local steps), reduces one way and steps with one
    optimizer: a peer set otherwise is refused before it takes part in any round or downloads a state."""
    others = [m for m in records if not m.finished and m.peer_id != peer_id]
    check_same_protocol(others, settings.run_id)
    modes = sorted({m.local_steps for m in others})
    if modes and modes != [settings.local_steps]:
        raise TrainError(
            f"run {settings.run_id!r} trains with {mode_flags(modes[0])}, this peer with "
            f"{mode_flags(settings.local_steps)}; join with the run's setting"
        )
    theirs = sorted({m.aggregation for m in others})
    if theirs and theirs != [aggregation]:
        raise TrainError(
            f"run {settings.run_id!r} averages with {aggregation_flags(theirs[0])}, this peer with "
            f"{aggregation_flags(aggregation)}; join with the run's setting"
        )
    optimizers = sorted({m.optimizer for m in others})
    if optimizers and optimizers != [settings.optimizer]:  # their optimizer states could not load into each other
        raise TrainError(
            f"run {settings.run_id!r} trains with {optimizer_flags(optimizers[0])}, this peer with "
            f"{optimizer_flags(settings.optimizer)}; join with the run's setting"
        )
