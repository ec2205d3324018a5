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
COMMANDS = [[], ["preprocess"], ["publish"], ["inspect"], ["vqgan", "train"], ["stream-bench"], ["train"]]


@pytest.mark.parametrize("statement", LIGHT_IMPORTS)
def test_light_modules_import_no_preprocessing_stack(statement):
    loaded = imported_after(statement)
    assert not [name for name in HEAVY if name in loaded]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command):
    result = run_ttt(*command, "--help")
    assert result.stdout.startswith("Usage: ttt")
