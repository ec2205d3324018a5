"""The run's state, kept by a public helper (`ttt monitor --assist-averaging`) that trains on nothing.

A peer that missed a round, or joins, downloads the swarm's state from a peer that serves it. Peers behind NAT
join in client mode: nobody can dial them, so they serve nothing, and in a run whose trainers are all behind NAT
no state could be downloaded at all (measured: every home that missed a round kept its own parameters, found
itself behind again at the next step, and half of all rounds were short of a peer).

`KeeperOptimizer` is the helper's optimizer: a member of every gradient round like a trainer, with weight 0
(hivemind's own "tag along" mode, which the robust reducer also leaves out of its statistics; its parts travel
without their values, training/swarm/allreduce.py), it applies the round's average with the run's optimizer as the
trainers do, and so holds the parameters and optimizer state they hold, which it serves to anyone who asks, being
reachable. In a run of home peers every round goes through a reachable peer anyway (client-mode peers cannot
reduce), so the helper is in each round that succeeds. It joins the state rounds too, which bring its parameters
back to the swarm's.

Following the trainers. hivemind publishes a peer's progress only once it has samples, and counts only full peers'
steps as the run's: in a run of home peers nobody's step would count, a newcomer would start at step 0 whatever
the run's, and a trainer alone with the helper would see nobody to average with (both measured). The keeper
publishes its own record. Its step ends when the trainers come to average (its round's group has formed), never on
an estimate of when their samples will be in: its step is the run's, so a keeper ahead of them would move them on.
When the trainers' records are at a later step (its round failed, or it arrived late), it downloads the state.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from hivemind.averaging.control import AveragingStage
from hivemind.utils import get_dht_time

from training.swarm.optimizer import SwarmOptimizer, SwarmProgressTracker


class KeeperProgressTracker(SwarmProgressTracker):
    """A progress tracker whose step ends when `group_formed()` says so, and which reads the trainers' step from
    every record, client-mode peers' included (the median, so that one record cannot pull the keeper along)."""

    group_formed: Callable[[], bool] = staticmethod(lambda: False)
    trainers_epoch = 0

    @property
    def ready_to_update_epoch(self) -> bool:
        return self.group_formed()

    def _parse_swarm_progress_data(self, metadata):
        if isinstance(metadata, dict):
            own = self._local_public_key
            values = [item.value for key, item in metadata.items() if key != own and hasattr(item, "value")]
            epochs = [value["epoch"] for value in values if isinstance(value, dict) and type(value.get("epoch")) is int]
            self.trainers_epoch = statistics.median_low(epochs) if epochs else self.trainers_epoch
        return super()._parse_swarm_progress_data(metadata)


class KeeperOptimizer(SwarmOptimizer):
    """A SwarmOptimizer that accumulates no samples: each `step()` publishes its progress record, and a global step
    averages its zero gradients with weight 0 once the trainers' group has formed, then applies the average.

    It serves its state only while it holds the swarm's: after a global step in a round with others, or a state
    downloaded. A step without a round applies its zero gradients alone (hivemind's fallback), which leaves
    parameters nobody else holds: it stops serving and downloads the state at once (in a run of home peers
    nobody serves one, and it serves again after its next round with them)."""

    progress_tracker_class = KeeperProgressTracker

    def __init__(self, *args, **kwargs) -> None:
        self.next_report = 0.0  # DHT time of the next publication of this keeper's progress record
        super().__init__(*args, **kwargs)
        self.state_averager.allow_state_sharing = False  # not before its first round: the trainers' own seed
        self.tracker.group_formed = self.group_formed

    def group_formed(self) -> bool:
        control = self.scheduled_grads
        return control is not None and control.stage == AveragingStage.AWAITING_TRIGGER

    def step(self, *args, **kwargs):
        if self.tracker.trainers_epoch > self.local_epoch:  # the trainers went on without this keeper
            self.state_averager.allow_state_sharing = False
            self.load_state_from_peers()
            self.state_averager.local_epoch = max(self.local_epoch, self.tracker.trainers_epoch)
        return super().step(*args, **kwargs)

    def _check_and_accumulate_gradients(self, batch_size: int, grad_scaler) -> bool:
        self.publish_progress()
        return True

    def publish_progress(self) -> None:
        """Store this keeper's progress record (hivemind's reporter stores none for a peer without samples): on a new
        step, and every half of the record's lifetime."""
        tracker, now = self.tracker, get_dht_time()
        if tracker.local_progress.epoch == self.local_epoch and now < self.next_report:
            return
        tracker.report_local_progress(self.local_epoch, samples_accumulated=0)
        self.next_report = now + tracker.metadata_expiration / 2
        self.dht.store(
            key=tracker.training_progress_key,
            subkey=tracker._local_public_key,
            value=tracker.local_progress.dict(),
            expiration_time=now + tracker.metadata_expiration,
            return_future=True,
        )

    def _update_global_epoch(self, grad_scaler) -> None:
        super()._update_global_epoch(grad_scaler)
        self.state_averager.allow_state_sharing = self.last_round_size > 1
        if self.last_round_size == 1:
            self.load_state_from_peers()

    def load_state_from_peers(self, **kwargs) -> None:
        serving = self.state_averager.allow_state_sharing
        super().load_state_from_peers(**kwargs)
        self.state_averager.allow_state_sharing = serving or self.downloads[-1].arrived

    def join_next_group(self) -> None:
        """Not the trainers' look-ahead: a keeper joins the trainers' groups by its own rule (`group_formed`)."""
        return None

    def serve_state_once_stepped(self) -> None:
        """Not the trainers' rule (serve from the first global step on): the keeper's, in the methods above."""
