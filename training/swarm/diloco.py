"""DiLoCo (Douillard et al. 2023; OpenDiLoCo ran it on hivemind): `ttt train --local-steps H`.

Each peer takes H steps of its own (inner) optimizer on its own batches, then the peers average how far they moved,
the pseudo-gradient, and take one outer step together from the point where they all started:

    outer step t:  theta_t (the same on every peer) --H inner steps--> theta_t,i on peer i
                   delta = mean over the round's peers of q(theta_t - theta_t,i), weighted by their samples
                           (hivemind's all-reduce; q: 1 or 4 bits per value, training/swarm/compression.py)
                   theta_t+1 = SGD step from theta_t with the gradient delta: by default lr 1 and no momentum,
                               theta_t - delta, the mean of the peers' parameters; with --outer-momentum a
                               Nesterov step (the DiLoCo papers' lr 0.7, momentum 0.9)

Error feedback (1-bit SGD, EF-SignSGD): what the quantisation q dropped from a peer's pseudo-gradient is not lost but
sent in a later round. It is kept in the model itself: the peer goes on from theta_t+1 - e_i, where e_i = g_i - q(g_i)
is its own pseudo-gradient's error, so its next pseudo-gradient includes e_i.

A peer sends one compressed model per H local batches instead of one per global step: H times fewer bytes for
the same samples, when each global step of the synchronous run takes one batch per peer. By default the round runs
in the background while the next inner steps go on (training/peer/overlap.py): `begin_round` snapshots the model,
`apply_outer_step` keeps the inner steps taken since on top of the new outer parameters.

The same bits everywhere. The pseudo-gradients are averaged with `same_result` (training/swarm/allreduce.py): every
member of a round receives the very same compressed average, and the outer step is the same arithmetic on the same
inputs, so peers of one round hold bit-identical parameters after it. A newcomer downloads the outer parameters and
momentum uncompressed, with the inner optimizer's state (`DiLoCoStateAverager`), so that it starts from the same
bits as the others. The inner learning rate follows the schedule at inner step `outer step * H + inner steps`,
which every peer computes the same way.

Who takes part (training/peer/rounds.py): a peer that took its H steps publishes so and waits until the other peers at
the same outer step have too, at most `--averaging-timeout`; then the round goes on with those present, and a late
peer finds the swarm at a later outer step and downloads its state.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from functools import partial

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.compression import CompressionBase, CompressionInfo, NoCompression, TensorRole
from hivemind.optim.state_averager import dump_optimizer_state, initialize_optimizer_state_, load_optimizer_state

from training.swarm.admission import AdmittedOnly
from training.swarm.allreduce import RobustAveraging
from training.swarm.compression import round_trip
from training.swarm.optimizer import (
    FailFastStateAverager,
    SwarmOptimizer,
    fingerprint,
    lineage_after,
    round_members,
    tensor_entries,
)

InnerOptimizer = Callable[[Sequence[torch.nn.Parameter]], torch.optim.Optimizer]
CHUNK_TIMEOUT = 15.0  # seconds a reducer waits for a sender's next part (a sender waits twice that for a result)


class PseudoGradientAverager(AdmittedOnly, RobustAveraging, DecentralizedAverager):
    """Averages the peers' pseudo-gradients with the run's aggregation; every member of a round gets the same bits."""

    same_result = True


class DiLoCoStateAverager(FailFastStateAverager):
    """The state a newcomer downloads: hivemind's (the outer parameters, the outer optimizer's momentum, the outer
    step), followed by the inner optimizer's state. `ttt train` sends it uncompressed (see `DiLoCoOptimizer`)."""

    inner_optimizer: torch.optim.Optimizer | None = None

    def get_current_state(self):
        metadata, tensors, infos = super().get_current_state()
        inner_metadata, inner_tensors = dump_optimizer_state(self.inner_optimizer)
        inner_infos = [
            CompressionInfo.from_tensor(tensor, key=f"inner{i}", role=TensorRole.OPTIMIZER)
            for i, tensor in enumerate(inner_tensors)
        ]
        return {**metadata, "inner_optimizer": inner_metadata}, [*tensors, *inner_tensors], [*infos, *inner_infos]

    def load_state_from_peers(self, **kwargs):
        epoch, self.downloaded = self.local_epoch, None
        super().load_state_from_peers(**kwargs)
        if self.downloaded is None or self.downloaded[0]["epoch"] < epoch:
            return  # nothing came, or hivemind refused a state older than this peer's
        metadata, tensors = self.downloaded
        outer_tensors = super().announced_tensors(metadata)
        with torch.no_grad():
            load_optimizer_state(self.inner_optimizer, metadata["inner_optimizer"], tensors[outer_tensors:])

    def announced_tensors(self, metadata: dict) -> int:
        """The outer state's tensors, then the inner optimizer's statistics."""
        return super().announced_tensors(metadata) + tensor_entries(metadata.get("inner_optimizer"))


