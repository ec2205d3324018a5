"""Peers of one run started at different times on 127.0.0.1, what their progress lines say, and its monitor.

A volunteer run is peers that arrive whenever they like, leave, or die. `SwarmRun` starts `ttt train`
peers as separate processes at given global steps of the first peer, kills some, and timestamps every line
they print; `PeerLog` reads a peer's lines back: when it synchronised, which rounds it took part in, how
many samples it contributed. Shared by bench/train.py (join-to-first-round, repeated) and
tests/test_train.py (staggered joins, churn).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from tests.support import ROOT, module_command
from tests.support.netns import Testbed

TTT = str(Path(sys.executable).parent / "ttt")
# In a process's environment: a SIGABRT makes it print where each of its threads was (Python's faulthandler).
FAULTHANDLER = {"PYTHONFAULTHANDLER": "1"}
ADDRESS = r"^/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+$"
PROGRESS = re.compile(
    r"^(?:outer )?step\s+(\d+) \| .*?\| (round (\d+)|state download(?:ed|\ failed)|no round \(carried over\))"
)
# A round that left a peer's parameters apart from the others' (training/peer/report.py's `round_note`)
ROUND_APART = re.compile(r"\| round \d+ \((?:in part: results lost|the others' round of step \d+)")
# A joining peer's start: a state downloaded, or step 0 of a fresh run (every peer holds the run's seed: no download)
SYNCHRONISED = re.compile(
    r"^synchronised at global step (\d+) \(state downloaded in ([\d.]+) s\)|^the run is at global step (0):"
)
CONTRIBUTED = re.compile(r"contributed ([\d,]+) samples")
LOSS = re.compile(r"^(?:outer )?step\s+(\d+) \| .*?\| loss ([\d.]+|nan)")
# hivemind's own console lines (its log format: "[ERROR] [hivemind.averaging...]"), which a volunteer should not see
RAW_HIVEMIND = re.compile(r"\[(ERROR|WARN|WARNING|INFO|DEBUG)\]|\[hivemind\.|Traceback")
# hivemind's own log (not the console): a round whose member got only part of the results, or whose reducer only
# part of the pieces; the progress line counts the group all the same
PARTIAL_ROUND = re.compile(
    r"Averaging: received (?!100\.0%)[\d.]+% results|Reducer: received (?!100\.0%)[\d.]+% of input"
)
# a WARN or ERROR line of hivemind's own log: its time and what it says
HIVEMIND_PROBLEM = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) \d+ (?:WARN|ERROR) (.*)$")
# How long a helper (`ttt monitor --assist-averaging`) may take to leave on Ctrl-C: like a trainer, it first lets a
# round in flight end, which the run's --averaging-timeout bounds (60 s in these tests; a helper still in a round whose
# trainers had left took over 60 s in clean-clone run 136), then shuts down.
HELPER_LEAVES = 120
JOIN_GOAL = 3  # global steps from a joiner's state download to the first round it takes part in


def meets_join_goal(steps_to_first_round: int | None) -> bool:
    """Whether a joiner took part in a round within JOIN_GOAL global steps of its download (None: never)."""
    return steps_to_first_round is not None and steps_to_first_round <= JOIN_GOAL


@dataclass
class PeerLog:
    """One peer's printed lines, each with the time (time.monotonic) it appeared."""

    name: str
    lines: list[tuple[float, str]] = field(default_factory=list)
    returncode: int | None = None

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    @property
    def synchronised(self) -> tuple[int, float, float] | None:
        """(global step, time, seconds it took) of the state download a joining peer starts from (0 s at step 0)."""
        for seen, line in self.lines:
            found = SYNCHRONISED.match(line)
            if found:
                return int(found.group(1) or found.group(3)), seen, float(found.group(2) or 0.0)
        return None

    def first_seen(self, pattern: str) -> float:
        """When this peer printed its first line matching PATTERN."""
        return next(seen for seen, line in self.lines if re.search(pattern, line))

    @property
    def rounds(self) -> list[tuple[int, int, float]]:
        """(global step, peers in its gradient round, time) for every step; 0 peers: the state was downloaded (DiLoCo:
        or a round that failed for all its members was carried over)."""
        steps = []
        for seen, line in self.lines:
            found = PROGRESS.match(line)
            if found:
                steps.append((int(found.group(1)), int(found.group(3) or 0), seen))
        return steps

    @property
    def steps_apart(self) -> list[int]:
        """The global steps whose round left this peer apart from its other members, as its line says: the round's
        results came here in part, or it was the others' round of a later step. The peer repairs at its next step."""
        found = [(PROGRESS.match(line), ROUND_APART.search(line)) for _, line in self.lines]
        return [int(progress.group(1)) for progress, apart in found if progress and apart]

    @property
    def losses(self) -> dict[int, float]:
        """Global step -> the mean local loss of the batches this peer computed in it."""
        return {int(m.group(1)): float(m.group(2)) for _, line in self.lines if (m := LOSS.match(line))}

    @property
    def first_round_together(self) -> tuple[int, float] | None:
        """(global step, time) of the first step whose round averaged with another peer."""
        return next(((step, seen) for step, size, seen in self.rounds if size > 1), None)

    @property
    def steps_to_first_round(self) -> int | None:
        """Global steps from the state download to the first round with others (1: the very next step)."""
        if self.synchronised is None or self.first_round_together is None:
            return None
        return self.first_round_together[0] - self.synchronised[0]

    @property
    def seconds_to_first_round(self) -> float | None:
        if self.synchronised is None or self.first_round_together is None:
            return None
        return self.first_round_together[1] - self.synchronised[1]

    @property
    def rounds_together(self) -> int:
        return sum(size > 1 for _, size, _ in self.rounds)

    @property
    def contributed(self) -> int:
        found = CONTRIBUTED.search(self.text)
        return int(found.group(1).replace(",", "")) if found else 0


