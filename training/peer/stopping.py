"""How a peer is stopped: Ctrl-C, SIGTERM (systemd, `docker stop`, Kubernetes, Slurm's preemption, a notebook's
restart) and SIGHUP (a closed terminal) all ask for the same graceful leave.

The first signal asks the loop to stop at its next safe point: after the current batch, or once the averaging
round in flight ends (hivemind bounds it by --averaging-timeout). The peer then writes its checkpoint, tells the
swarm and stops hivemind's processes. Should that take longer than `leave_within` seconds, or should a second
signal come, the peer leaves at once: its processes are stopped and it exits, with the checkpoint if it was written
by then (its last line says which).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

from rich.console import Console

from training.swarm.processes import STOP_SIGNALS, exit_now

LEAVE_MARGIN = 30.0  # seconds to save and shut down, beyond a round in flight


class StopSignals:
    """While entered, the stop signals set `received` instead of ending the process."""

    def __init__(self, console: Console, leave_within: float) -> None:
        self.console, self.leave_within = console, leave_within
        self.received: signal.Signals | None = None
        self.checkpoint_saved = False  # set by the loop once the leave's checkpoint is written
        self.previous: dict[int, object] = {}
        self.deadline: threading.Timer | None = None

    def requested(self) -> bool:
        """Whether a stop signal came."""
        return self.received is not None

    def __enter__(self) -> StopSignals:
        self.previous = {signum: signal.signal(signum, self.handle) for signum in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        if self.deadline is not None:
            self.deadline.cancel()

    def handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            self.console.print(f"{name} again: leaving at once, {self.checkpoint_note()}")
            exit_now(128 + signum)
        self.received = signal.Signals(signum)
        self.console.print(
            f"{name}: leaving after the current batch or round, with a checkpoint (within {self.leave_within:.0f} s; "
            "send it again to leave at once)"
        )
        self.deadline = threading.Timer(self.leave_within, self.too_slow)
        self.deadline.daemon = True
        self.deadline.start()

    def too_slow(self) -> None:
        self.console.print(
            f"could not leave within {self.leave_within:.0f} s: leaving at once, {self.checkpoint_note()}"
        )
        exit_now(1)

    def checkpoint_note(self) -> str:
        """What a leave cut short keeps: the checkpoint, if the loop wrote it before (a shutdown that hangs after)."""
        return "its checkpoint saved" if self.checkpoint_saved else "without a checkpoint"
