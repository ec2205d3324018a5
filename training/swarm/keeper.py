"""The run's state, kept by a public helper (`ttt monitor --assist-averaging`) that trains on nothing.

A peer that missed a round, or joins, downloads the swarm's state from a peer that serves it. Peers behind NAT
join in client mode: nobody can dial them, so they serve nothing, and in a run whose trainers are all behind NAT
no state could be downloaded at all (measured: every home that missed a round kept its own parameters, found
itself behind again at the next step, and half of all rounds were short of a peer).

`KeeperOptimizer` is the helper's optimizer: a member of every gradient round like a trainer, with weight 0 (it
sends zeros that count for nothing: hivemind's own "tag along" mode, which the robust reducer also leaves out of
its statistics), it applies the round's average with the run's optimizer as the trainers do, and so holds the
parameters and optimizer state they hold, which it serves to anyone who asks, being reachable. In a run of home
peers every round goes through a reachable peer anyway (client-mode peers cannot reduce), so the helper is in
each round that succeeds. It joins the state rounds too, which bring its parameters back to the swarm's.
"""

from __future__ import annotations

from training.swarm.optimizer import SwarmOptimizer


class KeeperOptimizer(SwarmOptimizer):
    """A SwarmOptimizer that accumulates no samples: each `step()` reports progress without any, and a global
    step averages its zero gradients with weight 0, then applies the round's average.

    It serves its state only while it holds the swarm's: after a global step in a round with others, or a state
    downloaded. A step without a round applies its zero gradients alone (hivemind's fallback), which leaves
    parameters nobody else holds: it stops serving and downloads the state at once (in a run of home peers
    nobody serves one, and it serves again after its next round with them)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.state_averager.allow_state_sharing = False  # not before its first round: the trainers' own seed

    def _check_and_accumulate_gradients(self, batch_size: int, grad_scaler) -> bool:
        if self.tracker.local_progress.epoch != self.local_epoch:  # hivemind reports again by itself meanwhile
            self.tracker.report_local_progress(self.local_epoch, samples_accumulated=0)
        return True

    def _update_global_epoch(self, grad_scaler) -> None:
        super()._update_global_epoch(grad_scaler)
        self.state_averager.allow_state_sharing = self.last_round_size > 1
        if self.last_round_size == 1:
            self.load_state_from_peers()

    def load_state_from_peers(self, **kwargs) -> None:
        serving = self.state_averager.allow_state_sharing
        super().load_state_from_peers(**kwargs)
        self.state_averager.allow_state_sharing = serving or self.downloads[-1].arrived

    def serve_state_once_stepped(self) -> None:
        """Not the trainers' rule (serve from the first global step on): the keeper's, in the two methods above."""
