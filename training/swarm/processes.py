"""hivemind's background processes (the DHT, each averager, the DHT's p2p daemon) and its logging.

hivemind forks a process for the DHT and one per averager; they inherit the main process's signal handlers and
log through hivemind's own logger. Here they are made to behave as a volunteer needs:
- a terminal's Ctrl-C (and hangup), and a service manager's SIGTERM to every process, reach only the main process's
  handler, which shuts them down in order (a SIGTERM from the main process still ends them);
- they exit by themselves when the main process dies, however it dies (`watch_the_parent`);
- their threads can run torch's parallel operations at once (`renew_torch_thread_pool`);
- `exit_now` stops all of them at once (a second Ctrl-C or SIGTERM);
- tensors cross to them as file descriptors, not files of torch's shm manager (`share_tensors_by_descriptor`);
- they and the main process hold less memory (`lighten_the_processes`);
- the console shows ttt's lines: hivemind's own log goes to a file (`log_hivemind_to`), and so do the errors its
  objects' destructors raise (an `MPFuture` collected at exit, after its event loop closed, printed a traceback).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import multiprocessing
import multiprocessing.util
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import NoReturn

STOP_GRACE = 2.0  # seconds a process stopped with SIGTERM has to exit before SIGKILL
# What keeps a peer's processes light, each undone by its variable for bench/memory.py's baseline:
HEAP_TRIM_SECONDS = float(os.environ.get("TTT_HEAP_TRIM_SECONDS", "1"))  # between two trims of a heap (0: never)
GC_FREEZE = os.environ.get("TTT_GC_FREEZE", "1") == "1"  # freeze the objects there are before a fork
TRIM_WHEN_BUSY_BELOW = 0.5  # cores a process ran or was ready to run in a period: busier, it reuses its freed pages
HIVEMIND_LOG = "hivemind.log"  # hivemind's own log, in a peer's (or a monitor's) checkpoint folder


def thread_error_in_hivemind_log(args: threading.ExceptHookArgs) -> None:
    """An error in a thread of hivemind's goes to hivemind's log, not to the volunteer's console."""
    logging.getLogger("hivemind").error(f"thread {args.thread.name}: {args.exc_type.__name__}: {args.exc_value}")


def destructor_error_in_hivemind_log(args: sys.UnraisableHookArgs) -> None:
    """An error that one of hivemind's objects raised where Python cannot pass it on (a destructor, often at exit)
    goes to hivemind's log; any other goes to Python's default hook, which prints it."""
    if not getattr(args.object, "__module__", "").startswith("hivemind"):
        sys.__unraisablehook__(args)
        return
    with suppress(Exception):  # late in the interpreter's exit, logging itself may be gone
        where = getattr(args.object, "__qualname__", args.object)
        logging.getLogger("hivemind").error(f"ignored in {where}: {args.exc_type.__name__}: {args.exc_value}")


@contextmanager
def quiet_hivemind_children() -> Iterator[None]:
    """Processes forked inside (hivemind's DHT and averagers) ignore Ctrl-C, hangups and a SIGTERM that is not their
    parent's, report thread errors to hivemind's log, exit when the main process dies, and renew torch's thread pool
    before their threads use it.

    A terminal's Ctrl-C (or its closing: SIGHUP) reaches the whole process group, and a service manager's SIGTERM
    every process of its unit or job (systemd's default KillMode, Slurm): only the main process acts on them, then
    shuts the children down in order (`sigterm_from_the_parent_only`). The signal also stops hivemind's p2p daemon
    (Go turns an ignored SIGINT back on, and acts on SIGTERM), so an averager leaving afterwards cannot unregister
    from it; by then the checkpoint is saved.
    """
    share_tensors_by_descriptor()
    lighten_the_processes()
    PARENT_SIGTERM.install()
    PARENT_WATCH.install()
    TORCH_THREAD_POOL.install()
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in (signal.SIGINT, signal.SIGHUP)}
    # blocked, not ignored: a SIGTERM to this process meanwhile waits for the end of the block
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, SIGTERM_WATCHED)
    previous_hook, threading.excepthook = threading.excepthook, thread_error_in_hivemind_log
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        threading.excepthook = previous_hook