class DiLoCoOptimizer(SwarmOptimizer):
    """A hivemind optimizer whose `step()` is one inner step; once `round_due`, `average_pseudo_gradients()` averages
    with the peers that are ready and `apply_outer_step()` takes the outer step (training/peer/rounds.py
    decides who takes part, and whether this peer applies the step or downloads the state instead).

    hivemind's offloaded optimizer is the outer one: its CPU copies of the parameters are the outer parameters,
    which newcomers download; `use_local_updates` keeps hivemind from making a gradient averager, the pseudo-gradients
    have their own (`PseudoGradientAverager`)."""

    state_averager_class = DiLoCoStateAverager

    def __init__(
        self,
        *,
        params: Iterable[torch.nn.Parameter],
        inner_optimizer: InnerOptimizer,
        inner_learning_rate: Callable[[int], float],
        local_steps: int,
        outer_lr: float,
        outer_momentum: float,
        compression: CompressionBase,
        averager_opts: dict,
        **kwargs,
    ) -> None:
        self.model_parameters = list(params)
        self.local_steps = local_steps
        self.inner_learning_rate = inner_learning_rate
        self.inner_steps = 0  # taken since the last outer step
        self.inner_samples = 0  # samples of those steps: this peer's weight in the round
        self.last_members: list[str] = []  # the peers of the last outer round
        self.round_failure = ""  # why the last round that failed did
        self.round_local: list[torch.Tensor] = []  # the model's parameters when the last round began (on the CPU)
        self.round_steps = self.round_samples = 0  # the inner steps and samples of that round's pseudo-gradient
        self.compression = compression  # the pseudo-gradients'
        self.round_error: list[torch.Tensor] = []  # what quantising that pseudo-gradient dropped (on the CPU)
        super().__init__(
            params=self.model_parameters,
            optimizer=partial(torch.optim.SGD, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0),
            use_local_updates=True,
            state_averaging_compression=NoCompression(),  # the outer parameters must arrive bit for bit
            averager_opts=averager_opts,
            **kwargs,
        )
        self.inner_optimizer = inner_optimizer(self.model_parameters)
        self.initialize_inner_state()
        self.state_averager.inner_optimizer = self.inner_optimizer
        self.pseudo_gradients = PseudoGradientAverager(
            [torch.zeros_like(p, device="cpu") for p in self.model_parameters],
            dht=self.dht,
            prefix=f"{self.run_id}_pseudo_gradients",
            compression=compression,
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            allow_state_sharing=False,
            # A member whose parts or results stop coming fails the exchange in seconds, not at the round's timeout:
            # a peer stuck a minute in a round missed the others' next rounds for good (seen under load).
            sender_timeout=CHUNK_TIMEOUT,
            reducer_timeout=2 * CHUNK_TIMEOUT,
            start=True,
            aggregation=self.aggregation,
            admitted=self.admitted,
            **averager_opts,
        )

    def initialize_inner_state(self) -> None:
        """Give the inner optimizer its state before the first step (bitsandbytes makes it lazily), so that a state
        downloaded from a peer has tensors to load into; the parameters are left as they were."""
        with torch.no_grad():
            before = [p.detach().clone() for p in self.model_parameters]
            initialize_optimizer_state_(self.inner_optimizer)
            for parameter, value in zip(self.model_parameters, before, strict=True):
                parameter.copy_(value)

    @property
    def outer_parameters(self) -> list[torch.Tensor]:
        """The outer optimizer's parameters: where this outer step started, the same on every peer."""
        return [p for group in self.state_averager.optimizer.param_groups for p in group["params"]]

    @property
    def local_optimizers(self) -> list[torch.optim.Optimizer]:
        """The inner optimizer and the outer one (hivemind's)."""
        return [self.inner_optimizer, *super().local_optimizers]

    @property
    def round_due(self) -> bool:
        return self.inner_steps >= self.local_steps

    def step(self, closure=None, batch_size: int | None = None, grad_scaler=None) -> None:
        """One inner step on this peer's gradients, at the learning rate of its place in the schedule."""
        schedule_step = self.local_epoch * self.local_steps + self.inner_steps
        for group in self.inner_optimizer.param_groups:
            group["lr"] = self.inner_learning_rate(schedule_step)
        self.inner_optimizer.step()
        self.inner_steps += 1
        self.inner_samples += batch_size or self.batch_size_per_step
        self.tracker.report_local_progress(self.local_epoch, self.inner_samples)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def load_pseudo_gradients(self) -> None:
        """This peer's pseudo-gradient, theta_t - theta_t,i, quantised as it is sent, into the averager's tensors: how
        far its H inner steps moved it from where the outer step started (the parameters when the round began,
        `round_local`). What the quantisation drops goes to `round_error`."""
        self.round_error = []
        with self.pseudo_gradients.get_tensors() as buffers:
            for buffer, start, local in zip(buffers, self.outer_parameters, self.round_local, strict=True):
                pseudo_gradient = start - local
                buffer.copy_(round_trip(self.compression, pseudo_gradient))
                self.round_error.append(pseudo_gradient - buffer)

    def begin_round(self, with_others: bool) -> StepControl | None:
        """Start averaging this peer's pseudo-gradient with the peers that are ready, in the background (None: alone,
        nothing to average). The inner steps may go on meanwhile: the round's pseudo-gradient is that of the model
        as it is now, and `apply_outer_step` keeps what the inner steps add before the round's end."""
        self.round_local = [p.detach().to("cpu", copy=True) for p in self.model_parameters]
        self.round_steps, self.round_samples = self.inner_steps, self.inner_samples
        self.load_pseudo_gradients()
        if not with_others:
            return None
        # Groups of one outer step only: a peer left out of its step's group, still looking, would otherwise join the
        # others' next round with a pseudo-gradient from an older start (seen with three peers).
        self.pseudo_gradients.set_group_bits(f"{self.local_epoch:b}")
        return self.pseudo_gradients.step(
            gather=fingerprint(self.outer_parameters), weight=float(max(self.round_samples, 1)),
            timeout=self.averaging_timeout, allow_retries=False, wait=False,
        )  # fmt: skip

    def round_outcome(self, control: StepControl | None, gave_up: bool = False) -> tuple[list[str], bool]:
        """The sorted peer ids of a finished round's group (this peer alone when there was none or the round failed),
        and whether this peer started the outer step where most of the group did (on a tie, where the largest
        fingerprint says).

        Peers that started elsewhere (a round that failed for some, a state downloaded at the wrong moment) would
        otherwise stay apart for good: the same average added to different parameters. Such a peer must not apply
        the step, but download the state the others reach with it."""
        if control is None:
            return [self.own_peer_id], True
        try:
            gathered = control.result()
        except Exception as error:  # no group, or the round broke off: some tensors may hold results, others not
            self.round_failure = f"{type(error).__name__}: {error}"
            if gave_up:
                self.round_failure = "the others went on to a later outer step before a group was found"
            gathered = None
        if not gathered or len(gathered) < 2:
            return [self.own_peer_id], True
        start = fingerprint(self.outer_parameters)
        starts = Counter(str(theirs) for theirs in gathered.values())
        most_common = max(starts, key=lambda started: (starts[started], started))
        return round_members(gathered, self.own_peer_id), start == most_common

    def average_pseudo_gradients(self, with_others: bool, give_up: Callable[[], bool]) -> tuple[list[str], bool]:
        """A round from beginning to end (`begin_round`, `round_outcome`); while no group is found yet, stop looking
        once `give_up()` says so (the others went on without this peer)."""
        control, gave_up = self.begin_round(with_others), False
        while control is not None and not control.done():
            if control.stage == AveragingStage.LOOKING_FOR_GROUP and give_up():
                gave_up = control.cancel()
            time.sleep(0.1)
        return self.round_outcome(control, gave_up)

    def apply_outer_step(self, members: Sequence[str]) -> None:
        """A new outer step, after the round with `members`: its averaged pseudo-gradient moves the outer parameters.
        With no members (a round with the others that failed for every member), the outer parameters and momentum
        stay as they were: each member still holds the same bits, which applying its own pseudo-gradient would have
        set apart, and the model keeps its inner steps for the next round's pseudo-gradient. The inner steps taken
        since the round began count toward the new outer step (the rounds overlapped with them)."""
        with self.tracker.pause_updates(), torch.no_grad():
            if members:
                self.step_outer_parameters()
            else:
                self.state_averager.step(increment_epoch=True)
            self.last_round_size, self.last_members = len(members), list(members)
            self.rounds_together += len(members) > 1
            self.state_averager.lineage = lineage_after(self.state_averager.lineage, members)
            self.inner_steps -= self.round_steps
            self.inner_samples -= self.round_samples
            self.tracker.update_epoch(new_epoch=self.local_epoch)
            if not self.client_mode:
                self.state_averager.state_sharing_priority = self.local_epoch
            self.serve_state_once_stepped()
        if self.inner_steps:
            self.tracker.report_local_progress(self.local_epoch, self.inner_samples)

    def step_outer_parameters(self) -> None:
        """The outer optimizer's step with the averaged pseudo-gradient, copied into the model. On top of the new
        outer parameters, the model keeps what inner steps it took since the round began and, negated, its
        pseudo-gradient's quantisation error (sent in the next round)."""
        pairs = zip(self.model_parameters, self.round_local, self.round_error, strict=True)
        kept = [p.detach().cpu() - start - error for p, start, error in pairs]
        with self.pseudo_gradients.get_tensors() as averaged:
            for parameter, pseudo_gradient in zip(self.outer_parameters, averaged, strict=True):
                parameter.grad = pseudo_gradient.clone()
        self.state_averager.step(increment_epoch=True, optimizer_step=True, zero_grad=True)
        for parameter, moved in zip(self.model_parameters, kept, strict=True):
            parameter.add_(moved.to(parameter.device))

    @torch.no_grad()
    def drop_inner_steps(self) -> None:
        """The model back at the outer parameters: the inner steps taken since the last outer step are dropped (at the
        end of a run, so that every peer of the last round ends with the very same model)."""
        for parameter, outer in zip(self.model_parameters, self.outer_parameters, strict=True):
            parameter.copy_(outer)
        self.inner_steps = self.inner_samples = 0

    def load_state_from_peers(self, **kwargs) -> None:
        """The swarm's outer parameters, momentum, outer step and inner state; this outer step starts anew."""
        super().load_state_from_peers(**kwargs)
        self.inner_steps = self.inner_samples = 0

    def state_dict(self) -> dict:
        """Everything a resumed peer needs to go on exactly: the outer state, where this outer step started, the inner
        optimizer's state and how far this peer got in the outer step."""
        return {
            "outer": super().state_dict(),
            "outer_parameters": [p.detach().clone() for p in self.outer_parameters],
            "inner": self.inner_optimizer.state_dict(),
            "inner_steps": self.inner_steps,
            "inner_samples": self.inner_samples,
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict["outer"])
        for parameter, saved in zip(self.outer_parameters, state_dict["outer_parameters"], strict=True):
            parameter.copy_(saved)
        self.inner_optimizer.load_state_dict(state_dict["inner"])
        self.inner_steps, self.inner_samples = state_dict["inner_steps"], state_dict["inner_samples"]
        self.tracker.report_local_progress(self.local_epoch, self.inner_samples)

    @property
    def step_averagers(self) -> list[RobustAveraging]:
        return [self.pseudo_gradients]

    def shutdown(self) -> None:
        self.pseudo_gradients.shutdown()
        super().shutdown()
