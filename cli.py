"""The `ttt` command line: parses options, then calls one function per command.

Heavy imports happen inside each command, so a volunteer who only trains never needs
the preprocessing stack (and vice versa).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from pipeline.errors import UserError


def _fail_cleanly(run):
    """Turn a user mistake into one line (click's `Error: ...`), an interrupt into exit 130."""
    try:
        return run()
    except UserError as err:
        raise click.ClickException(str(err)) from None
    except KeyboardInterrupt:
        click.echo("Aborted.", err=True)
        sys.exit(130)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="ttt")
def main() -> None:
    """ttt: preprocess image-caption data into VQGAN codes, train a DALL-E-like model together, generate images."""


@main.command(short_help="Make a VQGAN-code dataset from image-caption metadata (Dask).")
@click.option(
    "--input",
    "inputs",
    multiple=True,
    metavar="GLOB",
    help="Metadata files (parquet/csv/tsv; globs; repeatable). Default: the embedded sample.",
)
@click.option(
    "--input-format", type=click.Choice(["parquet", "csv", "tsv"]), help="Override the format the file suffix implies."
)
@click.option(
    "--from-images", type=click.Path(file_okay=False), help="An img2dataset output folder: skip the download."
)
@click.option(
    "--output",
    default="./ttt-data",
    show_default=True,
    help="Output folder, or hf://datasets/ORG/NAME to publish to the Hub (token from HF_TOKEN).",
)
@click.option("--local-dir", help="Where an hf:// output is staged locally [default: ./NAME].")
@click.option("--shards", default=8, show_default=True, help="Number of output shards (units of work).")
@click.option("--image-size", type=int, help="Image side in pixels [default: 64 for the sample, 256 otherwise].")
@click.option("--resize-mode", type=click.Choice(["center_crop", "border"]), default="center_crop", show_default=True)
@click.option("--vqgan-config", type=click.Path(dir_okay=False), help="taming-transformers VQGAN YAML.")
@click.option("--vqgan-ckpt", type=click.Path(dir_okay=False), help="The matching .ckpt (with state_dict).")
@click.option("--url-col", default="URL", show_default=True)
@click.option("--caption-col", default="TEXT", show_default=True)
@click.option("--width-col", default="WIDTH", show_default=True)
@click.option("--height-col", default="HEIGHT", show_default=True)
@click.option("--nsfw-col", default="NSFW", show_default=True)
@click.option("--key-col", default="SAMPLE_ID", show_default=True, help="Stable key column (absent: hash of the URL).")
@click.option("--similarity-col", default="similarity", show_default=True)
@click.option("--license-col", default="LICENSE", show_default=True)
@click.option("--min-caption-length", default=3, show_default=True, help="Drop shorter captions (0: keep all).")
@click.option("--max-aspect-ratio", default=2.0, show_default=True, help="Drop wider/taller images (0: no limit).")
@click.option(
    "--allowed-nsfw", default="UNLIKELY", show_default=True, help="Comma-separated NSFW labels to keep, or 'any'."
)
@click.option("--allow-nonpositive-size", is_flag=True, help="Keep rows whose width/height is missing or <= 0.")
@click.option("--keep-duplicate-urls", is_flag=True, help="Keep every row of a repeated URL.")
@click.option("--scheduler", metavar="ADDRESS", help="Use an existing Dask scheduler (e.g. tcp://10.0.0.5:8786).")
@click.option("--workers", type=int, help="LocalCluster worker processes [default: one per core].")
@click.option("--device", default="auto", show_default=True, help="Encode on auto|cpu|cuda|cuda:N.")
@click.option(
    "--precision",
    type=click.Choice(["fp32", "bf16", "fp16"]),
    default="fp32",
    show_default=True,
    help="Encoder precision (reduced precision only helps on GPUs).",
)
@click.option("--batch-size", default=32, show_default=True, help="Images per encoder batch.")
@click.option(
    "--compression-level",
    type=click.IntRange(1, 11),
    default=11,
    show_default=True,
    help="Brotli level of the shards (10-11 pack 13-bit codes ~8%% smaller; lower writes faster).",
)
@click.option("--timeout", default=10.0, show_default=True, help="Download timeout per image, seconds.")
@click.option("--retries", default=0, show_default=True, help="Download retries per image.")
@click.option("--download-threads", default=32, show_default=True, help="Download threads per shard task.")
@click.option("--sample-rows", default=1200, show_default=True, help="Rows of the embedded sample.")
@click.option("--sample-port", default=18753, show_default=True, help="Port of the sample's local HTTP server.")
@click.option("--license", "license_", default="other", show_default=True, help="License id for the data card.")
@click.option("--overwrite", is_flag=True, help="Replace a dataset made with different settings.")
@click.option("--dry-run", is_flag=True, help="With an hf:// output: list what would be uploaded, send nothing.")
def preprocess(**kw) -> None:
    """Filter -> download (img2dataset) -> VQGAN-encode -> Brotli parquet shards -> data card -> publish.

    Runs on Dask; re-running the same command after a crash or Ctrl-C resumes.
    """
    from pipeline.filters import FilterConfig
    from pipeline.metadata import ColumnMap
    from pipeline.preprocess import PreprocessOptions
    from pipeline.preprocess import preprocess as run_preprocess

    columns = ColumnMap(
        key=kw["key_col"] or None,
        url=kw["url_col"],
        caption=kw["caption_col"],
        width=kw["width_col"] or None,
        height=kw["height_col"] or None,
        nsfw=kw["nsfw_col"] or None,
        similarity=kw["similarity_col"] or None,
        license=kw["license_col"] or None,
    )
    allowed = kw["allowed_nsfw"].strip()
    filters = FilterConfig(
        min_caption_length=kw["min_caption_length"],
        max_aspect_ratio=kw["max_aspect_ratio"] or None,
        allowed_nsfw=None if allowed.lower() == "any" else tuple(x.strip() for x in allowed.split(",") if x.strip()),
        require_positive_size=not kw["allow_nonpositive_size"],
        dedupe_urls=not kw["keep_duplicate_urls"],
    )
    options = PreprocessOptions(
        inputs=list(kw["inputs"]),
        input_format=kw["input_format"],
        columns=columns,
        filters=filters,
        from_images=kw["from_images"],
        output=kw["output"],
        local_dir=kw["local_dir"],
        shards=kw["shards"],
        image_size=kw["image_size"],
        resize_mode=kw["resize_mode"],
        vqgan_config=kw["vqgan_config"],
        vqgan_ckpt=kw["vqgan_ckpt"],
        scheduler=kw["scheduler"],
        workers=kw["workers"],
        device=kw["device"],
        precision=kw["precision"],
        batch_size=kw["batch_size"],
        compression_level=kw["compression_level"],
        timeout=kw["timeout"],
        retries=kw["retries"],
        download_threads=kw["download_threads"],
        sample_rows=kw["sample_rows"],
        sample_port=kw["sample_port"],
        overwrite=kw["overwrite"],
        dry_run=kw["dry_run"],
        license=kw["license_"],
        command=shlex.join(["ttt", *sys.argv[1:]]),
    )
    _fail_cleanly(lambda: run_preprocess(options))


