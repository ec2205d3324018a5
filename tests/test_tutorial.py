"""docs/tutorial.md runs: every code block, in order, on the embedded sample, so that the tutorial cannot rot.

- ```python blocks run in one namespace, in the order of the file (the tutorial tells readers they build on
  each other); a traceback points at the tutorial's own lines.
- ```console blocks: the lines that start with `$ ` (and the lines a trailing backslash continues) are the
  commands. Each block runs as one bash script with `set -euo pipefail`, so a command that fails fails the
  block, and a block may start a peer in the background and wait for it. The other lines are the output the
  tutorial shows: each must appear in what the block printed, in order, with runs of spaces collapsed;
  `...` stands for anything (a line of its own: lines left out).

Everything runs in a temporary folder that holds a copy of the `sample_dataset` fixture as ./ttt-data (the
tutorial's `ttt preprocess` finds its shards there and only checks them), with the venv's `ttt` on PATH.
"""

import contextlib
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

from tests.support.markdown_blocks import Block, parse_blocks, split_console

TUTORIAL = Path(__file__).resolve().parents[1] / "docs" / "tutorial.md"
KINDS = ("python", "console")
BLOCK_TIMEOUT = 300  # seconds per console block; the slowest (two peers) takes about 40 s on 2 cores
COLUMNS = "160"  # rich wraps at the terminal's width; wide enough that the shown output lines are not wrapped


def where(block: Block) -> str:
    return f"{TUTORIAL.name}:{block.line}"


def collapse(line: str) -> str:
    return " ".join(line.split())


def first_missing(shown: list[str], printed: str) -> str | None:
    """The first shown line that does not match a line of `printed` after the previous match; None: all do."""
    lines = [collapse(line) for line in printed.splitlines()]
    position = 0
    for expected in shown:
        if collapse(expected) in ("", "..."):
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in collapse(expected).split("...")))
        matches = [i for i in range(position, len(lines)) if pattern.fullmatch(lines[i])]
        if not matches:
            return expected
        position = matches[0] + 1
    return None


def run_console(block: Block, folder: Path) -> str:
    """Run a console block's commands as one bash script in `folder`; return what it printed."""
    commands, shown = split_console(block.text)
    script = "set -euo pipefail\n" + "\n".join(commands) + "\n"
    process = subprocess.Popen(
        ["bash", "-c", script],
        cwd=folder,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: what it left running is stopped below
    )
    try:
        printed, _ = process.communicate(timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        printed, _ = process.communicate()
        fail(block, printed, f"still running after {BLOCK_TIMEOUT} s")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # a background peer of a block that failed halfway
    if process.returncode != 0:
        fail(block, printed, f"exit status {process.returncode}")
    missing = first_missing(shown, printed)
    if missing is not None:
        fail(block, printed, f"the tutorial shows this output line, which the commands did not print:\n{missing}")
    return printed


def run_python(block: Block, namespace: dict) -> str:
    """Run a python block in the shared namespace; return what it printed."""
    # Blank lines in front put the code at its own line numbers, so a traceback shows the tutorial's lines.
    code = compile("\n" * block.line + block.text, str(TUTORIAL), "exec")
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            exec(code, namespace)
    except Exception:
        fail(block, printed.getvalue(), traceback.format_exc() + logs_so_far(Path.cwd()))
    return printed.getvalue()


def logs_so_far(folder: Path, lines: int = 40) -> str:
    """The last lines of every log the tutorial's commands wrote in `folder` (its peers' own words on what failed)."""
    tails = [(log.name, log.read_text(errors="replace").splitlines()[-lines:]) for log in sorted(folder.glob("*.log"))]
    return "".join(f"\n--- the last {lines} lines of {name}:\n" + "\n".join(tail) for name, tail in tails)


def fail(block: Block, printed: str, why: str) -> None:
    pytest.fail(
        f"the {block.kind} block at {where(block)} failed:\n{block.text}\n--- it printed:\n{printed}\n--- {why}",
        pytrace=False,
    )


def test_the_tutorial_has_blocks_and_every_one_can_run():
    blocks = parse_blocks(TUTORIAL.read_text())
    kinds = [block.kind for block in blocks]
    assert "python" in kinds and "console" in kinds, kinds
    # A block of another language would be skipped without a word, and a console block without a `$ ` line
    # would check nothing.
    assert all(kind in KINDS for kind in kinds), f"only {KINDS} blocks run; found {sorted(set(kinds))}"
    for block in blocks:
        if block.kind == "console":
            assert split_console(block.text)[0], f"the console block at {where(block)} has no `$ ` command"
        assert block.text.strip(), f"the block at {where(block)} is empty"


def test_commands_and_shown_output_are_told_apart():
    markdown = (
        "Text.\n\n```console\n$ echo one \\\n    two\none two\n...\n$ echo three\nthr...\n```\n\n"
        "```python\nx = 1\n```\n"
    )
    console, python = parse_blocks(markdown)
    assert (console.kind, console.line, python.kind, python.line) == ("console", 3, "python", 12)
    commands, shown = split_console(console.text)
    assert commands == ["echo one \\\n    two", "echo three"]
    assert shown == ["one two", "...", "thr..."]
    assert first_missing(shown, "one   two\nsomething else\nthree\n") is None
    assert first_missing(shown, "three\none two\n") == "thr..."  # in order
    assert first_missing(["one two"], "one two three\n") == "one two"  # a whole line, not a part of one


def test_every_block_of_the_tutorial_runs(sample_dataset, tmp_path, monkeypatch):
    blocks = parse_blocks(TUTORIAL.read_text())
    assert blocks, "the tutorial has no code blocks"
    shutil.copytree(sample_dataset, tmp_path / "ttt-data")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.setenv("COLUMNS", COLUMNS)
    namespace: dict = {"__name__": "__tutorial__"}
    timings = []
    for block in blocks:
        started = time.monotonic()
        if block.kind == "python":
            run_python(block, namespace)
        else:
            run_console(block, tmp_path)
        timings.append(f"{where(block)} {block.kind}: {time.monotonic() - started:.1f} s")
    print("\n".join(timings))
