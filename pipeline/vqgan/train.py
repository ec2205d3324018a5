"""`ttt vqgan train`: train a small taming-transformers VQModel on CPU, and measure what it reconstructs.

The objective is taming's VQGAN objective without the parts whose weights would have to be
downloaded (the LPIPS perceptual loss and the patch discriminator): pixel reconstruction
(L1 + L2) plus the quantizer's codebook and commitment loss. Codes that no batch chose
for a while are restarted on random encoder outputs, so the whole codebook gets used.

The result is written in the released-checkpoint layout, so `ttt preprocess` and every
decoder load it exactly like a downloaded VQGAN:

    OUT/configs/model.yaml        the architecture (taming's YAML)
    OUT/checkpoints/last.ckpt     {"state_dict": ...}
    OUT/README.md                 the model card: training recipe and measured quality
    OUT/metrics.json              the same numbers, machine-readable

Training data is the embedded sample's domain rendered on the fly (one in ten scene
layouts held out for evaluation), or a folder of the user's own images.
"""

from __future__ import annotations

import io
import json
import math
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from pipeline.core.console import ttt_console
from pipeline.core.devices import pick_device
from pipeline.core.errors import UserError
from pipeline.core.files import write_atomic
from pipeline.sample.domain import is_heldout_layout, random_scene, render_stored
from pipeline.vqgan.codec import (
    RELEASE_CKPT,
    RELEASE_CONFIG,
    SAMPLE_VQGAN_CONFIG,
    build_vqgan,
    decode,
    encode,
    first_stage_config,
    images_to_tensor,
    tensor_to_images,
)
from pipeline.vqgan.settings import VQGANTrainSettings

CARD_NAME = "README.md"
METRICS_NAME = "metrics.json"
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp"}
TRAINABLE_TARGET = "taming.models.vqgan.VQModel"


class VQGANTrainError(UserError):
    pass


@dataclass
class Quality:
    """How well a VQGAN reconstructs held-out images."""

    images: int
    psnr_db: float  # mean over images, uint8 pixels
    l1: float  # mean absolute error in [-1, 1] units
    codes_used: int
    codebook_size: int
    perplexity: float  # exp(entropy) of the code histogram: the effective number of codes
    judged_correct: float | None = None  # share the sample judge accepts (sample domain only)
    failures: list[str] = field(default_factory=list)  # a few captions the judge rejected, with why


@dataclass
class TrainReport:
    steps: int
    seconds: float
    images_per_second: float
    final_loss: float
    codes_restarted: int
    parameters: int
    checkpoint_bytes: int
    quality: Quality
    out: Path


class SampleImages:
    """The sample domain as `ttt preprocess` stores it, rendered on the fly; held-out layouts never train."""

    def __init__(self, image_size: int, seed: int) -> None:
        self.image_size = image_size
        self.rng = np.random.default_rng([seed, 1])
        self.heldout_rng = np.random.default_rng([seed, 2])

    def _render(self, rng: np.random.Generator, count: int, heldout: bool) -> tuple[np.ndarray, list[str]]:
        images, captions = [], []
        while len(images) < count:
            scene = random_scene(rng)
            if is_heldout_layout(scene) != heldout:
                continue
            side = int(rng.integers(96, 161))  # the sample's original sizes
            images.append(np.asarray(render_stored(scene, side, self.image_size)))
            captions.append(scene.caption)
        return np.stack(images), captions

    def train_batch(self, count: int) -> np.ndarray:
        return self._render(self.rng, count, heldout=False)[0]

    def heldout_set(self, count: int) -> tuple[np.ndarray, list[str] | None]:
        return self._render(self.heldout_rng, count, heldout=True)


