"""DiLoCo with overlapped outer rounds (the default with --local-steps): the peer never stops training for a round.

After its H inner steps the peer says it is ready and goes on with the next inner steps; between its batches it
looks whether the peers of its outer step are ready too, starts the round in the background once they are (or the
wait is over), and takes the outer step when the round's result arrives, one round late as Streaming DiLoCo's
overlap does: the averaged pseudo-gradient moves the outer parameters, which every peer of the round holds
bit-identical as before, and the inner steps taken meanwhile stay on top of them (training/swarm/diloco.py's
`apply_outer_step`). Only a round still unresolved after another H inner steps makes the peer wait.

A peer that finds the swarm at a later outer step downloads its state, as in the synchronous outer step
(training/peer/rounds.py's `OuterRounds`, which this extends: the same waiting, the same rules for who takes part).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from training.peer.rounds import WAIT_NOTE_AFTER, OuterRounds
from training.swarm.member import OuterRound


class OverlappedOuterRounds(OuterRounds):
    """DiLoCo's outer rounds, run between the inner steps instead of in place of them."""

    overlapped = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ready_since: float | None = None  # when this peer said its H steps were taken (no round begun yet)
        self.said_waiting = False
        self.in_round = False
        self.round: OuterRound | None = None  # the round in flight (None with it: a round alone)
        self.gave_up = False
        self.with_others = False  # whether the round in flight is one with others

    def after_step(self, losses: Sequence[float]) -> None:
        """Move the outer round on, without waiting; wait only when another round is due before this one ended."""
        if not (self.in_round or self.ready_since is not None) and self.member.round_due:
            self.report.publish(losses)  # inner_steps == H: the others see that this peer is ready
            self.ready_since, self.said_waiting = time.monotonic(), False
        self.move_on()
        if self.next_round_due:
            self.settle()  # this one must end first

    @property
    def next_round_due(self) -> bool:
        """Whether this peer has taken another H inner steps since its round was due."""
        return self.member.inner_steps >= 2 * self.local_steps

    def move_on(self) -> None:
        if self.ready_since is not None:
            self.maybe_begin_round()
        if self.in_round:
            self.follow_round()

    def settle(self) -> None:
        """Until no round is waiting to begin or in flight (a stopping peer begins none)."""
        while self.ready_since is not None or self.in_round:
            if self.stop.requested() and self.ready_since is not None:
                self.ready_since = None  # the checkpoint keeps the H steps taken: a resumed peer takes this round
                continue
            self.move_on()
            time.sleep(0.1)
            self.view.tick()

    def maybe_begin_round(self) -> None:
        """Begin the round once the peers of this outer step are ready, or the wait is over; download the swarm's
        state if it went on without this peer.

        The wait is over after --averaging-timeout, but never before the next round is due: until then this peer
        trains on, so waiting for a slower peer costs it nothing."""
        if self.view.swarm_ahead():
            self.ready_since = None
            self.why_behind = "the others went on to a later outer step before this peer was ready"
            self.join_hold.catch_up()
            return
        deadline = self.ready_since + self.settings.run.averaging_timeout
        waiting_for = self.peers_to_wait_for()
        training_on = bool(waiting_for) and not self.next_round_due
        if training_on or self.still_waiting(waiting_for, deadline):
            if not self.said_waiting and time.monotonic() - self.ready_since >= WAIT_NOTE_AFTER:
                self.said_waiting = self.say_waiting(waiting_for, deadline)
            return
        self.give_up_on_late(waiting_for, deadline)
        self.ready_since, self.gave_up = None, False
        self.with_others = self.others_ready()
        self.round, self.in_round = self.member.begin_round(self.with_others), True

    def follow_round(self) -> None:
        """Conclude the round once it ended; give it up while it still looks for a group the swarm has left (peers
        that finished at a later step count: a peer slow to its last round looked a minute for a group of peers that
        had finished, and then found nobody left to download their state from)."""
        outer_round = self.round
        if outer_round is not None and not outer_round.done():
            if outer_round.looking_for_group() and self.view.swarm_ahead(finished_too=True):
                self.gave_up = outer_round.cancel()
            return
        self.in_round = False
        members, same_start = self.member.round_outcome(outer_round, self.gave_up)
        if not self.conclude_round(self.with_others, members, same_start):
            self.join_hold.catch_up()
