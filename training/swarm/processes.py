"""hivemind's background processes (the DHT, each averager) and its logging, as a volunteer's console needs them.

hivemind forks a process for the DHT and one per averager; they inherit the main process's signal handlers and
log through hivemind's own logger. A volunteer's console shows ttt's lines: hivemind's teardown noise and the
tracebacks of recoverable averaging failures stay out of it.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager


def thread_error_in_one_line(args: threading.ExceptHookArgs) -> None:
    print(f"hivemind {args.thread.name}: {args.exc_type.__name__}: {args.exc_value}", file=sys.stderr, flush=True)


@contextmanager
def quiet_hivemind_children() -> Iterator[None]:
    """Processes forked inside (hivemind's DHT and averagers) ignore Ctrl-C and report thread errors in one line.

    A terminal's Ctrl-C reaches the whole process group: only the main process acts on it, then shuts
    the children down in order. The Ctrl-C also stops hivemind's p2p daemon (Go turns an ignored SIGINT
    back on), so an averager leaving afterwards cannot unregister from it; by then the checkpoint is saved.
    """
    previous_handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    previous_hook, threading.excepthook = threading.excepthook, thread_error_in_one_line
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous_handler)
        threading.excepthook = previous_hook


def without_traceback(record: logging.LogRecord) -> bool:
    """A log filter that keeps a record's message but drops its traceback (hivemind logs recoverable
    averaging failures, such as finding no group for a round, with full tracebacks)."""
    record.exc_info, record.exc_text = None, None
    return True


def quiet_hivemind_logs() -> None:
    """hivemind's background processes log cancelled matchmaking futures and teardown noise that says nothing
    about the run; our own progress lines and errors say what matters."""
    hivemind_logger = logging.getLogger("hivemind")
    hivemind_logger.setLevel(logging.ERROR)
    for handler in hivemind_logger.handlers:
        handler.addFilter(without_traceback)
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
