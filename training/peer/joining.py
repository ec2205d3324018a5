"""A peer's own join hold: the swarm holds its step while this peer downloads the state (the protocol is in
training/swarm/optimizer.py's docstring)."""

from __future__ import annotations

import time
from collections.abc import Callable

from hivemind.utils import get_dht_time

from training.peer.view import RunView
from training.swarm.optimizer import ANNOUNCE_WAIT, RELEASE_DELAY


class JoinHold:
    """What this peer asks of the swarm while it joins: `until` (DHT time) is published in its record."""

    def __init__(self, view: RunView, publish: Callable[[], object], timeout: float) -> None:
        self.view, self.publish, self.timeout = view, publish, timeout
        self.until = 0.0  # published: the swarm holds its step for this peer until then
        self.pending = False  # announced, and the held step not yet released (with this peer's first batch)

    def download_during_hold(self, download: Callable[[], None], until_first_batch: bool) -> None:
        """Ask the swarm to hold its step (with --join-timeout > 0), then download its state. With
        `until_first_batch`, the hold lasts until this peer's first batch is ready (`release`); otherwise it ends
        with the download (DiLoCo: this peer's record at the swarm's outer step, with its inner steps to take,
        holds the round instead)."""
        if self.timeout > 0:
            self.announce()
            self.pending = until_first_batch
        download()
        if not until_first_batch:
            self.until = 0.0

    def announce(self) -> None:
        """Publish the hold and wait until the others can have read it: the state downloaded next is then that of
        the step they hold."""
        self.until = get_dht_time() + self.timeout
        self.publish()
        time.sleep(ANNOUNCE_WAIT)

    def release(self) -> None:
        """The first batch is ready: every peer, this one too, ends the held step at one moment, a little ahead."""
        self.pending, self.until = False, get_dht_time() + RELEASE_DELAY
        self.view.hold(self.until)
        self.publish()
