"""`ttt preprocess`: metadata -> filters -> download -> VQGAN encode -> Brotli parquet shards -> card -> publish.

Everything that can be checked is checked before any work starts (input, columns,
VQGAN, output settings, Hub token). Then each unfinished shard becomes one Dask task
chain; the driver writes each finished shard atomically and records it in the
manifest, so a killed run resumes where it stopped and ends with the same dataset.
"""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from rich.console import Console
from tqdm import tqdm

from pipeline.core.console import ttt_console
from pipeline.core.errors import UserError
from pipeline.core.filters import apply_filters
from pipeline.core.fingerprint import as_saved, differing_keys, fingerprint
from pipeline.core.layout import DATA_DIR
from pipeline.core.shard_format import DatasetFacts
from pipeline.preprocess.card import CARD_NAME, render_card, write_card
from pipeline.preprocess.download import DownloadSettings
from pipeline.preprocess.encode import EncodeSettings
from pipeline.preprocess.graph import ShardJob, StallReport, dask_client, gather_as_completed, submit_shards
from pipeline.preprocess.manifest import MANIFEST_NAME, Manifest
from pipeline.preprocess.metadata import expand_inputs, read_metadata
from pipeline.preprocess.options import ColumnMap, PreprocessOptions
from pipeline.preprocess.publish import check_hub_ready, publish
from pipeline.preprocess.report import RunSummary
from pipeline.preprocess.writer import ShardBlob, WriteSettings, write_shard
from pipeline.sample import MIN_SAMPLE_ROWS, SAMPLE_VERSION
from pipeline.sample.domain import serve_folder, write_sample
from pipeline.vqgan.codec import SAMPLE_VQGAN_DIR, VQGANSpec, check_checkpoint, vqgan_from_flags

SAMPLE_IMAGE_SIZE = 64
DEFAULT_IMAGE_SIZE = 256


class PreprocessError(UserError):
    pass


@dataclass
class InputRows:
    rows: pd.DataFrame
    settings: dict  # what identifies the input in the fingerprint
    description: str  # for the data card


def resolve_vqgan(options: PreprocessOptions) -> tuple[VQGANSpec, str | None]:
    """The user's VQGAN, or the embedded sample's (with a note for the card on how well it reconstructs)."""
    spec = vqgan_from_flags(options.vqgan_config, options.vqgan_ckpt)
    if not options.vqgan_config:
        return spec, sample_vqgan_note()
    check_checkpoint(spec)
    return spec, None


def sample_vqgan_note() -> str:
    heldout = json.loads((SAMPLE_VQGAN_DIR / "metrics.json").read_text())["heldout"]
    return (
        "The codes were made with the embedded sample VQGAN (`pipeline/vqgan/assets/sample_vqgan`, trained by "
        f"`ttt vqgan train`). On held-out images it reconstructs at {heldout['psnr_db']:.1f} dB PSNR, and "
        f"{heldout['judged_correct']:.1%} of its reconstructions show what their caption says (the sample judge)."
    )