def share_tensors_by_descriptor() -> None:
    """Tensors shared with hivemind's processes cross as file descriptors (torch's default on Linux), not as files in
    /dev/shm that torch's shm manager serves (the strategy hivemind sets as it is imported). That is one process fewer
    per peer (torch_shm_manager: 51-56 MB private of a tiny peer's 350-361), no files left in /dev/shm by a peer that
    is killed (each a tensor's worth of memory, held until the machine restarts), and no "Shared memory manager
    connection has timed out" under load. Each shared tensor holds a descriptor in each process that holds it, so
    the soft limit on open files rises to the hard one."""
    import hivemind.utils.mpfuture  # noqa: F401 (sets hivemind's strategy as it is imported: first, so ours holds)
    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def log_hivemind_to(path: Path) -> None:
    """hivemind's log lines (its own, its p2p daemon's, its threads' and destructors' errors) go to the file `path`,
    appended, never to the console: a volunteer's console shows ttt's lines, and the progress line says what matters.
    Processes forked later write to the same file. The level is hivemind's (HIVEMIND_LOGLEVEL, INFO by default)."""
    from hivemind.utils import logging as hivemind_logging

    hivemind_logging.use_hivemind_log_handler("nowhere")  # no more console handler
    hivemind_logger = logging.getLogger("hivemind")
    for handler in list(hivemind_logger.handlers):
        hivemind_logger.removeHandler(handler)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"))
    hivemind_logger.addHandler(handler)
    hivemind_logger.propagate = False
    hivemind_logger.setLevel(os.environ.get("HIVEMIND_LOGLEVEL", "INFO").upper())
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    sys.unraisablehook = destructor_error_in_hivemind_log


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux's /proc; none elsewhere)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def descendants_of(pid: int) -> list[int]:
    """Every process below `pid`: its children, theirs, and so on."""
    found, frontier = [], [pid]
    while frontier:
        children = [child for parent in frontier for child in children_of(parent)]
        found += children
        frontier = children
    return found


def stop_processes(pids: list[int], grace: float = STOP_GRACE) -> None:
    """SIGTERM each process, then SIGKILL those still alive after `grace` seconds."""
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.05)
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie that its parent has not reaped yet counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # Ctrl-C, a service manager, a closed terminal


def exit_now(code: int) -> NoReturn:
    """Leave at once: stop every process this one started (hivemind's, and their p2p daemon), then exit."""
    stop_processes(descendants_of(os.getpid()))
    os._exit(code)


class InEveryChild:
    """Runs `action` in every process forked from here (by multiprocessing, as hivemind forks) once `install` was
    called: installed once per process, whatever calls it."""

    def __init__(self, action: Callable[[], None]) -> None:
        self.action, self.installed = action, False

    def install(self) -> None:
        if not self.installed:
            multiprocessing.util.register_after_fork(self, InEveryChild.run)
            self.installed = True

    def run(self) -> None:
        self.action()


class InEveryProcess(InEveryChild):
    """Runs `action` here too (once, with `start_here`), besides in every process forked from here."""

    def __init__(self, action: Callable[[], None]) -> None:
        super().__init__(action)
        self.started_here = False

    def start_here(self) -> None:
        if not self.started_here:
            self.action()
            self.started_here = True


