"""hivemind.Optimizer, made to say what happened in each global step.

hivemind averages a step's gradients in an all-reduce round among the peers that found each other in
matchmaking; a peer that missed the round applies its own gradients alone, and a peer that fell behind
downloads the swarm's state instead of training. Neither shows from outside. `SwarmOptimizer` records,
for every global step, how many peers its gradient round averaged (1: this peer alone), and how long each
state download took, so that the progress line and the published metrics can show who trains together.
"""

from __future__ import annotations

import time

import hivemind
from hivemind.averaging.control import StepControl


def round_size(control: StepControl | None) -> int:
    """Peers in a finished gradient round (this one included); 1 when there was none or it failed."""
    if control is None or not control.done() or control.cancelled():
        return 1
    try:
        return max(1, len(control.result(timeout=0)))
    except BaseException:  # the round failed: hivemind applied this peer's own gradients
        return 1


class SwarmOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer that records each global step's round size and each state download's duration."""

    def __init__(self, *args, **kwargs) -> None:
        self.last_round_size = 1  # peers whose gradients the last global step averaged, this one included
        self.rounds_together = 0  # global steps whose round averaged with at least one other peer
        self.download_seconds: list[float] = []
        super().__init__(*args, **kwargs)

    def _update_global_epoch(self, grad_scaler) -> None:
        self.last_round_size = 1  # unless the round below averages with others
        super()._update_global_epoch(grad_scaler)
        if self.last_round_size > 1:
            self.rounds_together += 1

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control: StepControl | None) -> None:
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)
        self.last_round_size = round_size(maybe_step_control)

    def load_state_from_peers(self, **kwargs) -> None:
        started = time.perf_counter()
        super().load_state_from_peers(**kwargs)
        self.download_seconds.append(time.perf_counter() - started)
