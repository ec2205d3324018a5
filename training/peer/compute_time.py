"""Where a peer's time goes: the training thread's forward and backward passes and its optimizer steps, from its
first batch on. The rest of its time is what training together cost it: waiting for rounds and for other peers,
state downloads, loading batches, talking to the DHT."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

import torch


class ComputeTime:
    """Seconds the training thread spent computing: forward and backward (timed by the loop) and the steps of the
    optimizers that change this peer's parameters and state (timed by hooks on them). An optimizer step that some
    other thread takes is not counted: it does not hold up the training thread."""

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        self.thread = threading.get_ident()
        self.forward_backward = 0.0
        self.optimizer_steps = 0.0
        self.first_batch_at: float | None = None  # when the first batch began (time.monotonic)
        self.step_began: float | None = None
        for optimizer in optimizers:
            optimizer.register_step_pre_hook(self.step_begins)
            optimizer.register_step_post_hook(self.step_ends)

    def batch_done(self, seconds: float) -> None:
        """One batch's forward and backward took `seconds`."""
        self.forward_backward += seconds
        if self.first_batch_at is None:
            self.first_batch_at = time.monotonic() - seconds

    def step_begins(self, *_) -> None:
        if threading.get_ident() == self.thread:
            self.step_began = time.monotonic()

    def step_ends(self, *_) -> None:
        if threading.get_ident() == self.thread and self.step_began is not None:
            if self.first_batch_at is not None:
                self.optimizer_steps += time.monotonic() - self.step_began
            self.step_began = None

    def shares(self, until: float) -> tuple[float, float]:
        """Forward and backward's share and the optimizer steps' share of the time from the first batch until `until`
        (time.monotonic)."""
        if self.first_batch_at is None or until <= self.first_batch_at:
            return 0.0, 0.0
        elapsed = until - self.first_batch_at
        return self.forward_backward / elapsed, self.optimizer_steps / elapsed
