"""Setting a peer up before it joins: its model, the batch that fits its device, what --resume may continue, the
stream of its data. Every check here fails in one line before the peer contacts anyone."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import torch
from rich.console import Console

from pipeline.core.blocks import BlockSource
from pipeline.core.errors import UserError
from pipeline.core.files import sha256_file
from pipeline.core.stream import CodeStream, DatasetIndex
from training.calc.memory import GIB, architecture_of, estimate, largest_batch, needed_bytes, train_setup
from training.checkpoint import TOKENIZER, latest_checkpoint, read_config
from training.config import AUTO, DEFAULT_OPTIMIZER, ModelConfig, PeerSettings, flag

AUTO_SHARE = 0.9  # --batch-size auto fills this share of the free memory: the rest is for everything else


class TrainError(UserError):
    pass


def check_resumable(settings: PeerSettings, config: ModelConfig) -> None:
    """--resume continues the checkpoint's model with the tokenizer it was trained with; refuse anything else."""
    run = settings.run
    step_dir = latest_checkpoint(Path(settings.checkpoint_dir))
    info = read_config(step_dir)
    saved = step_dir / TOKENIZER if info.get("tokenizer") == TOKENIZER else None
    given = run.tokenizer
    same_tokenizer = saved is None and given is None
    if saved is not None and given is not None:
        same_tokenizer = sha256_file(saved) == sha256_file(given)
    if not same_tokenizer:
        remedy = f"resume with --tokenizer {saved}" if saved else "resume without --tokenizer"
        raise TrainError(f"{step_dir} was trained with another tokenizer than {given or 'bytes'!r}; {remedy}")
    if info["model"] != config.to_dict():
        raise TrainError(f"{step_dir} holds a different model than --preset {run.preset}")
    if info.get("local_steps", 0) != run.local_steps:
        raise TrainError(
            f"{step_dir} was trained with {flag('local_steps', info.get('local_steps', 0))}; resume with the same "
            "(its optimizer state is of that mode)"
        )
    if info.get("optimizer", DEFAULT_OPTIMIZER) != run.optimizer:
        raise TrainError(
            f"{step_dir} was trained with {flag('optimizer', info.get('optimizer', DEFAULT_OPTIMIZER))}; resume with "
            "the same (its optimizer state is of that optimizer)"
        )


def free_memory(device: torch.device) -> int:
    """Bytes this device can still give: the GPU's free memory, or the RAM the kernel can hand out (MemAvailable)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def choose_batch_size(settings: PeerSettings, config: ModelConfig, device: torch.device, console: Console) -> int:
    """The batch this peer trains with: --batch-size if the memory calculator says it fits this device, or with
    --batch-size auto the largest that fits in AUTO_SHARE of its free memory (at most --target-batch-size)."""
    run = settings.run
    model = architecture_of(run.preset, config)
    setup = partial(
        train_setup, config, local_steps=run.local_steps, optimizer=run.optimizer, audit_rate=settings.audit_rate
    )
    on_gpu = device.type == "cuda"
    budget = free_memory(device)
    if settings.max_memory is not None:
        budget = min(budget, round(settings.max_memory * GIB))
    if settings.batch_size == AUTO:
        usable = int(AUTO_SHARE * budget)
        batch = largest_batch(model, setup(1), usable, on_gpu, limit=run.target_batch_size)
        if batch == 0:
            needed = needed_bytes(estimate(model, setup(1)), on_gpu)
            raise TrainError(
                f"--preset {run.preset} needs about {needed / GIB:.2f} GiB on {device} even at batch 1, and "
                f"{usable / GIB:.2f} GiB can be used; use a smaller preset, or a device with more memory"
            )
        needed = needed_bytes(estimate(model, setup(batch)), on_gpu)
        console.print(
            f"--batch-size auto: {batch} (needs about {needed / GIB:.2f} GiB of the {budget / GIB:.2f} GiB "
            f"free on {device}, keeping {1 - AUTO_SHARE:.0%} spare)"
        )
        return batch
    result = estimate(model, setup(settings.batch_size))
    needed = needed_bytes(result, on_gpu)
    if needed > budget:
        raise TrainError(
            f"--preset {run.preset} with --batch-size {settings.batch_size} needs about {needed / GIB:.2f} GiB "
            f"on {device} (activations {result.activations / GIB:.2f} GiB of it), which has {budget / GIB:.2f} GiB "
            "free; lower --batch-size, or let --batch-size auto choose (`ttt calc` shows the terms)"
        )
    return settings.batch_size


def make_stream(
    settings: PeerSettings,
    config: ModelConfig,
    dataset: str,
    index: DatasetIndex,
    device: torch.device,
    seed: int,
    blocks: BlockSource | None,
) -> CodeStream:
    """The loader: the run's blocks of each epoch (BLOCKS: the swarm's leases) in the run's SEED's order, or without
    blocks the peer's own order of the whole dataset, from SEED (checkpoints of a ttt before leases)."""
    return CodeStream(
        dataset,
        batch_size=settings.batch_size,
        text_len=config.text_len,
        codebook_size=config.codebook_size,
        grid=(config.grid, config.grid),
        num_workers=settings.loader_workers,
        seed=seed,
        pin_memory=device.type == "cuda",
        tokenizer=settings.run.tokenizer,
        index=index,
        blocks=blocks,
    )


def checkpoint_info(settings: PeerSettings, index: DatasetIndex) -> dict:
    """What a checkpoint records of the run and of the data it was trained on."""
    run = settings.run
    return {
        "run_id": run.run_id,
        "local_steps": run.local_steps,
        "optimizer": run.optimizer,
        "dataset": {
            "source": run.dataset,
            "codebook_size": index.codebook_size,
            "grid": list(index.grid),
            "image_size": index.facts.image_size if index.facts else None,
            "vqgan": index.facts.vqgan.__dict__ if index.facts else None,
        },
    }
