"""What every bench script shares: timing a piece of work, writing the run's figures, and the environment of the
processes it starts."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"
# The peers a bench starts run this checkout's code, whatever the venv's ttt was installed from.
CODE = {"PYTHONPATH": str(ROOT)}


def timed(work, min_seconds: float = 0.0) -> tuple[int, float]:
    """Run `work` until at least `min_seconds` have passed (once if 0); returns (runs, seconds)."""
    runs, start = 0, time.perf_counter()
    while True:
        work()
        runs += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return runs, elapsed


def median_seconds(work: Callable[[], object], repeats: int, device: torch.device | None = None) -> float:
    """The median wall time of `repeats` runs of `work`; with a GPU `device`, each run waits for its queue to drain
    before and after, so that the timer sees the work done."""
    seconds = []
    for _ in range(repeats):
        if device is not None:
            synchronize(device)
        started = time.perf_counter()
        work()
        if device is not None:
            synchronize(device)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def save_results(name: str, results: dict, started: float, console: Console, keep_other_parts: bool = False) -> None:
    """Say how long the bench took and write its figures to bench/results/NAME.json; with KEEP_OTHER_PARTS, the
    file's figures of the parts not run this time stay."""
    console.print(f"bench took {time.perf_counter() - started:.0f} s")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    if keep_other_parts and path.exists():
        results = {**json.loads(path.read_text()), **results}
    path.write_text(json.dumps(results, indent=1))


def synchronize(device: torch.device) -> None:
    """Wait for a GPU's queued work, so that a timer sees it done (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
