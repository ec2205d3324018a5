"""The wheel of the ttt this monitor runs, built at start in the background and served at /wheel/NAME: the Join
page's install line points at it, so that every volunteer installs the run's very version (no package named ttt can
be installed from the registry)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from training.config import ttt_version
from training.monitor.report import INSTALL

WHEEL_FOLDER = "wheel"  # under the monitor's --checkpoint-dir
BUILD_TIMEOUT = 600.0


def source_tree() -> Path | None:
    """The folder holding the pyproject.toml of the ttt this process runs (a clone, installed editable), or None."""
    root = Path(__file__).resolve().parents[2]  # training/monitor/wheel.py -> the clone
    pyproject = root / "pyproject.toml"
    return root if pyproject.is_file() and 'name = "ttt"' in pyproject.read_text() else None


class RunWheel:
    """Builds the wheel once, in a thread: `name` is its file's name in `folder` once built; when it cannot be built,
    one line on the console says why."""

    def __init__(self, folder: Path, console: Console) -> None:
        self.folder, self.console = folder, console
        self.name: str | None = None
        threading.Thread(target=self.build, name="wheel", daemon=True).start()

    def build(self) -> None:
        try:
            self.name = self.build_into_folder()
        except (OSError, subprocess.SubprocessError, RuntimeError) as error:
            problem = str(error) or type(error).__name__
            self.console.print(
                f"[yellow]the Join page cannot offer this ttt's wheel ({escape(problem)}): it shows "
                f"{INSTALL!r}, tell volunteers how to install ttt {ttt_version()}[/]"
            )

    def build_into_folder(self) -> str:
        root = source_tree()
        if root is None:
            raise RuntimeError("this ttt was not installed from a clone of its repository")
        with tempfile.TemporaryDirectory() as tmp:
            command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                       "--wheel-dir", tmp, str(root)]  # fmt: skip
            result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
            built = sorted(Path(tmp).glob("ttt-*.whl"))
            if result.returncode != 0 or not built:
                last_line = (result.stderr.strip().splitlines() or ["no wheel was written"])[-1]
                raise RuntimeError(f"pip wheel failed: {last_line}")
            self.folder.mkdir(parents=True, exist_ok=True)
            partial = self.folder / f".{built[0].name}.partial"
            shutil.copyfile(built[0], partial)
            partial.replace(self.folder / built[0].name)  # whole or not at all, for a download under way
        return built[0].name