def start_ttt(command: str, args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """`ttt COMMAND ARGS` with its output in LOG, in a session of its own (so that it can be Ctrl-C'd as a
    terminal would: its whole process group)."""
    return start_process([TTT, command, *args], log, env)


def start_process(argv: list[str], log: Path, env: dict | None = None, cwd: Path | None = None) -> subprocess.Popen:
    """ARGV with its output in LOG, in a session of its own (in folder CWD, if given)."""
    return subprocess.Popen(
        argv,
        cwd=cwd,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **FAULTHANDLER, **(env or {})},
    )


class SwarmRun:
    """Peers of one run: the first starts the swarm, every other joins it through the first one's address."""

    def __init__(self, folder: Path, args: list[str]) -> None:
        self.folder, self.args = folder, args  # args: what every peer gets (dataset, run id, settings)
        folder.mkdir(parents=True, exist_ok=True)
        self.processes: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, PeerLog] = {}
        self.address = ""
        self.clock = (time.time(), time.monotonic())  # to put the lines' times (time.monotonic) on the wall clock

    def start(
        self, name: str, *extra: str, env: dict | None = None, fault: str | None = None, join: str | None = None
    ) -> None:
        """Start peer NAME; with `fault`, a peer of tests/support/faulty_peer.py that misbehaves so; with `join`, one
        that joins there (`ttt train --join`: the run's settings from its spec) instead of the first peer's address."""
        joining = ["--join", join] if join else ["--initial-peers", self.address] if self.address else []
        args = [*self.args, "--checkpoint-dir", str(self.folder / name), "--name", name, *joining, *extra]
        if fault:
            self.launch(name, [*module_command("faulty_peer"), fault, *args], env, cwd=ROOT)
        else:
            self.launch(name, [TTT, "train", *args], env)

    def launch(self, name: str, argv: list[str], env: dict | None = None, cwd: Path | None = None) -> None:
        """Start ARGV as peer NAME; the first peer's address is the one the others join with."""
        self.processes[name] = start_process(argv, self.folder / f"{name}.log", env, cwd)
        self.logs[name] = PeerLog(name)
        if not self.address:
            self.address = self.wait_for(name, ADDRESS).group(0)

    def kill(self, name: str, signum: int = signal.SIGKILL) -> None:
        """Signal NAME's whole process group: SIGKILL by default, as a crash or a pulled plug would (no goodbye,
        no checkpoint); SIGINT is a terminal's Ctrl-C."""
        os.killpg(self.processes[name].pid, signum)

    def read(self) -> None:
        """Stamp the lines each peer printed since the last read."""
        now = time.monotonic()
        for name, log in self.logs.items():
            log.returncode = self.processes[name].poll()
            *complete, partial = (self.folder / f"{name}.log").read_text().split("\n")
            if log.returncode is not None and partial:
                complete.append(partial)  # an exited peer's last line is whole, newline or not
            log.lines += [(now, line) for line in complete[len(log.lines) :]]

    def wait_for(self, name: str, pattern: str, timeout: float = 300, after: int = 0) -> re.Match:
        """Until NAME printed PATTERN (in its lines from number AFTER on: what it printed since a moment of the run)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.read()
            found = re.search(pattern, "\n".join(line for _, line in self.logs[name].lines[after:]), re.M)
            if found:
                return found
            if self.logs[name].returncode is not None:
                raise AssertionError(f"{name} exited before printing {pattern!r}:\n{self.logs[name].text}")
            time.sleep(0.1)
        raise AssertionError(f"{name} printed no {pattern!r} within {timeout} s:\n{self.logs[name].text}")

    def wait_for_step(self, name: str, step: int, timeout: float = 300) -> None:
        """Until NAME has reached global step STEP (a catch-up may skip over it)."""
        deadline = time.monotonic() + timeout
        while not any(reached >= step for reached, _, _ in self.logs[name].rounds):
            if time.monotonic() > deadline or self.processes[name].poll() is not None:
                raise AssertionError(f"{name} did not reach global step {step}:\n{self.logs[name].text}")
            time.sleep(0.1)
            self.read()

    def wait_for_exit(self, names: list[str], timeout: float) -> bool:
        """Until every peer of NAMES exited (True), or TIMEOUT seconds passed (False)."""
        deadline = time.monotonic() + timeout
        while any(self.processes[name].poll() is None for name in names):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
            self.read()
        self.read()
        return True

    def finish(self, timeout: float = 600) -> dict[str, PeerLog]:
        """Wait for every peer to exit; their logs."""
        deadline = time.monotonic() + timeout
        while any(process.poll() is None for process in self.processes.values()):
            if time.monotonic() > deadline:
                raise AssertionError(f"peers still running after {timeout} s:\n{self.stop_stragglers()}")
            time.sleep(0.1)
            self.read()
        self.read()
        return self.logs

    def timeline(self) -> str:
        """Every peer's lines and the warnings and errors of its hivemind log (folder/NAME/hivemind.log), in the order
        of the wall clock: what a failed swarm test prints, to tell what happened when."""
        wall, monotonic = self.clock
        events = [
            (datetime.fromtimestamp(wall + seen - monotonic), name, line)
            for name, log in self.logs.items()
            for seen, line in log.lines
        ]
        for name in self.logs:
            log = self.folder / name / "hivemind.log"
            for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
                found = HIVEMIND_PROBLEM.match(line)
                if found:
                    events.append((datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f"), name, found.group(2)))
        events.sort(key=lambda event: event[0])  # stable: a peer's lines read at one moment keep their order
        return "\n".join(f"{when:%H:%M:%S.%f}"[:-5] + f" {name} | {line[:200]}" for when, name, line in events)

    def stop_stragglers(self) -> str:
        """SIGABRT to each peer still running (Python's faulthandler then prints where each of its threads was),
        SIGKILL to its process group a few seconds later; the end of what they printed."""
        stragglers = [name for name, process in self.processes.items() if process.poll() is None]
        for name in stragglers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.processes[name].pid, signal.SIGABRT)
        time.sleep(5)
        for name in stragglers:
            with contextlib.suppress(ProcessLookupError):
                self.kill(name)
            self.processes[name].wait()
        self.read()
        return "\n".join(f"--- {name}:\n" + "\n".join(self.logs[name].text.splitlines()[-60:]) for name in stragglers)


class WanSwarm(SwarmRun):
    """A SwarmRun on the NAT testbed (tests/support/netns.py): each peer runs on the testbed host of its name (or
    HOST), and the first peer's address is the one on the testbed's "Internet" bridge."""

    def __init__(self, net: Testbed, folder: Path, args: list[str]) -> None:
        super().__init__(folder, args)
        self.net = net

    def launch(
        self, name: str, argv: list[str], env: dict | None = None, cwd: Path | None = None, host: str | None = None
    ) -> None:
        host = host or name
        log, environment = (self.folder / f"{name}.log").open("w"), {**os.environ, **(env or {})}
        self.processes[name] = self.net.popen(
            host, argv, stdout=log, stderr=subprocess.STDOUT, env=environment, cwd=cwd
        )
        self.logs[name] = PeerLog(name)
        if not self.address:
            bridge = re.escape(self.net.hosts[host].address)
            self.address = self.wait_for(name, rf"^/ip4/{bridge}/tcp/\d+/p2p/\w+$", timeout=120).group(0)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_auth_server(
    authority: Path, args: list[str], log: Path, env: dict | None = None
) -> tuple[subprocess.Popen, str]:
    """`ttt auth serve --authority AUTHORITY ARGS` on a free port of 127.0.0.1 with its output in LOG: the process and
    its URL, once it answers (60 s at most)."""
    port = free_port()
    serve = ["serve", "--authority", str(authority), "--host", "127.0.0.1", "--port", str(port), *args]
    process, url = start_ttt("auth", serve, log, env), f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the auth server exited with {process.returncode}:\n{log.read_text()}")
        try:
            urllib.request.urlopen(url + "/api/authority", timeout=2).read()
            return process, url
        except OSError:
            time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    raise AssertionError(f"the auth server never answered on {url}:\n{log.read_text()}")


class MonitorProcess:
    """`ttt monitor` for a run, started (and restarted) on one port and one history, read through its API."""

    def __init__(self, folder: Path, args: list[str], env: dict | None = None) -> None:
        self.folder, self.port, self.env = folder, free_port(), env
        self.args = [*args, "--checkpoint-dir", str(folder), "--port", str(self.port)]
        self.url = f"http://127.0.0.1:{self.port}/"
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = self.folder.with_name(f"{self.folder.name}-{self.starts}.log")
        self.process = start_ttt("monitor", self.args, log, self.env)

    @property
    def text(self) -> str:
        return "\n".join(
            self.folder.with_name(f"{self.folder.name}-{n}.log").read_text() for n in range(1, 1 + self.starts)
        )

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=10) as response:
            return response.read()

    def state(self) -> dict:
        return json.loads(self.get("api/state"))

    def wait_for(self, condition: Callable[[dict], bool], timeout: float = 120) -> dict:
        """The first state that meets CONDITION (polled every 0.5 s)."""
        deadline = time.monotonic() + timeout
        last: dict = {}
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"the monitor exited with {self.process.returncode}:\n{self.text}")
            try:
                last = self.state()
            except OSError:  # not serving yet
                last = {}
            if last and condition(last):
                return last
            time.sleep(0.5)
        raise AssertionError(f"the monitor's state never met the condition within {timeout} s: {last}\n{self.text}")

    def stop(self, signum: int = signal.SIGINT, timeout: float = 60) -> int:
        """Signal the monitor's process group and wait for its exit code. One still running after `timeout` is stopped
        with SIGABRT, on which faulthandler writes where each of its threads was into its log, and the test fails with
        the log's end (the CI of stop 68: a monitor that did not stop within 60 s of a Ctrl-C, with no word on why)."""
        os.killpg(self.process.pid, signum)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGABRT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        tail = "\n".join(self.text.splitlines()[-150:])
        raise AssertionError(f"the monitor did not stop within {timeout} s of signal {signum}; its log ends:\n{tail}")
