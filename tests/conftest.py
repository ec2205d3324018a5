import ctypes
import os
import signal
import subprocess
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock

from tests.support.commands import DISPLAY_NAMES, MAX_STEPS, SAMPLE_ARGS, SWARM_ARGS, run_ttt, run_ttt_concurrently

CLONE_NEWNET = 0x40000000  # unshare(2): a network namespace of one's own
CPU_MARK = pytest.StashKey[float]()


def pytest_configure(config: pytest.Config) -> None:
    # Ctrl-C reaches the `ttt` commands the tests start, however the suite itself was started: a shell that starts
    # a job in the background (`make test &`, nohup) makes it ignore SIGINT, and its children would inherit that.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        isolate_network()
        # Beside the other workers, torch's OpenMP threads must not spin while they wait for one another: a
        # 2-thread training loop with the other core busy took 15.8 s spinning, 9.2 s passive (8.96 s on one thread).
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def isolate_network() -> None:
    """A parallel worker (pytest-xdist) in a network namespace of its own, with a loopback of its own: the tests of
    different workers never compete for a port (the embedded sample is served on a fixed one) nor see each other's
    peers. Root only, as the NAT tests are; elsewhere the workers share the machine's loopback."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), f"unshare(CLONE_NEWNET): {os.strerror(ctypes.get_errno())}")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)


@pytest.fixture(scope="session")
def sample_dataset(tmp_path_factory) -> Path:
    """One uninterrupted `ttt preprocess` of the embedded sample, shared by the end-to-end tests of every parallel
    worker (the first one to need it makes it)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's folder, which holds each worker's
    out = shared / "sample" / "ttt-data"
    with FileLock(shared / "sample.lock"):
        if not (shared / "sample" / "done").exists():
            run_ttt("preprocess", *SAMPLE_ARGS, "--dataset", out)
            (shared / "sample" / "done").touch()
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
    refused: subprocess.CompletedProcess  # a volunteer who joined with a run option other than the spec's
    status: list  # `ttt status` during the run: through the monitor's multiaddress with --json, and through its URL


@pytest.fixture(scope="session")
def swarm(sample_dataset, tmp_path_factory) -> Swarm:
    """A run as strangers make it: the organiser writes its spec (`ttt run init`), A starts it from the spec and
    waits for a second peer, the organiser's monitor joins (from the spec too), B joins through the monitor's URL
    before the first step, C through A's address once the run is under way (at A's step 3): B and C with `--join`
    and no option of the run; at step 7, a volunteer who also gives another --optimizer. The monitor is SIGKILLed at
    step 4 and restarted on the same history; at step 7 a real browser opens its dashboard and join page, and `ttt
    status` reads the run."""
    from tests.support.browser import open_dashboard, open_join
    from tests.support.swarm_runs import MonitorProcess, SwarmRun

    root = tmp_path_factory.mktemp("swarm")
    spec = root / "run.toml"
    run_ttt("run", "init", "--run-id", "test-run", "--dataset", sample_dataset, "--out-file", spec)
    run = SwarmRun(root, ["--max-steps", str(MAX_STEPS), *SWARM_ARGS])
    run.start("a", "--run", str(spec), "--wait-for-peers", "2", "--name", DISPLAY_NAMES["a"])
    monitor = MonitorProcess(
        root / "monitor",
        ["--run", spec, "--initial-peers", run.address, "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
         "--refresh", "1", "--checkpoint-every", "5", "--preview-prompt", "a red circle",
         "--push-to", "hf://ttt-tests/monitor-run", "--dry-run"],
    )  # fmt: skip
    monitor.start()
    monitor.wait_for(lambda state: state["join"]["spec"] is not None)
    run.start("b", "--name", DISPLAY_NAMES["b"], join=monitor.url)
    run.wait_for_step("a", 3)
    run.start("c", "--name", DISPLAY_NAMES["c"], join=run.address)
    before_kill = monitor.wait_for(lambda state: state["global_step"] >= 4)
    os.killpg(monitor.process.pid, signal.SIGKILL)  # no goodbye: the history must hold what it had
    monitor.process.wait()
    monitor.start()
    run.wait_for_step("a", 7)
    during = monitor.wait_for(lambda state: state["active_peers"] >= 3 and state["global_step"] >= 7)
    # Beside what follows, while the run trains: `ttt status` through the monitor's multiaddress and through its URL,
    # and a volunteer who joins with another --optimizer than the run's. Through the monitor, which stays to the end:
    # on this loaded machine a command can take longer to start than the run's last steps, and A may have left.
    monitor_address = during["join"]["addresses"][0]
    volunteer = ["--join", monitor_address, "--optimizer", "adam-8bit", "--checkpoint-dir", root / "refused"]
    asked = [["status", monitor_address, "--json"], ["status", monitor.url], ["train", *volunteer, *SWARM_ARGS]]
    with ThreadPoolExecutor(1) as background:
        answers = background.submit(run_ttt_concurrently, asked, timeout=120)
        during = monitor.wait_for(lambda state: state["join"]["wheel"], 300)  # built while the run trains
        wheel = monitor.get("wheel/" + during["join"]["wheel"])
        dashboard = open_dashboard(monitor.url, root / "dashboard.png")
        join = open_join(monitor.url + "join", root / "join.png")
    *status, refused = answers.result()
    logs = run.finish()
    contributed = {DISPLAY_NAMES[name]: log.contributed for name, log in logs.items()}
    final = monitor.wait_for(lambda state: {p["name"]: p["samples"] for p in state["peers"]} == contributed, 60)
    metrics_text = monitor.get("metrics").decode()
    preview = monitor.get(final["previews"]["images"][0]["url"].lstrip("/")) if final["previews"] else b""
    stop_code = monitor.stop()
    seen = MonitorSeen(monitor, before_kill, during, final, metrics_text, preview, dashboard, join, wheel, stop_code)
    return Swarm(root, logs, seen, refused, status)


