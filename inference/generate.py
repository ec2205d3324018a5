"""`ttt generate "a prompt"`: checkpoint -> sampled codes -> VQGAN decode -> (re-rank) -> PNGs.

    checkpoint (./ckpt or hf://ORG/NAME)   the transformer `ttt train` saved, with the dataset facts it trained on
    VQGAN (sample's, or --vqgan-*)         must be the one that encoded the training data: checked first
    sample_codes (sampling.py)             M samples in batches, KV-cached, temperature / top-k / top-p, seeded
    decode                                 taming VQGAN, the same loader as the pipeline
    rerank (rerank.py, optional)           CLIP image-text similarity keeps the best K; otherwise the first K
    write                                  one PNG per kept image and a captioned grid, written atomically

For prompts of the embedded sample's grammar decoded by the sample VQGAN, the sample judge
says how many of the kept images show what the prompt says.
"""

from __future__ import annotations

import functools
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from PIL import Image
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from inference.sampling import sample_codes
from inference.settings import GenerateError, GenerateSettings, SamplingSettings
from pipeline.core.console import ttt_console
from pipeline.core.devices import pick_device
from pipeline.core.hub import explain_hub_error, is_hub_url, parse_hub_url
from pipeline.core.shard_format import VQGANIdentity
from pipeline.vqgan.codec import (
    VQGANSpec,
    check_same_vqgan,
    decode,
    load_vqgan,
    sample_vqgan_spec,
    tensor_to_images,
    vqgan_from_flags,
)
from pipeline.vqgan.grid import captioned_grid, write_png
from training.checkpoint import CONFIG, LATEST, TOKENIZER, WEIGHTS, Checkpoint, load_checkpoint

if TYPE_CHECKING:
    from inference.rerank import ClipReranker

PROGRESS_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} images [{elapsed}<{remaining}]"
GRID_TILE = 128  # grid tiles are upscaled (nearest) to at least this side so captions fit under them


@dataclass
class Generated:
    """What one `generate` call made."""

    prompt: str
    step: int
    tokenizer: str  # the name of the tokenizer the prompt was encoded with
    images: list[Image.Image]  # the kept images, best first when re-ranked
    paths: list[Path]
    grid_path: Path
    sampled: int
    seconds: float
    scores: list[float] | None = None  # CLIP similarity of the kept images
    judged: list[bool] | None = None  # the sample judge's verdicts, for sample-domain prompts


def fetch_hub_checkpoint(source: str) -> Path:
    """Download the latest step of a checkpoint folder pushed to a Hub model repo (hf://ORG/NAME):
    latest.json, then only that step's config, weights and tokenizer."""
    from huggingface_hub import hf_hub_download

    repo_id = parse_hub_url(source, "model").repo_id
    try:
        latest = json.loads(Path(hf_hub_download(repo_id, LATEST)).read_text())
        config_path = Path(hf_hub_download(repo_id, f"{latest['path']}/{CONFIG}"))
        names = [WEIGHTS] + ([TOKENIZER] if json.loads(config_path.read_text()).get("tokenizer") == TOKENIZER else [])
        for name in names:
            hf_hub_download(repo_id, f"{latest['path']}/{name}")
    except Exception as err:  # HTTP, offline, auth and not-found errors alike (hf_hub_download retries 429 itself)
        raise GenerateError(f"cannot fetch checkpoint {source} from the Hub: {explain_hub_error(err)}") from None
    return config_path.parent


def open_checkpoint(source: str, device: str | torch.device) -> Checkpoint:
    """The checkpoint in a local checkpoint folder, a step folder or hf://ORG/NAME."""
    folder = fetch_hub_checkpoint(source) if is_hub_url(source) else Path(source)
    if not folder.exists():
        raise GenerateError(f"checkpoint {folder} does not exist; train one with `ttt train` or pass --checkpoint")
    return load_checkpoint(folder, device)


