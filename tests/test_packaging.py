"""Separately packaged halves: the CLI and the shard format must not drag in the preprocessing stack."""

import subprocess
import sys

import pytest
from conftest import run_ttt

HEAVY = ["dask", "distributed", "img2dataset", "taming", "pandas", "huggingface_hub"]


def imported_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(result.stdout.split())


LIGHT_IMPORTS = ["import cli", "import pipeline.shard_format", "import pipeline.sample_judge", "import pipeline.stream"]
COMMANDS = [[], ["preprocess"], ["publish"], ["inspect"], ["vqgan", "train"], ["stream-bench"], ["train"], ["generate"]]
TRAINING_AND_PREPROCESSING = ["hivemind", "bitsandbytes", "dask", "distributed", "img2dataset", "pandas", "datasets"]


@pytest.mark.parametrize("statement", LIGHT_IMPORTS)
def test_light_modules_import_no_preprocessing_stack(statement):
    loaded = imported_after(statement)
    assert not [name for name in HEAVY if name in loaded]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command):
    result = run_ttt(*command, "--help")
    assert result.stdout.startswith("Usage: ttt")


def test_generating_needs_neither_hivemind_nor_dask(tmp_path):
    """`ttt generate` end to end (load, sample, decode, judge, write) imports nothing of the other halves."""
    from training.checkpoint import save_checkpoint
    from training.model import PRESETS, DalleTransformer

    save_checkpoint(tmp_path / "ckpt", DalleTransformer(PRESETS["tiny"]), 1, {"dataset": {}})
    run = (
        "from rich.console import Console; from inference.generate import GenerateSettings, generate; "
        f"generate(GenerateSettings('a red circle', checkpoint={str(tmp_path / 'ckpt')!r}, "
        f"out={str(tmp_path / 'out')!r}, num_samples=1), Console(quiet=True))"
    )
    loaded = imported_after(run)
    assert "taming" in loaded and "torch" in loaded and (tmp_path / "out").is_dir()
    assert not [name for name in TRAINING_AND_PREPROCESSING if name in loaded]
