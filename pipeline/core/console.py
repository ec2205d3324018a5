"""ttt's console: rich's, except that its lines are never wrapped or cut, on a terminal or off one.

Off a terminal (a pipe, a log file, CI), rich lays out for 80 columns: a table cut a sha256 to "87f07...0d..." and a
line broke in the middle of "12 GB/s". There the console is as wide as OFF_TERMINAL_WIDTH, and everywhere a line too
long for the width is left whole (soft wrap) for the terminal to fold.

Off a terminal, COLUMNS in the environment is not the width of anything: a Python process that imported `readline`
(pytest does) exports COLUMNS=80 and LINES=24 to every process it starts, and a table of `ttt generate` run by a
test was cut at 80 columns.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console

OFF_TERMINAL_WIDTH = 200  # columns of a table's layout when the output is not a terminal
OFF_TERMINAL_HEIGHT = 25  # rows (rich asks only for pagers and live displays)


def ttt_console(stderr: bool = False, quiet: bool = False) -> Console:
    """The console of a ttt command (on stderr: one whose stdout is its result). Whether the output is a terminal is
    asked of the stream itself: rich also counts FORCE_COLOR or TTY_COMPATIBLE in the environment as a terminal, and
    would then lay out a pipe for 80 columns, as it does for any "terminal" whose TERM is dumb unless it is given both
    a width and a height."""
    stream = sys.stderr if stderr else sys.stdout
    if os.isatty(stream.fileno()) if hasattr(stream, "fileno") and not stream.closed else False:
        return Console(stderr=stderr, quiet=quiet, soft_wrap=True)
    return Console(stderr=stderr, quiet=quiet, soft_wrap=True, width=OFF_TERMINAL_WIDTH, height=OFF_TERMINAL_HEIGHT)
