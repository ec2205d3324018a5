"""A peer's part in the swarm, built from the run's settings: the synchronous `SwarmOptimizer` or, with --local-steps,
the `DiLoCoOptimizer`, behind ttt's interface to them (`SwarmMember`, `DiLoCoMember`: training/swarm/member.py); the
same for a trainer (`ttt train`), a monitor (`ttt monitor`: with --assist-averaging the `KeeperOptimizer`, which
keeps the run's state) and the memory calculator's measurement. The choice between synchronous and DiLoCo training
is made here, once."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from training.config import AVERAGE_STATE_EVERY, RunSettings, find_preset, schedule_steps
from training.model import DalleTransformer
from training.optimizer import linear_schedule
from training.optimizer import make_optimizer as make_local_optimizer
from training.swarm.admission import CallerCheck
from training.swarm.aggregation import Aggregation
from training.swarm.allreduce import Probation
from training.swarm.compression import averaging_compression, pseudo_gradient_compression
from training.swarm.diloco import DiLoCoOptimizer
from training.swarm.keeper import KeeperOptimizer
from training.swarm.matchmaking import LeaderRefusal, override_matchmaking
from training.swarm.member import DiLoCoMember, SwarmMember
from training.swarm.optimizer import SwarmOptimizer
from training.swarm.received import Projection


@dataclass(frozen=True)
class Membership:
    """How this peer takes part in the run, besides the run's settings."""

    batch_size: int  # this peer's, samples per optimizer step
    client_mode: bool = False  # nobody can dial it (hivemind's client mode)
    bandwidth: float | None = None  # Mbit/s it declared: its share of the rounds it reduces (swarm/shares.py)
    keeper: bool = False  # the public helper's: in every round without samples, it keeps and serves the state
    admitted: CallerCheck | None = None  # the checks its averagers make of every caller (swarm/admission.py)
    avoided: LeaderRefusal | None = None  # the leaders whose groups it never joins (swarm/matchmaking.py)
    projection: Projection | None = None  # what its reducer sums of each sender's pieces (swarm/received.py)
    probation: Probation | None = None  # whom its reducer holds to one median peer (swarm/aggregation.py)


def join_swarm(run: RunSettings, dht, model: DalleTransformer, membership: Membership) -> SwarmMember:
    """This peer's part in the run's swarm: a `DiLoCoMember` with --local-steps, a `SwarmMember` otherwise."""
    optimizer = make_optimizer(run, dht, model, membership)
    member = DiLoCoMember if run.local_steps else SwarmMember
    return member(optimizer, model)


def make_optimizer(run: RunSettings, dht, model: DalleTransformer, membership: Membership) -> SwarmOptimizer:
    """The peer's hivemind optimizer (the keeper's: training/swarm/keeper.py)."""
    override_matchmaking(membership.avoided)
    preset = find_preset(run.preset)
    learning_rate = run.learning_rate or preset.peak_learning_rate(run.optimizer)
    total_steps = run.total_steps or schedule_steps(
        preset, run.local_steps, run.target_batch_size, membership.batch_size
    )
    local_optimizer = partial(
        make_local_optimizer, run.optimizer, lr=learning_rate, weight_decay=run.weight_decay,
        max_grad_norm=run.max_grad_norm,
    )  # fmt: skip
    common = swarm_options(run, dht, membership)
    if run.local_steps:
        schedule = linear_schedule(total_steps)
        return DiLoCoOptimizer(
            params=model.parameters(),
            inner_optimizer=local_optimizer,
            inner_learning_rate=lambda step: learning_rate * schedule(step),
            local_steps=run.local_steps,
            outer_lr=run.outer_lr,
            outer_momentum=run.outer_momentum,
            compression=pseudo_gradient_compression(run.outer_bits),
            **common,
        )
    compression = averaging_compression()
    return (KeeperOptimizer if membership.keeper else SwarmOptimizer)(
        params=model.parameters(),
        projection=membership.projection,
        probation=membership.probation,
        optimizer=local_optimizer,
        scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, linear_schedule(total_steps)),
        # Gradient averaging keeps peers in step; averaging the (8-bit compressed) parameters themselves
        # only corrects drift, and every round adds quantisation noise, so it runs every 10 steps.
        average_state_every=AVERAGE_STATE_EVERY,
        grad_compression=compression,
        state_averaging_compression=compression,
        **common,
    )


def swarm_options(run: RunSettings, dht, membership: Membership) -> dict:
    """What both kinds of the peer's hivemind optimizer are made with."""
    return dict(
        dht=dht,
        run_id=run.run_id,
        target_batch_size=run.target_batch_size,
        batch_size_per_step=0 if membership.keeper else membership.batch_size,
        offload_optimizer=True,
        # Steps and state rounds finish inside step(), so a checkpoint never races a background update.
        delay_optimizer_step=False,
        delay_state_averaging=False,
        matchmaking_time=run.matchmaking_time,
        averaging_timeout=run.averaging_timeout,
        client_mode=membership.client_mode,
        # hivemind warns (rare matchmaking deadlocks) unless requests time out sooner than matchmaking ends.
        averager_opts={"request_timeout": min(3.0, run.matchmaking_time / 2), "bandwidth": membership.bandwidth},
        verbose=False,
        aggregation=Aggregation(run.aggregation, run.clip_tau),
        admitted=membership.admitted,
    )
