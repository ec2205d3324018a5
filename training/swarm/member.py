"""This peer's part in the run's swarm, as the rest of ttt sees it: the one door to hivemind.

peer/, monitor/ and calc/ hold a `SwarmMember` (`DiLoCoMember` with --local-steps) and never hivemind's optimizer,
its progress tracker or its averagers: what they ask of the swarm (where the run is, how many peers are in it, a
step, a state download, what was sent and dropped) is said here in ttt's words, and the hivemind objects behind it
stay in training/swarm/ (the boundary is checked by tests/test_layout.py).

    member.step                 the run's global (DiLoCo: outer) step this peer is at
    member.peers                peers in the run's progress records, this one included
    member.optimizer_step()     one batch's gradients in: hivemind ends the global step when the swarm has
                                the target batch, averages and applies (DiLoCo: one inner step)
    member.download_state()     the swarm's current state, recorded in `downloads`
    member.parameters_hash()    what peers in step hold alike (DiLoCo: the outer parameters)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from hivemind.averaging.control import AveragingStage, StepControl

from training.swarm.diloco import DiLoCoOptimizer
from training.swarm.optimizer import Download, SwarmBuffers, SwarmOptimizer, fingerprint


class SwarmMember:
    """A synchronous peer's part in the swarm: hivemind averages every global step's gradients."""

    def __init__(self, optimizer: SwarmOptimizer, model: torch.nn.Module) -> None:
        self._optimizer, self._model = optimizer, model

    @property
    def step(self) -> int:
        return self._optimizer.local_epoch

    @property
    def peers(self) -> int:
        """Peers in the run's latest progress records, this one included (1: alone)."""
        return self._optimizer.tracker.global_progress.num_peers

    @property
    def samples_per_second(self) -> float:
        """This peer's own, as hivemind measures it for the swarm's progress."""
        return float(self._optimizer.tracker.performance_ema.samples_per_second)

    @property
    def serves_state(self) -> bool:
        """Whether others can download the state from this peer: a full peer, not a client."""
        return not self._optimizer.client_mode

    @property
    def lineage(self) -> str:
        """The rounds this peer's parameters went through (training/swarm/optimizer.py's `FailFastStateAverager`)."""
        return self._optimizer.lineage

    @property
    def last_round_size(self) -> int:
        return self._optimizer.last_round_size

    @property
    def last_round_in_part(self) -> bool:
        """Whether some results of the last round were lost on their way here: this peer kept its own values there,
        so its parameters are apart from the round's other members until a repair (training/peer/health.py)."""
        return self._optimizer.last_round_in_part

    @property
    def last_round_ahead(self) -> tuple[int, int] | None:
        """(this peer's global step, the others') when the last round was the others' of a later step, whose gradients
        moved this peer's parameters away from theirs (`training.swarm.optimizer.round_ahead`); else None."""
        return self._optimizer.last_round_ahead

    @property
    def rounds_together(self) -> int:
        return self._optimizer.rounds_together

    @property
    def downloads(self) -> list[Download]:
        """Every state download this peer tried, in order."""
        return self._optimizer.downloads

    @property
    def inner_steps(self) -> int:
        """DiLoCo's inner steps in this outer step; none in a synchronous run."""
        return 0

    @property
    def local_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers whose steps change this peer's parameters."""
        return self._optimizer.local_optimizers

    def optimizer_step(self) -> None:
        """The batch's gradients into the swarm's step (which may end, average and apply here), then zeroed."""
        self._optimizer.step()
        self._optimizer.zero_grad()

    def zero_grad(self) -> None:
        self._optimizer.zero_grad()

    def download_state(self, then_train: bool = True) -> Download:
        """The swarm's current state (`then_train`: this peer trains on after it, not at the run's end).

        The gradients of a batch computed before it, at the parameters it replaced, are dropped, as hivemind drops
        them when its own step downloads ("must start over"); the caller skips that batch's optimizer step (a step
        would count its samples). A repair's download comes between a batch's backward and its optimizer step: that
        batch's gradients then went into the next round, after the download had reset the step's accumulator, while
        the audits held them unsent (training/audit/auditor.py's `forget_unsent`), and three reducers failed two
        honest senders by what they had sent (bench.verify, a poisoner's run)."""
        self._optimizer.load_state_from_peers(then_train=then_train)
        self._optimizer.zero_grad()
        return self._optimizer.downloads[-1]

    def parameters_hash(self) -> str:
        """A short fingerprint of the model's parameters."""
        return fingerprint(self._model.parameters())

    def sent_bytes(self) -> dict[str, int]:
        """ "allreduce" | "state" -> bytes this peer's averagers sent to other peers so far."""
        return self._optimizer.sent_bytes()

    def received_rounds(self) -> list[dict]:
        """The gradient rounds this peer reduced since the last call: each the step, the regions its reducer checks,
        and sender peer id -> (weight, its sums of those regions of what it sent) (training/swarm/received.py)."""
        return self._optimizer.received_rounds()

    def outlier_counts(self) -> dict[tuple[str, str], int]:
        """(sender peer id, "dropped" | "clipped") -> pieces this peer's averagers dropped or clipped so far."""
        return self._optimizer.outlier_counts()

    def refuse_convicted(self, peer_ids: list[str]) -> None:
        """Refuse `peer_ids` in this peer's averaging from now on: its audits convicted them."""
        self._optimizer.tell_standing(convicted=peer_ids)

    def leave_out_unaudited(self, peer_ids: list[str]) -> None:
        """Count what `peer_ids` send for nothing in this peer's reducers, in place of those left out so far: nobody
        can audit their work now (training/audit/records.py's `unaudited_keys`)."""
        self._optimizer.tell_standing(unaudited=peer_ids)

    def give_up_looking_when(self, nobody_to_meet: Callable[[], bool]) -> None:
        """A gradient round still looking for its group stops looking once `nobody_to_meet()` says so: this peer then
        applies its own gradients, as after a failed round (training/swarm/optimizer.py's `nobody_left`)."""
        self._optimizer.nobody_to_meet = nobody_to_meet

    def hold_step_until(self, until: float) -> None:
        """Do not end the global step before `until` (DHT time): a joining peer's hold (training/swarm/joins.py)."""
        self._optimizer.tracker.hold_until = until

    def state_dict(self) -> dict:
        return self._optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._optimizer.load_state_dict(state)

    def memory_buffers(self) -> SwarmBuffers:
        """The tensors hivemind's optimizer adds to the model's parameters and gradients (`ttt calc` measures them)."""
        return self._optimizer.memory_buffers()

    def shutdown(self) -> None:
        self._optimizer.shutdown()


