"""Separately packaged halves: the CLI and the shard format must not drag in the preprocessing stack."""

import subprocess
import sys

import pytest

from tests.support.commands import run_ttt

HEAVY = ["dask", "distributed", "img2dataset", "taming", "pandas", "huggingface_hub"]


def imported_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(result.stdout.split())


LIGHT_IMPORTS = [
    "import cli",
    "import pipeline.core.shard_format",
    "import pipeline.sample.judge",
    "import pipeline.core.stream",
]
TRAINING_AND_PREPROCESSING = ["hivemind", "bitsandbytes", "dask", "distributed", "img2dataset", "pandas", "datasets"]
# Each command's help must list these (its own options and arguments, and defaults that come from its settings).
HELP = {
    (): [
        "preprocess", "vqgan", "stream-bench", "train", "calc", "generate", "demo", "publish", "inspect", "run",
        "status",
    ],
    ("preprocess",): [
        "--input GLOB", "--from-images", "--dataset TEXT A folder, or hf://", "[default: ./ttt-data]",
        "--shards INTEGER Number of output shards (units of work). [default: 8]", "--vqgan-config",
        "--url-col TEXT The input's image URL column. [default: URL]", "--key-col TEXT Stable key column",
        "--min-caption-length INTEGER Drop shorter captions (0: keep all). [default: 3]", "[default: 2.0]",
        "--allowed-nsfw TEXT Comma-separated NSFW labels to keep, or 'any'. [default: UNLIKELY]",
        "--scheduler ADDRESS", "--compression-level", "[default: 11;", "--sample-rows INTEGER", "[default: 1200]",
        "--dry-run",
    ],
    ("publish",): ["hf://datasets/ORG/NAME", "--dataset DIRECTORY", "[default: ./ttt-data]", "--dry-run"],
    ("inspect",): [
        "--dataset DIRECTORY", "--out-file FILE", "--show INTEGER", "[default: 16]", "--vqgan-ckpt",
        "[default: inspect.png]",
    ],
    ("vqgan", "train"): [
        "--out DIRECTORY", "[default: vqgan]", "--images", "--config FILE", "[default: 1500;", "--heldout",
        "[default: 400;",
    ],
    ("stream-bench",): [
        "--dataset TEXT", "--batch-size", "--workers", "--shuffle-buffer", "[default: 10000;", "--seconds",
    ],
    ("train",): [
        "--join ADDRESS", "--run RUN.TOML", "--dataset TEXT", "[default: ./ttt-data]", "--stream / --no-stream",
        "--tokenizer FILE", "--run-id TEXT The run:", "--preset [tiny|small|ttt-1.1b]", "--initial-peers MULTIADDR",
        "--target-batch-size", "[default: 64;", "--batch-size N|AUTO", "[default: 16]", "--max-memory GIB",
        "--wait-for-peers", "--resume", "--reachability [auto|public|client]", "[default: auto]",
        "--checkpoint-dir TEXT", "[default: ./ckpt]", "--name TEXT", "--matchmaking-time", "[default: 5.0;",
        "--local-steps", "[default: 0;", "--outer-lr", "[default: 1.0;", "--outer-momentum", "[default: 0.0;",
    ],
    ("calc",): [
        "--preset NAME", "ttt-1.1b", "gpt3-175b", "--layers", "--seq-len", "--batch-size", "[default: 1;",
        "--optimizer [lamb-8bit|lamb|adam-8bit|adamw|adamw-16bit|adafactor]", "[default: lamb-8bit]", "--offload",
        "--reversible",
        "--swarm / --alone", "--fit GIB", "--json",
    ],
    ("generate",): [
        "PROMPT", "--checkpoint TEXT", "[default: ./ckpt]", "--out TEXT", "[default: ./samples]", "--top-k",
        "--top-p", "[default: 0.75;", "--temperature", "[default: 1.0;", "--rerank-clip MODEL:WEIGHTS", "--seed",
    ],
    ("demo",): [
        "--steps", "[default: 200;", "--peers", "Local hivemind peers. [default: 2;", "--samples-per-prompt",
        "[default: ./samples]",
    ],
}  # fmt: skip
ONLY_ELSEWHERE = {("train",): ["--shards", "--top-p"], ("generate",): ["--run-id", "--shards"]}


@pytest.mark.parametrize("statement", LIGHT_IMPORTS)
def test_light_modules_import_no_preprocessing_stack(statement):
    loaded = imported_after(statement)
    assert not [name for name in HEAVY if name in loaded]


def test_the_cli_starts_without_torch_numpy_or_pyarrow():
    """Every default comes from a settings module that imports none of them: `ttt --help` is instant."""
    loaded = imported_after("import cli")
    assert not {"torch", "numpy", "pyarrow", "PIL"} & loaded


def test_every_option_of_every_command_says_what_it_is():
    import click

    import cli

    def options(command: click.Command, name: str) -> list[tuple[str, click.Parameter]]:
        if isinstance(command, click.Group):
            return [found for sub, child in command.commands.items() for found in options(child, f"{name} {sub}")]
        return [(name, param) for param in command.params if isinstance(param, click.Option)]

    unexplained = [(name, param.opts) for name, param in options(cli.main, "ttt") if not param.help]
    assert not unexplained


@pytest.mark.parametrize("command", list(HELP), ids=lambda command: " ".join(command) or "ttt")
def test_each_command_lists_its_own_options_and_defaults(command):
    result = run_ttt(*command, "--help")
    assert result.stdout.startswith("Usage: ttt")
    text = " ".join(result.stdout.split())  # click wraps to the terminal's width
    missing = [expected for expected in HELP[command] if expected not in text]
    assert not missing, text
    assert not [option for option in ONLY_ELSEWHERE.get(command, []) if option in text], text


def test_generating_needs_neither_hivemind_nor_dask(tmp_path):
    """`ttt generate` end to end (load, sample, decode, judge, write) imports nothing of the other halves."""
    from training.checkpoint import save_checkpoint
    from training.config import PRESETS
    from training.model import DalleTransformer

    save_checkpoint(tmp_path / "ckpt", DalleTransformer(PRESETS["tiny"].model), 1, {"dataset": {}})
    run = (
        "from rich.console import Console; from inference.generate import GenerateSettings, generate; "
        f"generate(GenerateSettings('a red circle', checkpoint={str(tmp_path / 'ckpt')!r}, "
        f"out={str(tmp_path / 'out')!r}, num_samples=1), Console(quiet=True))"
    )
    loaded = imported_after(run)
    assert "taming" in loaded and "torch" in loaded and (tmp_path / "out").is_dir()
    assert not [name for name in TRAINING_AND_PREPROCESSING if name in loaded]
