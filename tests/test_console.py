"""ttt's console off a terminal: as wide as OFF_TERMINAL_WIDTH, whatever the environment says of colours or size."""

from __future__ import annotations

import subprocess
import sys

import pytest

SHOW = (
    "from pipeline.core.console import ttt_console; from rich.table import Table; t = Table('a', 'b'); "
    "t.add_row('checkpoint', '/tmp/' + 'x' * 150 + ' (global step 10)'); ttt_console().print(t)"
)


# What a pipe's environment can say: colours forced, a dumb terminal, and the 80 x 24 that `readline` exports to the
# children of the Python that imported it (pytest's among them).
FORCED = [
    {},
    {"FORCE_COLOR": "1"},
    {"TTY_COMPATIBLE": "1"},
    {"TERM": "dumb", "FORCE_COLOR": "1"},
    {"COLUMNS": "80", "LINES": "24"},
]


@pytest.mark.parametrize("environment", FORCED, ids=str)
def test_a_pipe_gets_whole_lines_whatever_the_environment_says(environment):
    printed = subprocess.run(
        [sys.executable, "-c", SHOW], capture_output=True, text=True, check=True, env={"PATH": "", **environment}
    ).stdout
    assert "(global step 10)" in printed and "…" not in printed, printed
