import os
import signal
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.commands import DISPLAY_NAMES, MAX_STEPS, SAMPLE_ARGS, run_ttt, swarm_run


@pytest.fixture(scope="session")
def sample_dataset(tmp_path_factory) -> Path:
    """One uninterrupted `ttt preprocess` of the embedded sample, shared by the end-to-end tests."""
    out = tmp_path_factory.mktemp("sample") / "ttt-data"
    run_ttt("preprocess", *SAMPLE_ARGS, "--output", out)
    return out


@dataclass
class MonitorSeen:
    """What the run's monitor showed: its API before it was killed, after its restart, at the end; the pages."""

    process: object  # swarm_runs.MonitorProcess
    before_kill: dict
    during: dict
    final: dict
    metrics_text: str
    preview: bytes  # the first preview image, as the dashboard loads it
    dashboard: dict  # browser.PageReport
    join: dict
    wheel: bytes  # the wheel the Join page's install line points at
    stop_code: int


@dataclass
class Swarm:
    root: Path
    logs: dict  # name -> swarm_runs.PeerLog
    monitor: MonitorSeen


@pytest.fixture(scope="session")
def swarm(sample_dataset, tmp_path_factory) -> Swarm:
    """A run as strangers make it: A starts it and waits for a second peer, the organiser's monitor joins, B joins
    before the first step, C once the run is under way (at A's step 3). The monitor is SIGKILLed at step 4 and
    restarted on the same history; at step 7 a real browser opens its dashboard and join page."""
    from tests.support.browser import open_dashboard, open_join
    from tests.support.swarm_runs import MonitorProcess

    root = tmp_path_factory.mktemp("swarm")
    run = swarm_run(sample_dataset, root, "test-run", MAX_STEPS)
    run.start("a", "--wait-for-peers", "2", "--name", DISPLAY_NAMES["a"])
    monitor = MonitorProcess(
        root / "monitor",
        ["--run-id", "test-run", "--initial-peers", run.address, "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
         "--refresh", "1", "--checkpoint-every", "5", "--preview-prompt", "a red circle",
         "--push-to", "hf://ttt-tests/monitor-run", "--dry-run"],
    )  # fmt: skip
    monitor.start()
    run.start("b", "--name", DISPLAY_NAMES["b"])
    run.wait_for_step("a", 3)
    run.start("c", "--name", DISPLAY_NAMES["c"])
    before_kill = monitor.wait_for(lambda state: state["global_step"] >= 4)
    os.killpg(monitor.process.pid, signal.SIGKILL)  # no goodbye: the history must hold what it had
    monitor.process.wait()
    monitor.start()
    run.wait_for_step("a", 7)
    during = monitor.wait_for(lambda state: state["active_peers"] >= 3 and state["global_step"] >= 7)
    during = monitor.wait_for(lambda state: state["join"]["wheel"], 300)  # built while the run trains
    wheel = monitor.get("wheel/" + during["join"]["wheel"])
    dashboard = open_dashboard(monitor.url, root / "dashboard.png")
    join = open_join(monitor.url + "join", root / "join.png")
    logs = run.finish()
    contributed = {DISPLAY_NAMES[name]: log.contributed for name, log in logs.items()}
    final = monitor.wait_for(lambda state: {p["name"]: p["samples"] for p in state["peers"]} == contributed, 60)
    metrics_text = monitor.get("metrics").decode()
    preview = monitor.get(final["previews"]["images"][0]["url"].lstrip("/")) if final["previews"] else b""
    stop_code = monitor.stop()
    seen = MonitorSeen(monitor, before_kill, during, final, metrics_text, preview, dashboard, join, wheel, stop_code)
    return Swarm(root, logs, seen)


# What starts ttt's processes (a dataset, peers, servers, a browser): a test that requests one of these fixtures, or
# whose code reaches one of these names through the functions it calls, is marked e2e (`make test-fast` leaves it out).
E2E_FIXTURES = {"sample_dataset", "swarm", "auth_server", "trained_demo", "tiny_checkpoint", "web", "encoded",
                "dataset", "gumbel_ckpt", "short_run", "image_server", "output"}  # fmt: skip
E2E_NAMES = {"run_ttt", "run_ttt_concurrently", "swarm_run", "SwarmRun", "start_ttt", "MonitorProcess", "Popen"}


def reaches_e2e_names(code: types.CodeType, namespace: dict, seen: set) -> bool:
    """Whether `code` names one of E2E_NAMES, itself, in its nested functions or in the functions it calls."""
    if code in seen:
        return False
    seen.add(code)
    if set(code.co_names) & E2E_NAMES:
        return True
    nested = [(const, namespace) for const in code.co_consts if isinstance(const, types.CodeType)]
    called = [namespace.get(name) for name in code.co_names]
    called = [
        (function.__code__, function.__globals__) for function in called if isinstance(function, types.FunctionType)
    ]
    return any(reaches_e2e_names(inner, names, seen) for inner, names in nested + called)


def pytest_collection_modifyitems(items: list) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        function = item.function
        if fixtures & E2E_FIXTURES or reaches_e2e_names(function.__code__, function.__globals__, set()):
            item.add_marker(pytest.mark.e2e)
