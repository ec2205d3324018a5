"""A checkpoint's way through the Hub, with the real huggingface_hub client against the local stand-in for the
Hub's HTTP API: the monitor pushes it (`ttt monitor --push-to hf://ORG/RUN`), `ttt generate --checkpoint
hf://ORG/RUN` draws from it; refusals are one line, rate limits a wait."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.commands import run_ttt
from tests.support.hub_stand_in import HubStandIn, run_client
from training.checkpoint import CONFIG, LATEST, TRAINING_STATE, WEIGHTS, save_checkpoint
from training.config import PRESETS
from training.model import DalleTransformer

# The function the monitor's checkpoint thread calls after writing a step folder (training/monitor/run.py): the
# monitor itself needs a swarm to take a checkpoint from, which tests/test_monitor.py runs (with --dry-run).
PUSH = """
import sys
from pathlib import Path
from rich.console import Console
from training.monitor.snapshots import push_checkpoint
print(push_checkpoint(Path(sys.argv[1]), "ttt-org/run", "step 5, loss 2.5000", False, Console(soft_wrap=True)))
"""


def monitor_checkpoint(folder: Path) -> Path:
    """A step folder as the monitor writes it: weights, config, the optimizer's state."""
    torch.manual_seed(0)
    info = {"run_id": "demo", "dataset": None, "written_by": "ttt monitor"}
    return save_checkpoint(folder, DalleTransformer(PRESETS["tiny"].model), 5, info, training_state={"epoch": 5})


def test_a_checkpoint_the_monitor_pushed_is_what_generate_draws_from(tmp_path):
    step_dir = monitor_checkpoint(tmp_path / "ckpt")
    with HubStandIn(root=tmp_path / "hub") as hub:
        refused = run_client(PUSH, hub.environ("hf_eve", tmp_path / "hf-home"), step_dir)
        assert refused.stdout.splitlines() == [
            "could not push step-000005 to ttt-org/run: the token may not do this (403 You don't have the rights to "
            'create a model under the namespace "ttt-org"); publishing and pushing need a token with write access',
            "False",  # the monitor goes on; its next checkpoint tries again
        ]
        hub.rate_limit("commit", 1)
        pushed = run_client(PUSH, hub.environ("hf_ada", tmp_path / "hf-home"), step_dir)
        assert pushed.stdout.splitlines() == [
            "the Hub is rate limiting this client (429); waiting 1 s (attempt 1 of 5)",
            "pushed step-000005 to hf://ttt-org/run",
            "True",
        ]
        repo = hub.repo("model", "ttt-org/run")
        assert [c.summary for c in repo.commits] == ["initial commit", "step 5, loss 2.5000"]
        step_files = [f"step-000005/{name}" for name in (CONFIG, WEIGHTS, TRAINING_STATE)]
        assert repo.commits[-1].added == [*step_files, LATEST]  # one commit: latest.json never points at nothing
        assert sorted(repo.lfs) == [f"step-000005/{WEIGHTS}", f"step-000005/{TRAINING_STATE}"]

        hub.rate_limit("resolve", 1)  # huggingface_hub waits out this one itself
        home = tmp_path / "reader-home"
        drawn = run_ttt("generate", "a red circle", "--checkpoint", "hf://ttt-org/run", "--num-samples", 1,
                        "--out", tmp_path / "out", env=hub.environ(None, home))  # fmt: skip
        assert [s.status for s in hub.log if "/resolve/" in s.path][0] == 429
    assert "global step 5" in drawn.stdout and len(list((tmp_path / "out").glob("*.png"))) == 2
    (snapshot,) = (home / "hub" / "models--ttt-org--run" / "snapshots").iterdir()
    downloaded = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    assert downloaded == [LATEST, f"step-000005/{CONFIG}", f"step-000005/{WEIGHTS}"]  # not the optimizer's state
    for name in (CONFIG, WEIGHTS):
        assert (snapshot / "step-000005" / name).read_bytes() == (step_dir / name).read_bytes()


def test_generate_says_in_one_line_which_repository_or_file_the_hub_does_not_have(tmp_path):
    with HubStandIn(root=tmp_path / "hub") as hub:
        hub.create("model", "ttt-org/run", {LATEST: b'{"step": 5, "path": "step-000005"}'})  # the step never came
        cases = {
            "hf://ttt-org/nothing": "not found on the Hub, or private and the token may not read it (404 Repository "
            "not found)",
            "hf://ttt-org/run": "the Hub has no step-000005/config.json there (404 Entry not found)",
        }
        for source, message in cases.items():
            result = run_ttt("generate", "a red circle", "--checkpoint", source, "--out", tmp_path / "out",
                             env=hub.environ("hf_ada", tmp_path / "hf-home"), check=False)  # fmt: skip
            assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
            last = result.stderr.strip().splitlines()[-1]
            assert last == f"Error: cannot fetch checkpoint {source} from the Hub: {message}"
    assert not (tmp_path / "out").exists()