class FolderImages:
    """A folder of the user's images, centre-cropped and resized; a seeded share is held out."""

    def __init__(self, folder: Path, image_size: int, seed: int, heldout: int) -> None:
        paths = sorted(p for p in Path(folder).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
        if not paths:
            raise VQGANTrainError(f"--images {folder} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
        images = [image for image in (load_square(p, image_size) for p in paths) if image is not None]
        if len(images) < 2:
            raise VQGANTrainError(f"--images {folder}: fewer than 2 readable images; need some to train and evaluate")
        order = np.random.default_rng([seed, 2]).permutation(len(images))
        held = min(heldout, max(1, len(images) // 10))  # never more than a tenth of a small folder
        pixels = np.stack(images)
        self.heldout_images, self.train_images = pixels[order[:held]], pixels[order[held:]]
        self.rng = np.random.default_rng([seed, 1])
        self.skipped = len(paths) - len(images)

    def train_batch(self, count: int) -> np.ndarray:
        return self.train_images[self.rng.integers(0, len(self.train_images), count)]

    def heldout_set(self, count: int) -> tuple[np.ndarray, list[str] | None]:
        return self.heldout_images[:count], None


def load_square(path: Path, size: int) -> np.ndarray | None:
    """An image centre-cropped to a square and resized to size x size RGB, or None if it cannot be read."""
    try:
        with Image.open(path) as image:
            image = image.convert("RGB")
    except (UnidentifiedImageError, OSError):
        return None
    side = min(image.size)
    left, top = (image.width - side) // 2, (image.height - side) // 2
    image = image.crop((left, top, left + side, top + side)).resize((size, size), Image.BOX)
    return np.asarray(image)


def codebook_statistics(codes: torch.Tensor, codebook_size: int) -> tuple[int, float]:
    """How many distinct codes occur, and the perplexity of their histogram."""
    counts = torch.bincount(codes.flatten(), minlength=codebook_size).double()
    probabilities = counts[counts > 0] / counts.sum()
    return int((counts > 0).sum()), float(torch.exp(-(probabilities * probabilities.log()).sum()))


@torch.no_grad()
def evaluate(model: torch.nn.Module, images: np.ndarray, captions: list[str] | None, batch_size: int = 50) -> Quality:
    """Reconstruct `images` through the same encode/decode path the pipeline uses, and measure them."""
    from pipeline.sample.judge import judge

    model.eval()
    codes, reconstructions = [], []
    for start in range(0, len(images), batch_size):
        batch = encode(model, images_to_tensor(images[start : start + batch_size]))
        codes.append(batch)
        reconstructions.append(tensor_to_images(decode(model, batch)))
    recon = np.concatenate(reconstructions)
    error = recon.astype(np.float64) - images.astype(np.float64)
    mse = np.maximum((error**2).mean(axis=(1, 2, 3)), 1e-10)
    codebook_size = model.quantize.n_e
    used, perplexity = codebook_statistics(torch.cat(codes), codebook_size)
    quality = Quality(
        images=len(images),
        psnr_db=float(np.mean(10 * np.log10(255.0**2 / mse))),
        l1=float(np.abs(error).mean() / 127.5),
        codes_used=used,
        codebook_size=codebook_size,
        perplexity=perplexity,
    )
    if captions is not None:
        verdicts = [judge(Image.fromarray(image), caption) for image, caption in zip(recon, captions, strict=True)]
        quality.judged_correct = sum(v.match for v in verdicts) / len(verdicts)
        rejected = [(c, v) for c, v in zip(captions, verdicts, strict=True) if not v.match]
        quality.failures = [f"{c}: {'; '.join(v.reasons)}" for c, v in rejected[:5]]
    return quality


def restart_dead_codes(quantizer: torch.nn.Module, used: torch.Tensor, latents: torch.Tensor) -> int:
    """Move codebook entries no batch chose onto random encoder outputs of the current batch."""
    dead = (~used).nonzero().flatten()
    if len(dead):
        flat = latents.detach().permute(0, 2, 3, 1).reshape(-1, latents.shape[1])
        picks = torch.randint(len(flat), (len(dead),), device=flat.device)
        with torch.no_grad():
            quantizer.embedding.weight[dead] = flat[picks]
    return len(dead)


def training_config(settings: VQGANTrainSettings) -> tuple[str, dict]:
    """The config file's text and its VQModel part; refuses to overwrite a checkpoint or to train another model."""
    out, config = Path(settings.out), Path(settings.config)
    if (out / RELEASE_CKPT).exists() and not settings.overwrite:
        raise VQGANTrainError(f"{out / RELEASE_CKPT} exists; pass --overwrite to replace it or choose another --out")
    if not config.is_file():
        raise VQGANTrainError(f"--config {config} does not exist")
    model_config = first_stage_config(config)
    if model_config["target"] != TRAINABLE_TARGET:
        raise VQGANTrainError(f"--config {config}: only {TRAINABLE_TARGET} can be trained here")
    return config.read_text(), model_config


def training_data(settings: VQGANTrainSettings, image_size: int, console: Console) -> SampleImages | FolderImages:
    """The sample domain rendered on the fly, or the user's folder of images."""
    if settings.images is None:
        return SampleImages(image_size, settings.seed)
    data = FolderImages(Path(settings.images), image_size, settings.seed, settings.heldout)
    if data.skipped:
        console.print(f"skipped {data.skipped} unreadable image(s) in {settings.images}")
    return data


def fit(model: torch.nn.Module, data: SampleImages | FolderImages, settings: VQGANTrainSettings) -> tuple[float, int]:
    """The training loop (Adam with taming's betas, one-cycle schedule); returns the last loss and codes restarted."""
    device = next(model.parameters()).device
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.learning_rate, betas=(0.5, 0.9))
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=settings.learning_rate, total_steps=settings.steps, pct_start=0.05
    )
    codebook_size = model.quantize.n_e
    used = torch.zeros(codebook_size, dtype=torch.bool, device=device)
    restarted, loss_value = 0, math.nan
    progress = tqdm(range(settings.steps), desc="training VQGAN", unit="step", dynamic_ncols=True)
    model.train()
    for step in progress:
        images = images_to_tensor(data.train_batch(settings.batch_size)).to(device)
        latents = model.quant_conv(model.encoder(images))
        quantized, codebook_loss, (_, _, indices) = model.quantize(latents)
        error = images - model.decode(quantized)
        loss = error.abs().mean() + error.pow(2).mean() + codebook_loss
        if not torch.isfinite(loss):
            raise VQGANTrainError(f"the loss became {loss.item()} at step {step}; lower --learning-rate")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        used |= torch.bincount(indices.flatten(), minlength=codebook_size).bool()
        if (step + 1) % settings.restart_every == 0:
            if step < 0.8 * settings.steps:
                restarted += restart_dead_codes(model.quantize, used, latents)
            used.zero_()
        loss_value = loss.item()
        progress.set_postfix(loss=f"{loss_value:.4f}", refresh=False)
    progress.close()
    return loss_value, restarted


def train_vqgan(settings: VQGANTrainSettings, console: Console | None = None) -> TrainReport:
    """Train, evaluate on held-out images, write the checkpoint, card and metrics to `settings.out`, report."""
    console = console or ttt_console()
    settings = replace(settings, config=settings.config or SAMPLE_VQGAN_CONFIG)
    config_text, model_config = training_config(settings)
    image_size = int(model_config["params"]["ddconfig"]["resolution"])
    if settings.threads:
        torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    device = torch.device(pick_device(settings.device))
    model = build_vqgan(model_config["target"], model_config["params"]).to(device)
    data = training_data(settings, image_size, console)
    started = time.perf_counter()
    final_loss, restarted = fit(model, data, settings)
    seconds = time.perf_counter() - started
    console.print(f"evaluating on {settings.heldout} held-out images")
    report = TrainReport(
        steps=settings.steps,
        seconds=seconds,
        images_per_second=settings.steps * settings.batch_size / seconds,
        final_loss=final_loss,
        codes_restarted=restarted,
        parameters=sum(p.numel() for p in model.parameters()),
        checkpoint_bytes=0,
        quality=evaluate(model, *data.heldout_set(settings.heldout)),
        out=Path(settings.out),
    )
    state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    write_release(Path(settings.out), config_text, state, settings, report)
    print_report(report, console)
    return report


def write_release(out: Path, config_text: str, state: dict, settings: VQGANTrainSettings, report: TrainReport) -> None:
    """Write the released-checkpoint layout; each file atomically, the checkpoint first."""
    buffer = io.BytesIO()
    torch.save({"state_dict": state, "global_step": settings.steps}, buffer)
    report.checkpoint_bytes = buffer.tell()
    write_atomic(out / RELEASE_CKPT, buffer.getvalue())
    if (out / RELEASE_CONFIG).resolve() != Path(settings.config).resolve():
        write_atomic(out / RELEASE_CONFIG, config_text.encode())
    metrics = {
        "training": {
            "config": Path(settings.config).name,
            "images": str(settings.images) if settings.images else "the embedded sample's domain",
            **{k: getattr(settings, k) for k in ("steps", "batch_size", "learning_rate", "seed", "restart_every")},
            "seconds": round(report.seconds, 1),
            "images_per_second": round(report.images_per_second, 2),
            "final_loss": report.final_loss,
            "codes_restarted": report.codes_restarted,
            "torch": torch.__version__,
            "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        },
        "parameters": report.parameters,
        "checkpoint_bytes": report.checkpoint_bytes,
        "heldout": asdict(report.quality),
    }
    write_atomic(out / METRICS_NAME, (json.dumps(metrics, indent=2) + "\n").encode())
    write_atomic(out / CARD_NAME, model_card(settings, report).encode())


def model_card(settings: VQGANTrainSettings, report: TrainReport) -> str:
    template = resources.files("data_cards").joinpath("vqgan_card.md").read_text()
    quality = report.quality
    data = (
        "the embedded sample's domain (coloured shapes), rendered on the fly the way `ttt preprocess` stores "
        "it (JPEG q95 originals of 96-160 px, area-downscaled, JPEG q95); one in ten scene layouts is held out"
        if settings.images is None
        else f"the images under `{settings.images}` (centre-cropped, resized), a seeded share held out"
    )
    judged = (
        f"{quality.judged_correct:.1%} of held-out reconstructions show exactly their caption's colours, shapes "
        "and arrangement (`pipeline.sample.judge`)"
        if quality.judged_correct is not None
        else "no judge for this domain"
    )
    return template.format(
        data=data,
        steps=settings.steps,
        batch_size=settings.batch_size,
        learning_rate=settings.learning_rate,
        seed=settings.seed,
        restart_every=settings.restart_every,
        minutes=report.seconds / 60,
        machine=f"{platform.machine()} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}",
        parameters=report.parameters,
        megabytes=report.checkpoint_bytes / 1e6,
        images=quality.images,
        psnr=quality.psnr_db,
        l1=quality.l1,
        judged=judged,
        used=quality.codes_used,
        codebook=quality.codebook_size,
        perplexity=quality.perplexity,
        command=f"ttt vqgan train --out OUT --steps {settings.steps} --batch-size {settings.batch_size} "
        f"--learning-rate {settings.learning_rate:g} --seed {settings.seed}",
    )


def print_report(report: TrainReport, console: Console) -> None:
    quality = report.quality
    table = Table(title="ttt vqgan train", show_header=False)
    speed = f"{report.images_per_second:.1f} images/s"
    table.add_row("steps", f"{report.steps:,} in {report.seconds / 60:.1f} min ({speed})")
    table.add_row("final training loss", f"{report.final_loss:.4f}")
    table.add_row("codes restarted", f"{report.codes_restarted:,}")
    table.add_row("parameters", f"{report.parameters:,}")
    table.add_row("held-out images", f"{quality.images:,}")
    table.add_row("PSNR", f"{quality.psnr_db:.2f} dB")
    if quality.judged_correct is not None:
        table.add_row("judged correct", f"{quality.judged_correct:.1%}")
    usage = f"{quality.codes_used} of {quality.codebook_size} (perplexity {quality.perplexity:.1f})"
    table.add_row("codes used", usage)
    table.add_row("checkpoint", f"{report.out / RELEASE_CKPT} ({report.checkpoint_bytes / 1e6:.2f} MB)")
    table.add_row("config", str(report.out / RELEASE_CONFIG))
    table.add_row("model card", str(report.out / CARD_NAME))
    console.print(table)