def read_input(options: PreprocessOptions, stack: ExitStack, console: Console) -> InputRows:
    """Read the rows to process: user metadata, an img2dataset output, or the embedded sample."""
    filters = options.filters
    if options.from_images:
        from pipeline.preprocess.img2dataset_output import read_records

        rows = read_records(Path(options.from_images))
        folder = str(Path(options.from_images).resolve())
        return InputRows(rows, {"from_images": folder, "rows": len(rows)}, f"img2dataset output in `{folder}`")
    if options.inputs:
        files = expand_inputs(options.inputs)
        rows = read_metadata(files, options.columns, filters.needs_size, filters.needs_nsfw, options.input_format)
        identity = [{"path": str(f), "bytes": f.stat().st_size} for f in files]
        names = ", ".join(f.name for f in files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
        return InputRows(
            rows,
            {"files": identity, "format": options.input_format, "columns": asdict(options.columns)},
            f"{len(files)} metadata file(s): {names}",
        )
    # The embedded sample: generated for this run and served on 127.0.0.1 while the run lasts.
    folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ttt-sample-")))
    try:
        base_url = stack.enter_context(serve_folder(folder, options.sample_port, options.sample_latency))
    except OSError as err:
        raise PreprocessError(str(err)) from None
    metadata = write_sample(folder, base_url, options.sample_rows)
    console.print(f"embedded sample: {options.sample_rows} rows served from {base_url}")
    rows = read_metadata([metadata], ColumnMap(), filters.needs_size, filters.needs_nsfw)
    identity = {"sample": {"version": SAMPLE_VERSION, "rows": options.sample_rows, "port": options.sample_port}}
    return InputRows(rows, identity, f"the embedded synthetic sample ({options.sample_rows} rows, LAION format)")


def prepare_output(folder: Path, settings: dict, num_shards: int, overwrite: bool) -> Manifest:
    """Load the manifest of a run with the same settings, or start a new one; refuse to mix settings."""
    settings = as_saved(settings)
    current = fingerprint(settings)
    manifest = Manifest.load(folder)
    if manifest is not None and manifest.fingerprint != current and not overwrite:
        changed = ", ".join(differing_keys(manifest.settings, settings))
        raise PreprocessError(
            f"{folder} holds a dataset made with different settings ({changed}); "
            "pass --overwrite to replace it or choose another --dataset"
        )
    if manifest is None and folder.exists() and any(folder.iterdir()) and not overwrite:
        raise PreprocessError(f"{folder} exists and is not a ttt dataset; pass --overwrite or choose another --dataset")
    if overwrite and (manifest is None or manifest.fingerprint != current):
        shutil.rmtree(folder / DATA_DIR, ignore_errors=True)
        for name in (MANIFEST_NAME, CARD_NAME):
            (folder / name).unlink(missing_ok=True)
        manifest = None
    for partial in (folder / DATA_DIR).glob(".*.partial-*"):
        partial.unlink()  # left by a killed run; never part of the dataset
    if manifest is None:
        manifest = Manifest(fingerprint=current, settings=settings, num_shards=num_shards)
        folder.mkdir(parents=True, exist_ok=True)
        manifest.save(folder)
    return manifest


def plan_shards(rows: pd.DataFrame, num_shards: int) -> list[pd.DataFrame]:
    """Split the filtered rows, in order, into `num_shards` contiguous shards of near-equal size."""
    bounds = np.linspace(0, len(rows), num_shards + 1).round().astype(int)
    return [rows.iloc[bounds[i] : bounds[i + 1]].reset_index(drop=True) for i in range(num_shards)]


@dataclass(frozen=True)
class Target:
    """Where the dataset is written: a local folder, staged for a Hub repository when `repo_id` is set."""

    folder: Path
    repo_id: str | None


def check_target(options: PreprocessOptions) -> Target:
    """Refuse options that cannot work before any work starts (a Hub target without a token included)."""
    if options.shards < 1:
        raise PreprocessError("--shards must be at least 1")
    if not (options.inputs or options.from_images) and options.sample_rows < MIN_SAMPLE_ROWS:
        raise PreprocessError(f"--sample-rows must be at least {MIN_SAMPLE_ROWS} (every defect must appear)")
    repo_id = check_hub_ready(options.output, options.dry_run)
    if options.dry_run and repo_id is None:
        raise PreprocessError("--dry-run lists what would be uploaded: it needs an hf://datasets/ORG/NAME --dataset")
    if repo_id is None:
        return Target(Path(options.output).expanduser().resolve(), None)
    return Target(Path(options.local_dir or repo_id.split("/")[1]).expanduser().resolve(), repo_id)


def dataset_facts(options: PreprocessOptions) -> tuple[VQGANSpec, DatasetFacts, str | None]:
    """The VQGAN (checked against its checkpoint), the facts of the dataset it will make, and the card's note."""
    spec, vqgan_note = resolve_vqgan(options)
    image_size = options.image_size or (DEFAULT_IMAGE_SIZE if options.vqgan_config else SAMPLE_IMAGE_SIZE)
    side = spec.grid_side(image_size)
    return spec, DatasetFacts(spec.codebook_size, side, side, image_size, spec.identity), vqgan_note


def filter_rows(source: InputRows, options: PreprocessOptions) -> tuple[pd.DataFrame, Counter, float]:
    """The rows that pass the filters, the dropped ones by reason, and the seconds it took."""
    start = time.perf_counter()
    kept, filtered = apply_filters(source.rows, options.filters)
    seconds = time.perf_counter() - start
    if len(kept) < options.shards:
        raise PreprocessError(
            f"only {len(kept)} of {len(source.rows)} rows pass the filters: too few for {options.shards} shards; "
            "pass a smaller --shards or relax the filters"
        )
    return kept, filtered, seconds


def output_settings(options: PreprocessOptions, source: InputRows, facts: DatasetFacts) -> dict:
    """Everything that changes the output: the manifest's fingerprint, which refuses mixing two runs."""
    return {
        "input": source.settings,
        "filters": asdict(options.filters),
        "shards": options.shards,
        "image_size": facts.image_size,
        "resize_mode": options.resize_mode,
        "vqgan": asdict(facts.vqgan),
        "precision": options.precision,
        "compression_level": options.compression_level,
    }


def pending_jobs(manifest: Manifest, folder: Path, kept: pd.DataFrame, console: Console) -> list[ShardJob]:
    """One job per shard that is not already written with its recorded checksum."""
    done = manifest.finished(folder)
    if done:
        console.print(f"resuming: {len(done)} of {manifest.num_shards} shards already written")
    plan = plan_shards(kept, manifest.num_shards)
    return [ShardJob(index, rows) for index, rows in enumerate(plan) if index not in done]


def preprocess(options: PreprocessOptions, console: Console | None = None) -> RunSummary:
    """Run the whole pipeline; returns the run's counts (also written to the card and printed)."""
    console = console or ttt_console(stderr=True)
    target = check_target(options)
    spec, facts, vqgan_note = dataset_facts(options)
    start = time.perf_counter()
    with ExitStack() as stack:
        source = read_input(options, stack, console)
        kept, filtered, filter_seconds = filter_rows(source, options)
        manifest = prepare_output(
            target.folder, output_settings(options, source, facts), options.shards, options.overwrite
        )
        jobs = pending_jobs(manifest, target.folder, kept, console)
        if jobs:
            write_shards(options, console, target.folder, manifest, jobs, spec, facts)
    summary = RunSummary(
        rows_in=len(source.rows),
        filtered=filtered,
        shards=[manifest.shards[i] for i in sorted(manifest.shards)],
        num_shards=options.shards,
        filter_seconds=filter_seconds,
        wall_seconds=time.perf_counter() - start,
        shards_this_run=len(jobs),
        rows_this_run=sum(len(job.rows) for job in jobs),
    )
    finish(options, console, target, summary, facts, source.description, vqgan_note)
    return summary


def finish(
    options: PreprocessOptions,
    console: Console,
    target: Target,
    summary: RunSummary,
    facts: DatasetFacts,
    input_description: str,
    vqgan_note: str | None,
) -> None:
    """Write the data card, print the summary, and publish an hf:// output."""
    card = render_card(
        facts,
        summary,
        options.filters,
        input_description=input_description,
        command=options.command,
        license=options.license,
        pretty_name=target.repo_id.split("/")[1] if target.repo_id else target.folder.name,
        load_path=target.repo_id or str(target.folder),
        vqgan_note=vqgan_note,
    )
    write_card(target.folder, card)
    console.print(summary.table())
    console.print(f"dataset: {target.folder}")
    if target.repo_id:
        publish(target.folder, options.output, dry_run=options.dry_run, echo=console.print)
    if options.as_json:
        print(json.dumps({"dataset": str(target.folder), "output": options.output, **summary.document()}), flush=True)


@contextmanager
def ctrl_c_deferred() -> Iterator[None]:
    """Hold a Ctrl-C until the block is done, then raise it (only the main thread receives signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda *_: received.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


def stage_settings(
    options: PreprocessOptions, facts: DatasetFacts
) -> tuple[DownloadSettings, EncodeSettings, WriteSettings]:
    """What each stage's task needs to know, from the run's options."""
    download = DownloadSettings(
        image_size=facts.image_size,
        resize_mode=options.resize_mode,
        timeout=options.timeout,
        retries=options.retries,
        thread_count=options.download_threads,
    )
    encode = EncodeSettings(facts.image_size, options.batch_size, options.device, options.precision)
    return download, encode, WriteSettings(facts, options.shards, options.compression_level)


def write_shards(
    options: PreprocessOptions,
    console: Console,
    folder: Path,
    manifest: Manifest,
    jobs: list[ShardJob],
    spec: VQGANSpec,
    facts: DatasetFacts,
) -> None:
    """Run the jobs on Dask and write each shard, with its manifest record, as soon as it is ready."""
    download, encode, write = stage_settings(options, facts)
    progress = tqdm(
        total=options.shards, initial=options.shards - len(jobs), unit="shard", desc="shards", dynamic_ncols=True
    )

    def record(blob: ShardBlob) -> None:
        with ctrl_c_deferred():  # a shard file and its manifest record land together
            manifest.shards[blob.index] = write_shard(folder, blob)
            manifest.save(folder)
        progress.update(1)
        stall.shard_done()

    try:
        with dask_client(options.scheduler, options.workers) as client:
            console.print(f"dask dashboard: {client.dashboard_link}")
            futures = submit_shards(
                client,
                jobs,
                download,
                encode,
                write,
                spec,
                from_images=bool(options.from_images),
                run_token=manifest.fingerprint[:12],
            )
            with StallReport(client, console.print) as stall:
                failed = gather_as_completed(futures, record)
    except KeyboardInterrupt:
        console.print(
            f"interrupted: {len(manifest.shards)} of {options.shards} shards are written; "
            "re-run the same command to resume"
        )
        raise
    except ConnectionError as err:
        raise PreprocessError(str(err)) from None
    finally:
        progress.close()
    if failed:
        index, error = min(failed.items())
        raise PreprocessError(
            f"{len(failed)} of {len(jobs)} shards failed (shard {index}: {error}); the others are written; "
            "re-run the same command to retry the failed ones"
        )