def check_decoder(checkpoint: Checkpoint, spec: VQGANSpec) -> None:
    """Refuse a VQGAN that cannot decode what the transformer learned to predict, naming both."""
    config, dataset = checkpoint.model.config, checkpoint.config.get("dataset") or {}
    trained_on = f"checkpoint step {checkpoint.step} ({config.grid}x{config.grid} codes from {config.codebook_size})"
    decoder = f"VQGAN {spec.config_path.name} ({spec.codebook_size} codes, factor {spec.downsample_factor})"
    if spec.codebook_size != config.codebook_size:
        raise GenerateError(
            f"{trained_on} does not match {decoder}: the codebook sizes differ; pass the VQGAN "
            "the training data was encoded with (--vqgan-config/--vqgan-ckpt)"
        )
    if dataset.get("vqgan"):
        check_same_vqgan(spec, VQGANIdentity(**dataset["vqgan"]), f"{trained_on} was trained on codes of")
    image_size = dataset.get("image_size")
    if image_size and image_size != config.grid * spec.downsample_factor:
        raise GenerateError(
            f"{trained_on} was trained on {image_size} px images (factor {image_size // config.grid}), but the "
            f"{decoder} would decode its grid to {config.grid * spec.downsample_factor} px; pass the VQGAN the "
            "training data was encoded with (--vqgan-config/--vqgan-ckpt)"
        )


def inference_dtype(device: torch.device) -> torch.dtype:
    """Half precision on GPUs (bf16 where supported): sampling is memory-bound there; fp32 on CPUs."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def sample_images(
    checkpoint: Checkpoint,
    vqgan: torch.nn.Module,
    prompt: str,
    num_samples: int,
    batch_size: int,
    sampling: SamplingSettings,
    seed: int,
    show_progress: bool = True,
) -> list[Image.Image]:
    """`num_samples` decoded images for `prompt`, sampled in batches, with a progress bar."""
    model = checkpoint.model
    config, device = model.config, next(model.parameters()).device
    text_ids = checkpoint.tokenizer.encode_batch([prompt], config.text_len)
    text = torch.from_numpy(text_ids).to(device)
    generator = torch.Generator(device).manual_seed(seed)
    images = []
    progress = tqdm(
        total=num_samples, desc="sampling", bar_format=PROGRESS_FORMAT, dynamic_ncols=True, disable=not show_progress
    )
    for start in range(0, num_samples, batch_size):
        batch = min(batch_size, num_samples - start)
        advance = functools.partial(progress.update, batch / config.image_tokens)
        codes = sample_codes(model, text.expand(batch, -1), sampling, generator, on_code=advance)
        grid = codes.view(batch, config.grid, config.grid)
        images += [Image.fromarray(pixels) for pixels in tensor_to_images(decode(vqgan, grid))]
    progress.close()
    return images


def draw_previews(
    source: str, prompts: list[str], vqgan_config: str | None, vqgan_ckpt: str | None
) -> list[Image.Image]:
    """One image per prompt (seeds 0, 1, ...) from the checkpoint at SOURCE, on the CPU: a monitor's previews."""
    checkpoint = open_checkpoint(source, "cpu")
    spec = vqgan_from_flags(vqgan_config, vqgan_ckpt)
    check_decoder(checkpoint, spec)
    vqgan = load_vqgan(spec, "cpu")
    return [
        sample_images(checkpoint, vqgan, prompt, 1, 1, SamplingSettings(), seed, show_progress=False)[0]
        for seed, prompt in enumerate(prompts)
    ]