class OuterRound:
    """A DiLoCo round in flight (training/peer/overlap.py follows it between inner steps)."""

    def __init__(self, control: StepControl) -> None:
        self.control = control

    def done(self) -> bool:
        return self.control.done()

    def looking_for_group(self) -> bool:
        return self.control.stage == AveragingStage.LOOKING_FOR_GROUP

    def cancel(self) -> bool:
        """Stop looking for a group; True if the round was cancelled."""
        return self.control.cancel()


class DiLoCoMember(SwarmMember):
    """A DiLoCo peer's part in the swarm (training/swarm/diloco.py): H inner steps, then an outer round."""

    _optimizer: DiLoCoOptimizer

    @property
    def inner_steps(self) -> int:
        return self._optimizer.inner_steps

    @property
    def round_due(self) -> bool:
        """Whether this peer has taken its H inner steps."""
        return self._optimizer.round_due

    @property
    def last_members(self) -> list[str]:
        """The peers of the last outer round."""
        return self._optimizer.last_members

    @property
    def round_failure(self) -> str:
        """Why the last round that failed did."""
        return self._optimizer.round_failure

    def parameters_hash(self) -> str:
        """A short fingerprint of the parameters this outer step started from: the same on every peer of the round
        (during the inner steps, each peer's model moves away from them on its own)."""
        return fingerprint(self._optimizer.outer_parameters)

    def begin_round(self, with_others: bool) -> OuterRound | None:
        """Start averaging this peer's pseudo-gradient in the background (None: alone, nothing to average)."""
        control = self._optimizer.begin_round(with_others)
        return OuterRound(control) if control is not None else None

    def round_outcome(self, outer_round: OuterRound | None, gave_up: bool = False) -> tuple[list[str], bool]:
        """The round's members (this peer alone when it failed), and whether this peer started where most did."""
        return self._optimizer.round_outcome(outer_round.control if outer_round else None, gave_up)

    def average_pseudo_gradients(self, with_others: bool, give_up: Callable[[], bool]) -> tuple[list[str], bool]:
        """A round from beginning to end; while no group is found yet, stop looking once `give_up()` says so."""
        return self._optimizer.average_pseudo_gradients(with_others, give_up)

    def apply_outer_step(self, members: Sequence[str]) -> None:
        """The outer step with the average of a round with `members` (this peer alone: its own pseudo-gradient)."""
        self._optimizer.apply_outer_step(members)

    def carry_over(self) -> None:
        """A new outer step with the outer parameters as they were, after a round with the others that failed for
        all its members: they hold the same bits still, and the inner steps go into the next round."""
        self._optimizer.apply_outer_step([])

    def drop_inner_steps(self) -> None:
        """The model back at the outer parameters (the run's end: every peer of the last round holds them)."""
        self._optimizer.drop_inner_steps()
