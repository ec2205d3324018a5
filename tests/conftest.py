import json
import os
import subprocess
import sys
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