def slug(prompt: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")[:60] or "prompt"


def grid_image(images: list[Image.Image], captions: list[str]) -> Image.Image:
    side = max(images[0].width, GRID_TILE)
    tiles = [image.resize((side, side), Image.NEAREST) for image in images]
    return captioned_grid([tiles], captions, columns_per_row=min(len(images), 4))


def judge_images(images: list[Image.Image], prompt: str, spec: VQGANSpec) -> list[bool] | None:
    """The sample judge's verdicts when the prompt and the VQGAN are the embedded sample's; else None."""
    from pipeline.sample.judge import judge, parse_caption

    if parse_caption(prompt) is None or spec.identity != sample_vqgan_spec().identity:
        return None
    return [judge(image, prompt).match for image in images]


def keep_best(
    images: list[Image.Image], keep: int, prompt: str, reranker: ClipReranker | None
) -> tuple[list[Image.Image], list[float] | None]:
    """The `keep` images CLIP finds most similar to the prompt, best first (and their scores); else the first."""
    if reranker is None:
        return images[:keep], None
    similarity = reranker.scores(images, prompt)
    order = similarity.argsort(descending=True)[:keep].tolist()
    return [images[i] for i in order], [float(similarity[i]) for i in order]


def write_outputs(
    images: list[Image.Image], judged: list[bool] | None, settings: GenerateSettings
) -> tuple[list[Path], Path]:
    """One PNG per image and a captioned grid (marked [ok]/[no] where judged), each written atomically."""
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{slug(settings.prompt)}-seed{settings.seed}"
    paths = [out / f"{name}-{index:03d}.png" for index in range(len(images))]
    for image, path in zip(images, paths, strict=True):
        write_png(image, path)
    captions = [settings.prompt] * len(images)
    if judged is not None:
        captions = [f"{settings.prompt} [{'ok' if ok else 'no'}]" for ok in judged]
    grid_path = out / f"{name}-grid.png"
    write_png(grid_image(images, captions), grid_path)
    return paths, grid_path


def generate(settings: GenerateSettings, console: Console | None = None, as_json: bool = False) -> Generated:
    """Draw, judge and write the images of `settings`, and report them (`as_json`: as one JSON document on stdout,
    the rest on stderr)."""
    console = console or ttt_console(stderr=as_json)
    started = time.perf_counter()
    device = torch.device(pick_device(settings.device))
    spec = vqgan_from_flags(settings.vqgan_config, settings.vqgan_ckpt)
    checkpoint = open_checkpoint(settings.checkpoint, device)
    check_decoder(checkpoint, spec)
    unknown = checkpoint.tokenizer.unknown_words(settings.prompt)
    if unknown:
        words = ", ".join(repr(word) for word in dict.fromkeys(unknown))
        console.print(f"[yellow]the model's tokenizer has no token for {words}: each reads as its unknown token[/]")
    reranker = None
    if settings.rerank_clip:
        from inference.rerank import ClipReranker

        reranker = ClipReranker(settings.rerank_clip, device)  # before sampling: a bad spec fails fast
    checkpoint.model.to(inference_dtype(device))
    vqgan = load_vqgan(spec, device)
    sampled = sample_images(
        checkpoint, vqgan, settings.prompt, settings.num_samples, settings.batch_size, settings.sampling, settings.seed
    )
    images, scores = keep_best(sampled, settings.keep or settings.num_samples, settings.prompt, reranker)
    judged = judge_images(images, settings.prompt, spec)
    paths, grid_path = write_outputs(images, judged, settings)
    result = Generated(
        prompt=settings.prompt,
        step=checkpoint.step,
        tokenizer=checkpoint.tokenizer.name,
        images=images,
        paths=paths,
        grid_path=grid_path,
        sampled=len(sampled),
        seconds=time.perf_counter() - started,
        scores=scores,
        judged=judged,
    )
    if as_json:
        print(json.dumps(generated_document(result, settings)), flush=True)
    else:
        report(result, settings, console)
    return result


def generated_document(result: Generated, settings: GenerateSettings) -> dict:
    """What `ttt generate --json` prints: the report's facts and the files written."""
    return {
        "prompt": result.prompt,
        "checkpoint": str(settings.checkpoint),
        "step": result.step,
        "tokenizer": result.tokenizer,
        "seed": settings.seed,
        "sampled": result.sampled,
        "images": [str(path) for path in result.paths],
        "grid": str(result.grid_path),
        "clip_scores": result.scores,
        "judged": None if result.judged is None else [bool(ok) for ok in result.judged],
        "seconds": result.seconds,
    }


def report(result: Generated, settings: GenerateSettings, console: Console) -> None:
    table = Table(title=f"ttt generate: {result.prompt!r}", show_header=False)
    table.add_row("checkpoint", f"{settings.checkpoint} (global step {result.step}, {result.tokenizer} tokenizer)")
    sampling = settings.sampling
    top_k = sampling.top_k or "off"
    top_p = sampling.top_p if sampling.top_p < 1 else "off"
    table.add_row("sampling", f"temperature {sampling.temperature}, top-k {top_k}, top-p {top_p}, seed {settings.seed}")
    reranked = " (CLIP re-ranked)" if result.scores is not None else ""
    table.add_row("images", f"{result.sampled} sampled, {len(result.images)} kept{reranked}")
    if result.scores is not None:
        table.add_row("CLIP similarity of kept", f"{min(result.scores):.3f} .. {max(result.scores):.3f}")
    if result.judged is not None:
        accepted = sum(result.judged)
        table.add_row("sample judge", f"{accepted} of {len(result.judged)} accepted")
    table.add_row("time", f"{result.seconds:.1f} s")
    table.add_row("written", f"{len(result.paths)} PNGs and {result.grid_path}")
    console.print(table)
