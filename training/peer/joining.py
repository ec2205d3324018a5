"""A peer's own join hold: the swarm holds its step while this peer downloads the state (the protocol is in
training/swarm/joins.py's docstring)."""

from __future__ import annotations

import time

from rich.console import Console

from training.peer.report import ProgressReport
from training.peer.view import RunView
from training.swarm.dht import dht_time
from training.swarm.member import SwarmMember


class JoinHold:
    """What this peer asks of the swarm while it joins: the hold is published in its record (`joining_until`)."""

    def __init__(
        self, view: RunView, report: ProgressReport, member: SwarmMember, console: Console, timeout: float
    ) -> None:
        self.view, self.report, self.member, self.console, self.timeout = view, report, member, console, timeout
        self.pending = False  # announced, and the held step not yet released (with this peer's first batch)

    def join(self, until_first_batch: bool) -> None:
        """A newcomer's first download of the swarm's state, during a hold."""
        self.console.print("downloading the current state from peers")
        self.download_during_hold(until_first_batch)

    def catch_up(self) -> None:
        """DiLoCo: download the swarm's state during a hold, then show up at its outer step with H inner steps to
        take, which the others wait for."""
        self.download_during_hold(until_first_batch=False)
        self.report.publish()

    def download_during_hold(self, until_first_batch: bool) -> None:
        """Ask the swarm to hold its step (with --join-timeout > 0), then download its state. With
        `until_first_batch`, the hold lasts until this peer's first batch is ready (`release`); otherwise it ends
        with the download (DiLoCo: this peer's record at the swarm's outer step, with its inner steps to take,
        holds the round instead)."""
        if self.timeout > 0:
            self.announce()
            self.pending = until_first_batch
        self.member.download_state()
        if not until_first_batch:
            self.report.joining_until = 0.0

    def announce(self) -> None:
        """Publish the hold and wait until the others can have read it: the state downloaded next is then that of
        the step they hold."""
        self.report.joining_until = dht_time() + self.timeout
        self.report.publish()
        time.sleep(self.view.settle_time())

    def release(self) -> None:
        """The first batch is ready: every peer, this one too, ends the held step at one moment, a little ahead."""
        self.pending, self.report.joining_until = False, dht_time() + self.view.settle_time()
        self.view.hold(self.report.joining_until)
        self.report.publish()