def watch_the_parent() -> None:
    """Makes a forked process exit by itself when its parent dies, however it dies (SIGKILL, the OOM killer): a thread
    waits on multiprocessing's parent sentinel, a pipe that closes with the parent, then stops the process's own
    children (the DHT's p2p daemon) and exits. Without it, hivemind's DHT and averager processes outlive a killed peer
    for good (seen: 4 processes, about 2.2 GB, still there 36 minutes later)."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=exit_with, args=(parent,), name="parent-watch", daemon=True).start()


def exit_with(parent: multiprocessing.process.BaseProcess) -> None:
    parent.join()  # returns when the parent's end of the sentinel pipe closes: the parent is gone
    exit_now(0)


def sigterm_from_the_parent_only() -> None:
    """Makes a forked process end on SIGTERM only when its parent sends it (hivemind's shutdown of an averager that
    does not stop in time, multiprocessing's exit, `exit_now`). One sent to every process at once, as systemd
    (KillMode=control-group, its default) and Slurm stop a service or a job, is left to the main process, which
    shuts this one down in order: children that died of it left the main process's calls into its DHT hanging, and
    the peer left when its leave timed out, with status 1. The process was forked with SIGTERM blocked
    (`quiet_hivemind_children`), as are the threads it starts, and a thread takes each SIGTERM with its sender."""
    if SIGTERM_WATCHED:
        threading.Thread(target=exit_on_sigterm_from, args=(os.getppid(),), name="sigterm-watch", daemon=True).start()


def exit_on_sigterm_from(parent: int) -> None:
    """Take each SIGTERM with its sender, and exit on the first that `parent` sent."""
    while signal.sigwaitinfo(SIGTERM_WATCHED).si_pid != parent:
        pass
    exit_now(128 + signal.SIGTERM)


def renew_torch_thread_pool() -> None:
    """Makes a forked process renew torch's thread pool at once, in its only thread. torch replaces the pool a fork
    left behind lazily, in the first thread that runs a parallel operation, and two threads doing so at once race:
    one gets "pool INTERNAL ASSERT FAILED ... Invalid thread pool!" (seen in a DiLoCo averager reducing two senders'
    parts at once: the round failed for all three peers; tests/test_processes.py forks 30 times)."""
    import torch

    torch.set_num_threads(torch.get_num_threads())


def lighten_the_processes() -> None:
    """Less private memory in each of a peer's processes (docs/scale.md#memory-per-peer; `python -m bench.memory`
    measures it against none of it):
    - every process gives its heap's free pages back to the system now and then (`trim_the_heap_now_and_then`);
    - the objects there are when hivemind forks are frozen first (`gc.freeze`): a forked process's garbage
      collector no longer writes into each of them, which copied every page holding one into the process.
    """
    HEAP_TRIM.start_here()
    HEAP_TRIM.install()
    if GC_FREEZE:
        gc.freeze()


def trim_the_heap_now_and_then() -> None:
    """Starts a thread that gives the free pages of this process's heap back to the system every
    `HEAP_TRIM_SECONDS` in which the process mostly waited (glibc's `malloc_trim`; nothing where the C library has
    none).

    glibc raises its threshold for mapping a block on its own to the largest block freed so far, up to 32 MB, so
    after a peer's first rounds the gradients' and messages' buffers of a few MB come from the heap, and freeing them
    keeps their pages: measured, most of a tiny trainer's heap was free memory held so (docs/scale.md). A trim gives
    them back in one call; the next step maps them again, a page fault per page, once per trim rather than per
    block as a lower fixed threshold would (that one cost a third of the plain loop's speed).

    A process busy for half a core or more of the last period (a peer computing its steps) is not trimmed: it takes
    its freed pages back within the second, and giving them back each second cost a compute-bound peer (the demo's,
    alone) about a fifth of its speed in page faults (one run each). Busy counts the time it was ready to run and
    waited for a core too (`ready_to_run_seconds`): on a machine whose cores other processes load, a computing
    process got 0.28-0.37 of a core in some periods and was trimmed as if it had waited. A tiny peer of a swarm
    waits for its rounds for most of each step, and is trimmed then."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None and HEAP_TRIM_SECONDS > 0:
        threading.Thread(
            target=trim_the_heap_every, args=(trim, HEAP_TRIM_SECONDS), name="heap-trim", daemon=True
        ).start()


def trim_the_heap_every(trim: Callable[[int], int], seconds: float) -> NoReturn:
    busy = ready_to_run_seconds()
    while True:
        time.sleep(seconds)
        now = ready_to_run_seconds()
        if now - busy < TRIM_WHEN_BUSY_BELOW * seconds:
            trim(0)
        busy = now


def ready_to_run_seconds() -> float:
    """The seconds this process ran (its CPU time, all its threads') and those its live threads were ready to run but
    waited for a core (Linux's /proc schedstat; none elsewhere). A thread that ended takes its wait with it, so a
    period in which one did may count less than it was."""
    waited = 0
    for stat in Path("/proc/self/task").glob("*/schedstat"):
        with suppress(OSError, ValueError, IndexError):  # a thread that ended meanwhile; a kernel without the field
            waited += int(stat.read_text().split()[1])
    return time.process_time() + waited / 1e9


HEAP_TRIM = InEveryProcess(trim_the_heap_now_and_then)
PARENT_WATCH = InEveryChild(watch_the_parent)
PARENT_SIGTERM = InEveryChild(sigterm_from_the_parent_only)
# Linux tells a signal's sender (sigwaitinfo); elsewhere hivemind's processes keep SIGTERM's default
SIGTERM_WATCHED = {signal.SIGTERM} if hasattr(signal, "sigwaitinfo") else set()
TORCH_THREAD_POOL = InEveryChild(renew_torch_thread_pool)


def add_p2pd_flags(flags: dict) -> None:
    """Give every p2p daemon this process starts from now on these extra command-line flags, ones `P2P.create` has
    no option for (bench/wan_probe.py's experiments with relays)."""
    from hivemind.p2p import P2P

    original = P2P._make_process_args

    def with_flags(*args, **kwargs) -> list[str]:
        return original(*args, **{**kwargs, **flags})

    P2P._make_process_args = staticmethod(with_flags)
