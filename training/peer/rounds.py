"""How a peer averages, chosen once: every global step (`GlobalSteps`) or every H local steps (`OuterRounds`, DiLoCo).

The loop calls `after_step()` after each optimizer step; the report asks the mode how to name a step, and the final
agreement whom it gave up on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial

from rich.console import Console
from rich.markup import escape

from training.config import PeerSettings
from training.metrics import PeerMetrics
from training.peer.joining import JoinHold
from training.peer.report import ProgressReport
from training.peer.stopping import StopSignals
from training.peer.view import RunView
from training.swarm.member import DiLoCoMember

# Seconds a DiLoCo peer whose round found nobody looks whether the others went on without it, after their records
# can have reached it (the view's `settle_time`: 2 s in a run of up to 8 peers).
LATE_ROUND_LOOK = 1.0
WAIT_NOTE_AFTER = 3.0  # seconds a DiLoCo peer waits for the others of its round before it says so
# A peer of this outer step whose record, at its own pace, should long have said it took its H inner steps is gone
# without a goodbye (killed, its link lost): its record lives on for minutes, and the others waited for it until
# --averaging-timeout (about a minute on the NAT testbed). A live peer is given this many times its own pace, plus a
# margin for a record still on its way (it publishes again when ready, and at least every RECORD_REFRESH) and one
# period of this peer's reads of the records (the view's `read_period`: 0.5 s in a run of up to 8 peers). The age
# comes from the record's DHT expiration, so from the publisher's clock: one running behind by more than the margin
# looks overdue sooner (it then misses rounds and downloads the state; hivemind's DHT needs clocks in step anyway).
OVERDUE_PACE = 3.0
OVERDUE_MARGIN = 9.5  # seconds


def overdue(record: PeerMetrics, age: float, local_steps: int, read_period: float) -> bool:
    """Whether a peer whose record is `age` seconds old, as of reads `read_period` seconds apart, should have taken
    `local_steps` batches long ago (DiLoCo: its H inner steps; synchronous: as many as its last global step took), at
    the pace the record gives (its batch, the samples it contributed per second); with no pace in the record, never."""
    if record.mini_steps == 0 or record.samples_per_second <= 0:
        return False
    batch_seconds = record.samples_accumulated / record.mini_steps / record.samples_per_second
    steps_left = max(local_steps - record.inner_steps, 1)
    return age > OVERDUE_PACE * steps_left * batch_seconds + OVERDUE_MARGIN + read_period


class GlobalSteps:
    """Synchronous training: hivemind averages every global step's gradients inside `optimizer_step()`."""

    step_noun = "global"
    # The swarm holds its step for a newcomer until the newcomer's first batch is ready (training/peer/joining.py).
    holds_step_for_first_batch = True

    def __init__(self, view: RunView) -> None:
        self.view = view

    def after_step(self, losses: Sequence[float]) -> None:
        """Nothing to do: the optimizer's step averaged when the swarm's global step ended."""

    def nobody_to_meet(self) -> bool:
        """Whether every other peer of the run has finished, as of a fresh look at the records: the gradient round this
        peer looks for has nobody to form it with (its step then goes on alone, and the final agreement brings it the
        finished peers' parameters when it ends apart). A peer killed without a goodbye still counts as a peer to meet:
        its record says nothing of it for a while, and waiting costs no more than before."""
        self.view.tick()
        others = self.view.others(finished_too=True)
        return bool(others) and all(m.finished for m in others)

    def step_label(self, step: int) -> str:
        return f"step {step:>5}"

    def mode_note(self, published: PeerMetrics) -> str:
        return ""

    def given_up_on(self, record: PeerMetrics) -> bool:
        """Whether that peer's record is `overdue`: a live peer publishes again after every global step, and this one's
        has not for three times what its last step's batches took (plus the margin). The final agreement then waits
        for it only while it answers a ping: a peer killed mid-run keeps its record for 10 minutes, and every finished
        peer waited for it until the agreement's deadline (a minute; seen in the churn test)."""
        return overdue(record, self.view.record_age(record), record.mini_steps, self.view.read_period())

    def settle(self) -> None:
        """Nothing is ever in flight between two batches."""

    def end_run(self) -> None:
        """The model is the swarm's already."""

    def skip_note(self, previous_step: int, step: int) -> str:
        return ""


