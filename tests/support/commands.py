"""`ttt` run as a user runs it, and the settings the end-to-end and swarm tests share."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from tests.support.swarm_runs import FAULTHANDLER, TTT, SwarmRun

# The sample settings every end-to-end test shares, so their outputs can be compared byte for byte (with the
# tutorial's plain `ttt preprocess` too: the sample's default port is part of the dataset's identity).
SAMPLE_ARGS = ["--sample-rows", "200", "--shards", "8"]


def run_ttt(*args, check=True, env=None, timeout=540):
    """Run the `ttt` console script as a user would; returns the CompletedProcess.

    A run that outlives `timeout` (set below pytest's 600 s, so this fires first) is stopped with SIGABRT, and
    Python's faulthandler prints where each of its threads was: a hang in CI then says where it hung.
    """
    command = [TTT, *map(str, args)]
    env = {**os.environ, **FAULTHANDLER, **(env or {})}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        try:
            stdout, stderr = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # its children hold the pipes open: take what came
            process.kill()
            stdout, stderr = process.communicate()
        raise AssertionError(f"ttt {' '.join(command[1:])} ran past {timeout} s:\n{stdout}\n{stderr}") from None
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise AssertionError(f"ttt {' '.join(command[1:])} failed:\n{result.stdout}\n{result.stderr}")
    return result


def run_ttt_concurrently(commands: list[list], env=None, timeout=600) -> list[subprocess.CompletedProcess]:
    """Run several `ttt` commands at once (each as `run_ttt(..., check=False)` would): for checks of one-line errors,
    whose time goes to starting Python and waiting, not to computing."""
    processes = [
        subprocess.Popen(
            [TTT, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
        for args in commands
    ]
    results = []
    for args, process in zip(commands, processes, strict=True):
        stdout, stderr = process.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess([TTT, *map(str, args)], process.returncode, stdout, stderr))
    return results


def dataset_files(folder: Path) -> dict[str, bytes]:
    """Everything a run leaves in a dataset folder that must not depend on how the run went."""
    files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted((folder / "data").iterdir())}
    manifest = json.loads((folder / "ttt_manifest.json").read_text())
    files["shards"] = json.dumps(
        {i: (s["path"], s["rows"], s["sha256"], s["failures"]) for i, s in manifest["shards"].items()}
    ).encode()
    return files


MAX_STEPS = 12
# A swarm test runs the swarm's default settings (target batch, batch, matchmaking, timeouts): only what
# this shared 2-core machine needs differs.
SWARM_ARGS = ["--threads", "1", "--loader-workers", "0", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
DISPLAY_NAMES = {"a": "ada-lovelace", "b": "bert-the-gpu", "c": "cleo-notebook"}


def swarm_run(dataset: Path, folder: Path, run_id: str, max_steps: int):
    return SwarmRun(folder, ["--dataset", str(dataset), "--run-id", run_id, "--max-steps", str(max_steps), *SWARM_ARGS])


# A pair of peers that trains quickly on 2 cores: small batches, short matchmaking.
PEER_ARGS = [
    "--target-batch-size", "32", "--batch-size", "8", "--threads", "1", "--matchmaking-time", "3",
    "--averaging-timeout", "30", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--loader-workers", "0",
]  # fmt: skip
