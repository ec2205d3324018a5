import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# The bench's helpers that drive peers of a swarm (bench/swarm_runs.py) serve the swarm tests too.
sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))

TTT = str(Path(sys.executable).parent / "ttt")
# The sample settings every end-to-end test shares, so their outputs can be compared byte for byte.
SAMPLE_ARGS = ["--sample-rows", "200", "--shards", "8"]


def run_ttt(*args, check=True, env=None, timeout=600):
    """Run the `ttt` console script as a user would; returns the CompletedProcess."""
    result = subprocess.run(
        [TTT, *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"ttt {' '.join(map(str, args))} failed:\n{result.stdout}\n{result.stderr}")
    return result


def dataset_files(folder: Path) -> dict[str, bytes]:
    """Everything a run leaves in a dataset folder that must not depend on how the run went."""
    files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted((folder / "data").iterdir())}
    manifest = json.loads((folder / "ttt_manifest.json").read_text())
    files["shards"] = json.dumps(
        {i: (s["path"], s["rows"], s["sha256"], s["failures"]) for i, s in manifest["shards"].items()}
    ).encode()
    return files


@pytest.fixture(scope="session")
def sample_dataset(tmp_path_factory) -> Path:
    """One uninterrupted `ttt preprocess` of the embedded sample, shared by the end-to-end tests."""
    out = tmp_path_factory.mktemp("sample") / "ttt-data"
    run_ttt("preprocess", *SAMPLE_ARGS, "--output", out)
    return out


MAX_STEPS = 12
# A swarm test runs the swarm's default settings (target batch, batch, matchmaking, timeouts): only what
# this shared 2-core machine needs differs.
SWARM_ARGS = ["--threads", "1", "--loader-workers", "0", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
DISPLAY_NAMES = {"a": "ada-lovelace", "b": "bert-the-gpu", "c": "cleo-notebook"}


def swarm_run(dataset: Path, folder: Path, run_id: str, max_steps: int):
    from swarm_runs import SwarmRun

    return SwarmRun(folder, ["--dataset", str(dataset), "--run-id", run_id, "--max-steps", str(max_steps), *SWARM_ARGS])


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
    from browser import open_dashboard, open_join
    from swarm_runs import MonitorProcess

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
    dashboard = open_dashboard(monitor.url, root / "dashboard.png")
    join = open_join(monitor.url + "join", root / "join.png")
    logs = run.finish()
    contributed = {DISPLAY_NAMES[name]: log.contributed for name, log in logs.items()}
    final = monitor.wait_for(lambda state: {p["name"]: p["samples"] for p in state["peers"]} == contributed, 60)
    metrics_text = monitor.get("metrics").decode()
    preview = monitor.get(final["previews"]["images"][0]["url"].lstrip("/")) if final["previews"] else b""
    stop_code = monitor.stop()
    seen = MonitorSeen(monitor, before_kill, during, final, metrics_text, preview, dashboard, join, stop_code)
    return Swarm(root, logs, seen)
