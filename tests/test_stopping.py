"""A peer that is stopped or killed leaves nothing behind: SIGTERM is the graceful leave Ctrl-C is (a checkpoint, a
goodbye, exit 0), mid-step and mid-round; and when the main process dies by SIGKILL, every process it started
(hivemind's DHT and averagers, the p2p daemon) exits by itself within seconds.

Signals here go to the main process only (`kill PID`, as `docker stop` sends them): that is what left hivemind's
processes running before. A signal to every process at once (a terminal's Ctrl-C, systemd's and Slurm's stop) is
tests/test_train.py's `test_a_signal_to_the_whole_group_saves_a_checkpoint_and_says_goodbye`.
"""

import json
import os
import re
import signal
import time
from contextlib import suppress

import psutil
import pytest

from tests.support.commands import PEER_ARGS
from tests.support.swarm_runs import MonitorProcess, SwarmRun

pytestmark = pytest.mark.e2e

ORPHAN_DEADLINE = 10.0  # seconds the processes of a killed peer may take to exit


def processes_below(pid: int) -> list[psutil.Process]:
    """The processes `pid` started (and theirs), as they are now."""
    return psutil.Process(pid).children(recursive=True)


def still_running(processes: list[psutil.Process], within: float) -> list[psutil.Process]:
    """Those of `processes` still running (zombies count as gone) after at most `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        left = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)


def test_sigterm_mid_step_saves_a_checkpoint_and_leaves_no_process(sample_dataset, tmp_path):
    run = SwarmRun(tmp_path, ["--dataset", str(sample_dataset), "--run-id", "term-run", *PEER_ARGS])
    run.start("a")
    run.wait_for_step("a", 2)
    started = processes_below(run.processes["a"].pid)
    assert len(started) >= 3, started  # the DHT, its p2p daemon, the averagers
    os.kill(run.processes["a"].pid, signal.SIGTERM)
    text = run.finish(timeout=120)["a"].text
    assert run.processes["a"].returncode == 0, text
    assert "SIGTERM: leaving after the current batch or round" in text, text
    assert "stopped by SIGTERM" in text and "checkpoint saved" in text and "Goodbye" in text, text
    assert re.search(r"^until then: contributed [\d,]+ samples in \d+ s \(computing", text, re.M), text
    assert "Traceback" not in text, text
    assert json.loads((tmp_path / "a" / "latest.json").read_text())["step"] >= 2
    assert not still_running(started, ORPHAN_DEADLINE)


def test_sigterm_while_waiting_for_a_round_leaves_within_the_bound(sample_dataset, tmp_path):
    """DiLoCo with the synchronous outer step (overlapped rounds never stop training to wait): a has taken its local
    steps and waits in its outer round for b, a slow peer (2 s before each microbatch), then frozen (SIGSTOP).
    SIGTERM ends a's wait at once: checkpoint, goodbye, exit 0, long before the round's timeout. b is slow by its
    own clock, whatever the machine's pace: frozen as soon as a reached step 1, it left a in CI (stop 92) to train
    alone for good, most likely because a had gone on without a b that started late (b's record at step 0, and a at
    step 1 waits for no one at step 0)."""
    args = ["--dataset", str(sample_dataset), "--run-id", "term-round", "--local-steps", "4", "--no-outer-overlap"]
    args += PEER_ARGS
    run = SwarmRun(tmp_path, args)
    run.start("a", "--wait-for-peers", "2")
    run.start("b", fault="slow:2")
    try:
        run.wait_for("a", r"^outer step \d+: waiting for 1 peer to take 4 local steps", timeout=180)
        run.kill("b", signal.SIGSTOP)
        started = processes_below(run.processes["a"].pid)
        signalled = time.monotonic()
        os.kill(run.processes["a"].pid, signal.SIGTERM)
        while run.processes["a"].poll() is None and time.monotonic() - signalled < 60:
            time.sleep(0.1)
        took = time.monotonic() - signalled
    finally:
        run.kill("b", signal.SIGKILL)
        if run.processes["a"].poll() is None:  # never signalled, or it did not leave: nothing is left running
            run.kill("a", signal.SIGKILL)
    text = run.finish(timeout=60)["a"].text
    assert run.processes["a"].returncode == 0 and took < 25, (took, text)  # the round's timeout is 30 s
    assert "stopped by SIGTERM" in text and "checkpoint saved" in text, text
    assert (tmp_path / "a" / "latest.json").is_file()
    assert not still_running(started, ORPHAN_DEADLINE)


@pytest.mark.parametrize("command", ["train", "monitor"])
def test_the_processes_of_a_killed_main_process_exit_by_themselves(command, sample_dataset, tmp_path):
    """SIGKILL (or the OOM killer) gives the main process no chance to clean up: its children see it go."""
    run = SwarmRun(tmp_path, ["--dataset", str(sample_dataset), "--run-id", "kill-run", *PEER_ARGS])
    run.start("a")
    run.wait_for_step("a", 1)
    main = run.processes["a"]
    if command == "monitor":  # the organiser's monitor, with the averagers it downloads checkpoints through
        monitor = MonitorProcess(
            tmp_path / "monitor",
            ["--run-id", "kill-run", "--initial-peers", run.address, "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
             "--refresh", "1", "--checkpoint-every", "1000"],
        )  # fmt: skip
        monitor.start()
        main = monitor.process
        deadline = time.monotonic() + 120
        while "monitoring run" not in monitor.text and time.monotonic() < deadline:
            time.sleep(0.2)
    started = processes_below(main.pid)
    assert len(started) >= 2, started
    os.kill(main.pid, signal.SIGKILL)
    main.wait()
    left = still_running(started, ORPHAN_DEADLINE)
    with suppress(ProcessLookupError):  # the killed peer's group is empty already
        run.kill("a")
    run.finish(timeout=60)
    assert not left, [(p.pid, p.cmdline()) for p in left]