@main.group(short_help="Train a small VQGAN on the sample domain or your own images.")
def vqgan() -> None:
    """The VQGAN that turns images into codes: train a small one for a small domain."""


@vqgan.command("train", short_help="Train a small taming VQModel on CPU; writes the released checkpoint layout.")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default="./vqgan",
    show_default=True,
    help="Writes configs/model.yaml, checkpoints/last.ckpt, README.md (model card), metrics.json.",
)
@click.option(
    "--images",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="A folder of your images (searched recursively). Default: the embedded sample's domain.",
)
@click.option(
    "--config",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A taming VQModel YAML. Default: the sample VQGAN's architecture.",
)
@click.option("--steps", type=click.IntRange(min=1), default=1500, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--learning-rate", type=click.FloatRange(min=0, min_open=True), default=2e-3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--heldout",
    type=click.IntRange(min=1),
    default=400,
    show_default=True,
    help="Held-out images to measure reconstruction on.",
)
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:1, ...")
@click.option("--threads", type=click.IntRange(min=1), help="CPU threads for torch [default: all cores].")
@click.option("--overwrite", is_flag=True, help="Replace a checkpoint already in --out.")
def vqgan_train(**kw) -> None:
    """Train with L1 + L2 + codebook loss (no LPIPS/discriminator), then measure held-out PSNR, codebook use and,
    on the sample domain, how many reconstructions the sample judge accepts."""
    from pipeline.vqgan_train import VQGANTrainSettings, train_vqgan

    if kw["config"] is None:
        del kw["config"]
    _fail_cleanly(lambda: train_vqgan(VQGANTrainSettings(**kw)))