class OuterRounds:
    """DiLoCo: after H inner steps, this peer says so, waits until the other peers of this outer step have too (at
    most --averaging-timeout), averages with those that are ready and takes the outer step. A peer that finds the
    swarm at a later outer step, having gone on without it, downloads the swarm's state instead."""

    step_noun = "outer"
    overlapped = False  # training/peer/overlap.py: the rounds between the inner steps
    # A newcomer's record at the swarm's outer step, with its inner steps to take, holds the round instead.
    holds_step_for_first_batch = False

    def __init__(
        self,
        settings: PeerSettings,
        member: DiLoCoMember,
        view: RunView,
        console: Console,
        report: ProgressReport,
        join_hold: JoinHold,
        stop: StopSignals,
    ) -> None:
        self.settings, self.local_steps, self.member, self.view = settings, settings.run.local_steps, member, view
        self.console, self.report, self.join_hold, self.stop = console, report, join_hold, stop
        # Peer id -> (outer step, inner steps) of a record that this peer waited for until the timeout; it is not
        # waited for again until it changes (a peer that left keeps its record for a while).
        self.waited_in_vain: dict[str, tuple[int, int]] = {}
        self.why_behind = ""  # why this peer last had to download the state instead of taking the outer step

    @property
    def step(self) -> int:
        return self.member.step

    def after_step(self, losses: Sequence[float]) -> None:
        if self.member.round_due:
            self.outer_round(losses)

    def step_label(self, step: int) -> str:
        return f"outer step {step:>4}"

    def mode_note(self, published: PeerMetrics) -> str:
        """DiLoCo's peers of one round hold the same bits: their fingerprints say so."""
        overlap = ", overlapped" if self.overlapped else ""
        return f" | DiLoCo every {self.local_steps} local steps{overlap} | parameters {published.parameters_hash[:8]}"

    def outer_round(self, losses: Sequence[float]) -> None:
        """Wait for the peers of this outer step, average with those that are ready, take the outer step; or download
        the swarm's state when it went on without this peer."""
        self.report.publish(losses)  # inner_steps == H: the others see that this peer is ready
        self.wait_for_the_round()
        if self.stop.requested():
            return  # the checkpoint keeps this state: a resumed peer takes this round first
        if self.view.swarm_ahead():
            self.why_behind = "the others went on to a later outer step before this peer was ready"
        elif self.average_and_step():
            return
        self.join_hold.catch_up()

    def wait_for_the_round(self) -> None:
        """Until the peers of this outer step have taken their H inner steps (at most --averaging-timeout), or the
        swarm is ahead, or a newcomer's hold ends."""
        started = time.monotonic()
        deadline = started + self.settings.run.averaging_timeout
        waiting_for, said = self.peers_to_wait_for(), False
        while not self.stop.requested() and not self.view.swarm_ahead():
            if not self.still_waiting(waiting_for, deadline):
                break
            if not said and time.monotonic() - started >= WAIT_NOTE_AFTER:
                said = self.say_waiting(waiting_for, deadline)
            time.sleep(0.1)
            self.view.tick()
            waiting_for = self.peers_to_wait_for()
        self.give_up_on_late(waiting_for, deadline)

    def still_waiting(self, waiting_for: Sequence[PeerMetrics], deadline: float) -> bool:
        """Whether the round waits on: peers of this outer step not ready before the deadline, or a newcomer's hold."""
        return bool(waiting_for and time.monotonic() < deadline) or self.view.join_held()

    def give_up_on_late(self, waiting_for: Sequence[PeerMetrics], deadline: float) -> None:
        """Past the deadline, the peers still not ready hold up no round or finish again until their records change."""
        if time.monotonic() >= deadline:
            self.waited_in_vain.update({m.peer_id: (m.step, m.inner_steps) for m in waiting_for})

    def say_waiting(self, waiting_for: Sequence[PeerMetrics], deadline: float) -> bool:
        """A line for a round that keeps this peer waiting: for whom, and for how long at most."""
        who = f"{len(waiting_for)} peer{'s' if len(waiting_for) != 1 else ''}" if waiting_for else "a joining peer"
        left = max(0.0, deadline - time.monotonic())
        most = f"at most {left:.0f} s more"
        if self.overlapped:
            most = f"training on meanwhile, up to local step {2 * self.local_steps}, or {most} if longer"
        self.console.print(f"outer step {self.step}: waiting for {who} to take {self.local_steps} local steps ({most})")
        return True

    def average_and_step(self) -> bool:
        """Average with the peers that are ready and take the outer step; False when this peer must download the
        state instead (it started elsewhere, or its round failed while the others went on)."""
        with_others = self.others_ready()
        give_up = partial(self.view.swarm_ahead, finished_too=True)  # as in `OverlappedOuterRounds.follow_round`
        members, same_start = self.member.average_pseudo_gradients(with_others, give_up=give_up)
        return self.conclude_round(with_others, members, same_start)

    def others_ready(self) -> bool:
        """Whether another peer of this outer step has taken its H inner steps: a round with it is due."""
        return any(m.step == self.step and m.inner_steps >= self.local_steps for m in self.view.others())

    def conclude_round(self, with_others: bool, members: Sequence[str], same_start: bool) -> bool:
        """Take the outer step of a finished round; False when this peer must download the state instead."""
        if not same_start:
            self.why_behind = f"its parameters had left the others' at outer step {self.step}"
            self.console.print(
                f"[yellow]outer step {self.step}: this peer's parameters had left the others': downloading the "
                "state they reach[/]"
            )
            self.view.swarm_ahead(wait=self.settings.run.averaging_timeout)
            return False
        if len(members) > 1 or not with_others:
            self.member.apply_outer_step(members)
            return True
        failure = f"outer step {self.step}: the round with the others failed ({escape(self.member.round_failure)})"
        # It may have succeeded for the others, even for their last outer step: this peer downloads what they reached.
        if self.view.swarm_ahead(wait=self.view.settle_time() + LATE_ROUND_LOOK, finished_too=True):
            self.console.print(f"[yellow]{failure}[/]")
            self.why_behind = f"its round of outer step {self.step} failed"
            return False
        # Or it failed for every member: none moves the outer parameters, so all hold the same bits still (each
        # applying its own pseudo-gradient set them apart, and all but one downloaded the state a round later).
        self.console.print(f"[yellow]{failure}: its local steps go into the next round[/]")
        self.member.carry_over()
        return True

    def settle(self) -> None:
        """Nothing is left in flight between two batches: the round ended inside `after_step`."""

    def end_run(self) -> None:
        """The run's last model is the outer parameters all peers of the last round hold, without the inner steps this
        peer took after it (none unless the rounds overlapped)."""
        self.member.drop_inner_steps()

    def skip_note(self, previous_step: int, step: int) -> str:
        """For the progress line of a new outer step: the outer steps this peer skipped (reaching a later one by
        download), and why; nothing when it skipped none."""
        why, self.why_behind = self.why_behind or "the others went on without this peer", ""
        if step <= previous_step + 1:
            return ""
        missed = f"{previous_step + 1}" if step == previous_step + 2 else f"{previous_step + 1}-{step - 1}"
        return f" | missed outer step{'s' if step > previous_step + 2 else ''} {missed}: {why}"

    def peers_to_wait_for(self) -> list[PeerMetrics]:
        """The peers of this outer step that have not taken their H inner steps yet, and the members of this peer's
        last round whose records still show the previous outer step (they are publishing the new one)."""
        last_members = set(self.member.last_members)
        return [
            m
            for m in self.view.others()
            if not self.given_up_on(m)
            and (
                (m.step == self.step and m.inner_steps < self.local_steps)
                or (m.step == self.step - 1 and m.peer_id in last_members)
            )
        ]

    def given_up_on(self, record: PeerMetrics) -> bool:
        """Whether this peer waited for that one until the timeout, and its record has not changed since, or the
        record is `overdue` (it left without a goodbye, or froze): it holds up neither a round nor this peer's finish
        (until its record changes). A record of an earlier outer step can be overdue too, unless it is a member of this
        peer's last round (publishing the new step): a peer killed at step 3 held every finished peer of step 12 for
        the agreement's deadline (a minute; seen in the overlapped-rounds test)."""
        if self.waited_in_vain.get(record.peer_id) == (record.step, record.inner_steps):
            return True
        still_publishing = record.step == self.step - 1 and record.peer_id in self.member.last_members
        if record.step > self.step or still_publishing:
            return False
        return overdue(record, self.view.record_age(record), self.local_steps, self.view.read_period())


Mode = GlobalSteps | OuterRounds
