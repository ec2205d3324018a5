"""Local checkpoints: what `ttt train` writes every N global steps and on Ctrl-C, and `ttt generate` reads.

    ckpt/
      latest.json                    {"step": 20, "path": "step-000020"}
      step-000020/
        config.json                  the model config, the step, the run and the dataset it trained on
        model.safetensors            the weights (shared blocks stored once)
        training_state.pt            hivemind optimizer state (offloaded LAMB statistics, schedule, epoch)
        stream.json                  the streaming loader's state, to resume at the exact sample
        tokenizer.json               the tokenizers JSON the text was encoded with (absent: byte-level UTF-8)

A step folder is written under a temporary name and renamed, then `latest.json` is replaced
atomically, so a crash never leaves a half-written checkpoint behind `latest.json`.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from pipeline.core.errors import UserError
from pipeline.core.files import write_atomic
from pipeline.core.text import ByteTokenizer, JsonTokenizer, load_tokenizer
from training.config import ModelConfig
from training.model import DalleTransformer

FORMAT_VERSION = 1
LATEST = "latest.json"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TRAINING_STATE = "training_state.pt"
STREAM_STATE = "stream.json"
TOKENIZER = "tokenizer.json"
BYTES = "bytes"  # config.json's "tokenizer" when the text is byte-level UTF-8


class CheckpointError(UserError):
    pass


def step_folder(step: int) -> str:
    return f"step-{step:06d}"


def save_checkpoint(
    folder: Path,
    model: DalleTransformer,
    step: int,
    info: dict[str, Any],
    training_state: dict | None = None,
    stream_state: dict | None = None,
    tokenizer: str | Path | None = None,
    keep: int = 3,
) -> Path:
    """Write step `step` and point latest.json at it; keep the newest `keep` step folders.

    `tokenizer` is the tokenizers JSON the model reads its text with (None: byte-level); it is copied in,
    so that whoever samples from the checkpoint encodes prompts the same way."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / step_folder(step)
    partial = folder / f".{step_folder(step)}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        config = {"format": FORMAT_VERSION, "step": step, "model": model.config.to_dict(), **info}
        config["tokenizer"] = TOKENIZER if tokenizer is not None else BYTES
        if tokenizer is not None:
            shutil.copyfile(tokenizer, partial / TOKENIZER)
        (partial / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        weights = {name: tensor.detach().cpu().contiguous() for name, tensor in model.state_dict().items()}
        save_file(weights, str(partial / WEIGHTS))
        if training_state is not None:
            torch.save(training_state, partial / TRAINING_STATE)
        if stream_state is not None:
            (partial / STREAM_STATE).write_text(json.dumps(stream_state))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    write_atomic(folder / LATEST, json.dumps({"step": step, "path": final.name}).encode())
    for old in sorted(folder.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(folder: Path) -> Path:
    """The step folder latest.json points at (or `folder` itself when it is a step folder)."""
    folder = Path(folder)
    if (folder / CONFIG).is_file():
        return folder
    if not (folder / LATEST).is_file():
        raise CheckpointError(f"no checkpoint in {folder} (no {LATEST}); `ttt train` writes them there")
    latest = json.loads((folder / LATEST).read_text())
    return folder / latest["path"]


def read_config(step_dir: Path) -> dict[str, Any]:
    config = json.loads((step_dir / CONFIG).read_text())
    if config.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{step_dir} has checkpoint format {config.get('format')}, expected {FORMAT_VERSION}")
    return config


@dataclass
class Checkpoint:
    """A trained model as `ttt generate` uses it: weights, config.json and the tokenizer of its text."""

    model: DalleTransformer
    config: dict[str, Any]
    tokenizer: ByteTokenizer | JsonTokenizer

    @property
    def step(self) -> int:
        return self.config["step"]


def load_checkpoint(folder: Path, device: str | torch.device = "cpu") -> Checkpoint:
    """The latest checkpoint in `folder` (or a step folder), in eval mode on `device`."""
    step_dir = latest_checkpoint(folder)
    config = read_config(step_dir)
    model = DalleTransformer(ModelConfig(**config["model"]))
    model.load_state_dict(load_file(str(step_dir / WEIGHTS)))
    return Checkpoint(model.to(device).eval(), config, checkpoint_tokenizer(step_dir, config))


def checkpoint_tokenizer(step_dir: Path, config: dict[str, Any]) -> ByteTokenizer | JsonTokenizer:
    """The tokenizer a checkpoint's model was trained with."""
    name = config.get("tokenizer", BYTES)
    if name == BYTES:
        return load_tokenizer(None)
    if name != TOKENIZER or not (step_dir / TOKENIZER).is_file():
        raise CheckpointError(f"{step_dir} was trained with tokenizer {name!r} but holds no {TOKENIZER}")
    return load_tokenizer(step_dir / TOKENIZER)