# What starts ttt's processes (a dataset, peers, servers, a browser): a test that requests one of these fixtures, or
# whose code reaches one of these names through the functions it calls, is marked e2e (`make test-fast` leaves it out).
E2E_FIXTURES = {"sample_dataset", "swarm", "auth_server", "trained_demo", "tiny_checkpoint", "web", "encoded",
                "dataset", "gumbel_ckpt", "short_run", "image_server", "output"}  # fmt: skip
E2E_NAMES = {"run_ttt", "run_ttt_concurrently", "swarm_run", "SwarmRun", "start_ttt", "MonitorProcess", "Popen"}
# What starts a whole swarm (peers that must meet, average and leave): the longest tests, which the parallel workers
# start first so that none of them is left running alone at the end.
SCENARIO_FIXTURES = {"swarm", "trained_demo"}
SCENARIO_NAMES = {"swarm_run", "SwarmRun", "WanSwarm", "MonitorProcess", "AuthRun", "run_readme_section"}


def reaches_names(code: types.CodeType, namespace: dict, names: set[str], seen: set | None = None) -> bool:
    """Whether `code` uses one of `names`, itself, in its nested functions or in the functions it calls."""
    seen = set() if seen is None else seen
    if code in seen:
        return False
    seen.add(code)
    if set(code.co_names) & names:
        return True
    nested = [(const, namespace) for const in code.co_consts if isinstance(const, types.CodeType)]
    called = [namespace.get(name) for name in code.co_names]
    called = [
        (function.__code__, function.__globals__) for function in called if isinstance(function, types.FunctionType)
    ]
    return any(reaches_names(inner, globals_, names, seen) for inner, globals_ in nested + called)


def reaches(item: pytest.Item, fixtures: set[str], names: set[str]) -> bool:
    """Whether the test requests one of `fixtures` or its code reaches one of `names` (see `reaches_names`)."""
    function = item.function
    return bool(set(item.fixturenames) & fixtures) or reaches_names(function.__code__, function.__globals__, names)


def shared_fixture_group(item: pytest.Item) -> str | None:
    """The parallel worker group of a test that shares a fixture of module or session scope with others: they run in
    one worker, which makes the fixture once (`sample_dataset` is shared between workers through a lock)."""
    for name, definitions in item._fixtureinfo.name2fixturedefs.items():
        fixture = definitions[-1]
        if not fixture.func.__module__.startswith("tests.") or name == "sample_dataset":
            continue  # pytest's own (tmp_path_factory...), or shared between workers
        if fixture.scope == "session":
            return name
        if fixture.scope == "module":
            return item.module.__name__
    return None


def pytest_collection_finish(session: pytest.Session) -> None:
    grouped = [item for item in session.items if item.get_closest_marker("xdist_group")]
    if session.config.getoption("loadgroup", False) and any("@" not in item.nodeid for item in grouped):
        raise pytest.UsageError(
            "pytest-xdist ignores the test groups with this pytest (tests sharing a fixture would each make it): "
            "install the versions pyproject.toml names (make install)"
        )


def run_order(item: pytest.Item) -> int:
    """Swarm scenarios first, then the other end-to-end tests, then the unit tests."""
    if reaches(item, SCENARIO_FIXTURES, SCENARIO_NAMES):
        return 0
    return 1 if item.get_closest_marker("e2e") else 2


def cpu_seconds() -> float:
    """CPU time of this process and of its children that ended and were waited for (a `ttt` command's, with its
    own waited-for children): what a test's commands cost, unlike its wall time, which waiting also fills."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    item.stash[CPU_MARK] = cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    """Each phase's report carries the CPU seconds the phase took (a shared fixture's: its first test's setup)."""
    report = (yield).get_result()
    now = cpu_seconds()
    report.user_properties = [*report.user_properties, ("cpu_s", now - item.stash.get(CPU_MARK, now))]
    item.stash[CPU_MARK] = now


def pytest_terminal_summary(terminalreporter) -> None:
    """The phases that took the most CPU (beside `--durations`' wall times): the suite's 2 cores are its limit."""
    phases = [
        (dict(report.user_properties)["cpu_s"], report.when, report.nodeid)
        for reports in terminalreporter.stats.values()
        for report in reports
        if isinstance(report, pytest.TestReport) and "cpu_s" in dict(report.user_properties)
    ]
    if not phases or not terminalreporter.config.getoption("durations"):
        return
    terminalreporter.write_sep("=", f"most CPU (of {sum(cpu for cpu, _, _ in phases):.0f} CPU-seconds in all)")
    for cpu, when, nodeid in sorted(phases, reverse=True)[: terminalreporter.config.getoption("durations")]:
        terminalreporter.write_line(f"{cpu:7.2f}s {when:8} {nodeid}")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the groups
def pytest_collection_modifyitems(items: list) -> None:
    for item in items:
        if reaches(item, E2E_FIXTURES, E2E_NAMES):
            item.add_marker(pytest.mark.e2e)
        group = shared_fixture_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=run_order)  # a stable sort: the order within each kind is kept