@main.command("stream-bench", short_help="Measure how fast the streaming loader feeds a trainer from a dataset.")
@click.argument("dataset", default="./ttt-data")
@click.option("--batch-size", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--text-len", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--workers", type=click.IntRange(min=0), default=0, show_default=True, help="DataLoader workers.")
@click.option("--shuffle-buffer", type=click.IntRange(min=0), default=10_000, show_default=True)
@click.option("--seconds", type=click.FloatRange(min=0.1), default=10.0, show_default=True, help="Per measurement.")
def stream_bench(dataset: str, **kw) -> None:
    """DATASET: a dataset folder, a glob of parquet files, or hf://datasets/ORG/NAME."""
    from pipeline.stream_bench import bench_stream

    _fail_cleanly(lambda: bench_stream(dataset, num_workers=kw.pop("workers"), **kw))


@main.command(short_help="Join (or start) a collaborative training run as one hivemind peer.")
@click.option("--stream", is_flag=True, help="Stream the dataset (always on: a dataset is never downloaded whole).")
@click.option(
    "--dataset", default="./ttt-data", show_default=True, help="Folder, parquet glob or hf://datasets/ORG/NAME."
)
@click.option(
    "--run-id", default="ttt-demo", show_default=True, help="The run to join: peers with the same id train together."
)
@click.option("--preset", type=click.Choice(["tiny", "small", "ttt-1.1b"]), default="tiny", show_default=True)
@click.option("--initial-peers", multiple=True, metavar="MULTIADDR", help="A running peer's address (repeatable).")
@click.option("--host-maddrs", multiple=True, default=["/ip4/0.0.0.0/tcp/0"], show_default=True)
@click.option(
    "--announce-maddrs", multiple=True, help="Public addresses to announce (behind NAT with port forwarding)."
)
@click.option("--identity", "identity_path", help="Private key file: a persistent peer id across restarts.")
@click.option("--client-mode", is_flag=True, help="For peers that cannot accept connections (NAT, notebooks).")
@click.option(
    "--target-batch-size",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Samples per global step, whole swarm.",
)
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True, help="This peer's batch.")
@click.option("--learning-rate", type=click.FloatRange(min=0, min_open=True), help="Peak LR [default: the preset's].")
@click.option("--total-steps", type=click.IntRange(min=1), help="Length of the LR schedule [default: the preset's].")
@click.option("--max-steps", type=click.IntRange(min=1), help="Stop after this many global steps.")
@click.option(
    "--wait-for-peers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Start training once this many peers (this one included) have joined the run.",
)
@click.option("--checkpoint-dir", default="./ckpt", show_default=True)
@click.option("--checkpoint-every", type=click.IntRange(min=1), default=10, show_default=True, help="Global steps.")
@click.option("--resume", is_flag=True, help="Continue from the latest checkpoint in --checkpoint-dir.")
@click.option("--name", "display_name", default="", help="Shown on the run's leaderboard [default: peer id].")
@click.option("--device", default="auto", show_default=True)
@click.option("--threads", type=click.IntRange(min=1), help="CPU threads for torch.")
@click.option("--loader-workers", type=click.IntRange(min=0), default=1, show_default=True)
@click.option("--matchmaking-time", type=click.FloatRange(min=0.1), default=5.0, show_default=True)
@click.option("--averaging-timeout", type=click.FloatRange(min=1), default=60.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Initialisation shared by a run's first peers.")
def train(stream: bool, **kw) -> None:
    """Train the DALL-E-like model together with the other peers of --run-id (hivemind)."""
    from training.peer import PeerSettings
    from training.peer import train as run_train

    kw["initial_peers"] = list(kw["initial_peers"])
    kw["host_maddrs"] = list(kw["host_maddrs"])
    kw["announce_maddrs"] = list(kw["announce_maddrs"])
    _fail_cleanly(lambda: run_train(PeerSettings(**kw)))


@main.command(short_help="Draw images for a prompt with a trained checkpoint (KV-cached sampling, VQGAN decode).")
@click.argument("prompt")
@click.option(
    "--checkpoint", default="./ckpt", show_default=True, help="Checkpoint folder, step folder or hf://ORG/NAME."
)
@click.option("--out", default="./samples", show_default=True, help="Folder for the PNGs and the grid.")
@click.option("--num-samples", type=click.IntRange(min=1), default=8, show_default=True, help="Images to sample.")
@click.option("--keep", type=click.IntRange(min=1), help="Keep the best K (CLIP) or first K [default: all].")
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True, help="Images sampled at once.")
@click.option("--temperature", type=click.FloatRange(min=0), default=1.0, show_default=True, help="0: greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="Keep the k likeliest codes.")
@click.option(
    "--top-p",
    type=click.FloatRange(min=0, max=1, min_open=True),
    default=0.75,
    show_default=True,
    help="Keep the likeliest codes whose probability reaches p (nucleus; 1: off).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--vqgan-config", type=click.Path(dir_okay=False), help="The data's VQGAN YAML [default: sample].")
@click.option("--vqgan-ckpt", type=click.Path(dir_okay=False), help="The data's VQGAN checkpoint.")
@click.option(
    "--rerank-clip", metavar="MODEL:WEIGHTS", help="CLIP re-ranking: ViT-B-32:/path/clip.pt or local-dir:DIR."
)
@click.option("--device", default="auto", show_default=True, help="auto|cpu|cuda|cuda:N.")
def generate(prompt: str, **kw) -> None:
    """Sample images for PROMPT from a `ttt train` checkpoint and write them as PNGs plus a captioned grid."""
    from inference.generate import GenerateSettings
    from inference.generate import generate as run_generate

    _fail_cleanly(lambda: run_generate(GenerateSettings(prompt, **kw)))


@main.command(short_help="The whole loop offline: preprocess the sample, train with 2 local peers, generate.")
@click.option("--steps", type=click.IntRange(min=1), default=200, show_default=True, help="Global training steps.")
@click.option("--peers", type=click.IntRange(min=1), default=2, show_default=True, help="Local hivemind peers.")
@click.option("--samples-per-prompt", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--dataset", default="./ttt-data", show_default=True)
@click.option("--checkpoint-dir", default="./ckpt", show_default=True)
@click.option("--out", default="./samples", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def demo(**kw) -> None:
    """Preprocess the embedded sample, train the tiny preset with local peers, draw prompts it saw and never saw,
    and print how many images the sample judge accepts."""
    from inference.demo import DemoSettings, run_demo

    _fail_cleanly(lambda: run_demo(DemoSettings(**kw)))


@main.command(short_help="Push a dataset folder to the Hugging Face Hub (resumable).")
@click.argument("folder", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("target", metavar="hf://datasets/ORG/NAME")
@click.option("--dry-run", is_flag=True, help="List what would be uploaded, send nothing.")
def publish(folder: Path, target: str, dry_run: bool) -> None:
    """Push a dataset folder to the Hub in batched commits; re-running resumes a partial upload."""
    from pipeline.publish import publish as run_publish

    _fail_cleanly(lambda: run_publish(folder, target, dry_run=dry_run, echo=click.echo))


@main.command(short_help="Show a dataset's facts and decode samples back to a PNG grid.")
@click.argument("dataset", type=click.Path(exists=True, file_okay=False, path_type=Path), default="./ttt-data")
@click.option("--show", default=16, show_default=True, help="Rows to decode into the grid (0: facts only).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default="inspect.png", show_default=True)
@click.option("--vqgan-config", type=click.Path(dir_okay=False), help="The dataset's VQGAN YAML [default: sample].")
@click.option("--vqgan-ckpt", type=click.Path(dir_okay=False), help="The dataset's VQGAN checkpoint.")
@click.option("--device", default="auto", show_default=True, help="Decode on auto|cpu|cuda.")
def inspect(dataset: Path, show: int, out: Path, vqgan_config: str, vqgan_ckpt: str, device: str) -> None:
    """Print DATASET's facts and row counts, and decode its first rows to a captioned PNG grid.

    For the embedded sample the grid shows each caption's scene beside the decoded codes.
    """
    from pipeline.inspect_dataset import inspect_dataset

    _fail_cleanly(lambda: inspect_dataset(dataset, show, out, vqgan_config, vqgan_ckpt, device))


if __name__ == "__main__":
    main()
