"""A peer's hivemind optimizer, built from its settings: the synchronous `SwarmOptimizer` or, with --local-steps,
the `DiLoCoOptimizer`; the same for a trainer (`ttt train`), a monitor (`ttt monitor`: with --assist-averaging the
`KeeperOptimizer`, which keeps the run's state) and the memory calculator's measurement."""

from __future__ import annotations

from functools import partial

import torch

from training.auth.guard import AdmittedPeers
from training.config import AVERAGE_STATE_EVERY, PeerSettings, find_preset, schedule_steps
from training.model import DalleTransformer
from training.optimizer import linear_schedule
from training.optimizer import make_optimizer as make_local_optimizer
from training.swarm.aggregation import Aggregation
from training.swarm.compression import averaging_compression, pseudo_gradient_compression
from training.swarm.diloco import DiLoCoOptimizer
from training.swarm.keeper import KeeperOptimizer
from training.swarm.optimizer import SwarmOptimizer


def make_optimizer(
    settings: PeerSettings,
    dht,
    model: DalleTransformer,
    keeper: bool = False,
    admitted: AdmittedPeers | None = None,
) -> SwarmOptimizer:
    """The peer's hivemind optimizer; `keeper`: a helper's, which takes part in every round without samples and
    serves the run's state (training/swarm/keeper.py); `admitted`: in an authenticated run, the check its
    averagers make of every caller."""
    preset = find_preset(settings.preset)
    learning_rate = settings.learning_rate or preset.peak_learning_rate(settings.optimizer)
    total_steps = settings.total_steps or schedule_steps(
        preset, settings.local_steps, settings.target_batch_size, int(settings.batch_size)
    )
    local_optimizer = partial(
        make_local_optimizer,
        settings.optimizer,
        lr=learning_rate,
        weight_decay=settings.weight_decay,
        max_grad_norm=settings.max_grad_norm,
    )
    common = swarm_options(settings, dht, keeper, admitted)
    if settings.local_steps:
        schedule = linear_schedule(total_steps)
        return DiLoCoOptimizer(
            params=model.parameters(),
            inner_optimizer=local_optimizer,
            inner_learning_rate=lambda step: learning_rate * schedule(step),
            local_steps=settings.local_steps,
            outer_lr=settings.outer_lr,
            outer_momentum=settings.outer_momentum,
            compression=pseudo_gradient_compression(settings.outer_bits),
            **common,
        )
    compression = averaging_compression()
    return (KeeperOptimizer if keeper else SwarmOptimizer)(
        params=model.parameters(),
        optimizer=local_optimizer,
        scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, linear_schedule(total_steps)),
        # Gradient averaging keeps peers in step; averaging the (8-bit compressed) parameters themselves
        # only corrects drift, and every round adds quantisation noise, so it runs every 10 steps.
        average_state_every=AVERAGE_STATE_EVERY,
        grad_compression=compression,
        state_averaging_compression=compression,
        **common,
    )


def swarm_options(settings: PeerSettings, dht, keeper: bool, admitted: AdmittedPeers | None) -> dict:
    """What both kinds of the peer's hivemind optimizer are made with."""
    return dict(
        dht=dht,
        run_id=settings.run_id,
        target_batch_size=settings.target_batch_size,
        batch_size_per_step=0 if keeper else settings.batch_size,
        offload_optimizer=True,
        # Steps and state rounds finish inside step(), so a checkpoint never races a background update.
        delay_optimizer_step=False,
        delay_state_averaging=False,
        matchmaking_time=settings.matchmaking_time,
        averaging_timeout=settings.averaging_timeout,
        client_mode=settings.client_mode,
        # hivemind warns (rare matchmaking deadlocks) unless requests time out sooner than matchmaking ends.
        averager_opts={"request_timeout": min(3.0, settings.matchmaking_time / 2)},
        verbose=False,
        aggregation=Aggregation(settings.aggregation, settings.clip_tau),
        admitted=admitted,
    )
