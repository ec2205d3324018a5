"""The README's "Organise a run" and "Join a run" run as written: the organiser's commands in one folder, the
volunteer's line in two folders of their own (two more machines, with the data at the same path), and `ttt status`
from a third, all on this machine.

What the test changes, and only that: HOST is 127.0.0.1 and port 8080 a free one; the commands that keep running
(`ttt monitor`, `ttt train`) start in the background and stop with Ctrl-C (SIGINT) once the run has taken global
steps with both volunteers; OMP_NUM_THREADS=1, so that three peers share 2 cores politely.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.support.markdown_blocks import parse_blocks, split_console
from tests.support.swarm_runs import free_port, start_process

README = Path(__file__).resolve().parents[1] / "README.md"
SECTIONS = ("Organise a run", "Join a run")
MAX_LINES = 10  # of each section's block
RUNNING = ("ttt monitor", "ttt train")  # the commands that keep running until they are stopped
STEPS = 3  # global steps the run takes with both volunteers before they leave
ENV = {
    **os.environ,
    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # this venv's `ttt`
    "OMP_NUM_THREADS": "1",
    "COLUMNS": "160",
}


def section_commands(markdown: str, title: str) -> list[str]:
    """The `$ ` commands of the console block in section TITLE (a `## ` heading) of MARKDOWN."""
    text = markdown.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    (block,) = [block for block in parse_blocks(text) if block.kind == "console"]
    assert len(block.text.splitlines()) <= MAX_LINES, f"{title}: more than {MAX_LINES} lines"
    return split_console(block.text)[0]


def as_here(command: str, port: int) -> str:
    return command.replace("http://HOST:8080", f"http://127.0.0.1:{port}").replace("--port 8080", f"--port {port}")


def monitor_state(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/state", timeout=5) as response:
            return json.load(response)
    except OSError:
        return None


def wait_for_state(port: int, condition, processes: dict, timeout: float) -> dict:
    deadline, state = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        exited = {name: process.returncode for name, process in processes.items() if process.poll() is not None}
        assert not exited, f"exited early: {exited}"
        state = monitor_state(port)
        if state and condition(state):
            return state
        time.sleep(1)
    raise AssertionError(f"the run never got there in {timeout} s; the monitor's last state: {state}")


def stop(process: subprocess.Popen) -> int:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
    return process.wait(120)


def run_readme_section(commands: list[str], folder: Path, port: int, start) -> None:
    """Each command in FOLDER: the ones that keep running through START(name, command, folder), the others to their
    end (they must succeed)."""
    for number, command in enumerate(commands):
        command = as_here(command, port)
        if command.startswith(RUNNING):
            start(f"{folder.name}-{number}", command, folder)
            continue
        done = subprocess.run(["bash", "-c", command], cwd=folder, env=ENV, capture_output=True, text=True)
        assert done.returncode == 0, f"$ {command}\n{done.stdout}{done.stderr}"


def test_organise_and_join_a_run_as_the_readme_says(sample_dataset, tmp_path):
    markdown = README.read_text(encoding="utf-8")
    organise, join = (section_commands(markdown, title) for title in SECTIONS)
    (train,) = [command for command in join if command.startswith("ttt train")]
    assert re.fullmatch(r"ttt train --join http://HOST:8080", train.split("#")[0].strip())  # no run-wide option
    port = free_port()
    organiser, elsewhere = tmp_path / "organiser", tmp_path / "elsewhere"
    shutil.copytree(sample_dataset, organiser / "ttt-data")  # `ttt preprocess` finds its shards and checks them
    elsewhere.mkdir()
    running: dict[str, subprocess.Popen] = {}

    def start(name: str, command: str, folder: Path) -> None:
        running[name] = start_process(["bash", "-c", command], tmp_path / f"{name}.log", ENV, folder)

    try:
        run_readme_section(organise, organiser, port, start)
        wait_for_state(port, lambda state: state["join"]["spec"] is not None, running, 120)
        for volunteer in ("volunteer-1", "volunteer-2"):
            (tmp_path / volunteer).mkdir()
            (tmp_path / volunteer / "ttt-data").symlink_to(organiser / "ttt-data")
            run_readme_section([train], tmp_path / volunteer, port, start)
        state = wait_for_state(
            port, lambda state: state["active_peers"] >= 2 and state["global_step"] >= STEPS, running, 300
        )
        run_readme_section([command for command in join if command != train], elsewhere, port, start)
    finally:
        # Ctrl-C, as a terminal sends it: each volunteer in turn (so that the last one's round still has partners),
        # then the monitor.
        codes = {name: stop(running[name]) for name in sorted(running, key=lambda name: name.startswith("organiser"))}
    texts = {name: (tmp_path / f"{name}.log").read_text() for name in running}
    stopped = {name: 130 if name.startswith("volunteer") else 0 for name in running}  # a peer's Ctrl-C exit: 130
    assert codes == stopped and "Traceback" not in "".join(texts.values()), texts
    for volunteer in ("volunteer-1-0", "volunteer-2-0"):
        assert "left the swarm. Goodbye!" in texts[volunteer], texts[volunteer]
        assert texts[volunteer].count("SIGINT: leaving") == 1, texts[volunteer]  # said by the peer, not its loader
    assert len(state["peers"]) >= 2 and all(peer["samples"] > 0 for peer in state["peers"]), state["peers"]
