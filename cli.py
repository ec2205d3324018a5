"""The `ttt` command line: parses options, then calls one function per command.

Every default is stated once, in the settings dataclass of its command (`setting()` reads it from there,
and --help shows it). Those dataclasses live in modules without torch, and everything heavy is imported
inside each command, so `ttt --help` is instant and a volunteer who only trains never needs the
preprocessing stack (and vice versa).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from inference.settings import DemoSettings, GenerateSettings, SamplingSettings
from pipeline.core.errors import UserError
from pipeline.core.filters import FilterConfig
from pipeline.core.layout import DEFAULT_DATASET
from pipeline.core.renamed_options import RenamingCommand
from pipeline.preprocess.options import ColumnMap, PreprocessOptions
from pipeline.vqgan.settings import VQGANTrainSettings
from training.calc.memory import ATTENTIONS, MODELS, PRECISIONS, Setup
from training.calc.memory import OPTIMIZERS as CALC_OPTIMIZERS
from training.config import (
    AGGREGATIONS,
    AUTO,
    MAX_JOIN_HOLD,
    OPTIMIZERS,
    OUTER_BITS,
    PRESETS,
    REACHABILITY,
    AuthServerSettings,
    AuthSettings,
    MonitorSettings,
    PeerSettings,
    RunSettings,
    RunSpec,
)


def fail_cleanly(run: Callable[[], Any]) -> Any:
    """Turn a user mistake into one line (click's `Error: ...`), an interrupt into exit 130."""
    try:
        return run()
    except UserError as err:
        raise click.ClickException(str(err)) from None
    except KeyboardInterrupt:
        click.echo("Aborted.", err=True)
        sys.exit(130)


def default_of(settings: type, name: str) -> Any:
    """The default of field `name` of a settings dataclass."""
    field = next(f for f in dataclasses.fields(settings) if f.name == name)
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def setting(settings: type, name: str, *flags: str, dest: str | None = None, **kwargs: Any) -> Callable:
    """A click option for field `name` of `settings` (passed on as `dest`, default `name`), whose default is the
    field's and shown in --help."""
    flags = flags or (f"--{name.replace('_', '-')}",)
    return click.option(*flags, dest or name, **{"default": default_of(settings, name), "show_default": True, **kwargs})


class BatchSize(click.ParamType):
    """A positive number of samples, or "auto"."""

    name = "N|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | str:
        if value == AUTO or (isinstance(value, int) and value >= 1):
            return value
        if isinstance(value, str) and value.isdigit() and int(value) >= 1:
            return int(value)
        self.fail(f"{value!r} is neither a positive number nor {AUTO!r}", param, ctx)


def column_map(flags: dict) -> ColumnMap:
    """--key-col, --url-col, ...: the input's column for each canonical one (empty: the input has none)."""
    return ColumnMap(**{field.name: flags.pop(f"{field.name}_col") or None for field in dataclasses.fields(ColumnMap)})


def filter_config(flags: dict) -> FilterConfig:
    """The filter flags, where 0 / 'any' / a --keep-... flag switch a rule off."""
    allowed = flags.pop("allowed_nsfw").strip()
    return FilterConfig(
        min_caption_length=flags.pop("min_caption_length"),
        max_aspect_ratio=flags.pop("max_aspect_ratio") or None,
        allowed_nsfw=None if allowed.lower() == "any" else tuple(x.strip() for x in allowed.split(",") if x.strip()),
        require_positive_size=not flags.pop("allow_nonpositive_size"),
        dedupe_urls=not flags.pop("keep_duplicate_urls"),
    )


# A command's summary as one JSON document on stdout, for scripts (its other lines go to stderr).
JSON_SUMMARY = click.option(
    "--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout, for scripts (the rest on stderr)."
)

# The run's settings (training/config.py's RunSettings), declared once for `ttt train` and `ttt monitor`: every peer of
# a run shares them, and a peer set otherwise is refused with the option's name and both values.
RUN_OPTIONS = {
    "run_id": dict(
        default=None,
        show_default=False,
        help="The run: peers with the same id train together (`ttt train --join` and --run read it from the run).",
    ),
    "dataset": dict(help="The run's data: a folder, parquet glob, hf://datasets/ORG/NAME or fsspec URL."),
    "preset": dict(type=click.Choice(list(PRESETS)), help="The run's model."),
    "tokenizer": dict(metavar="FILE", help="A tokenizers JSON for the captions [default: UTF-8 bytes]."),
    "optimizer": dict(
        type=click.Choice(OPTIMIZERS),
        help="The local optimizer: LAMB (the paper's; its steps follow each tensor's norm) or Adam, with 8-bit or "
        "32-bit state.",
    ),
    "learning_rate": dict(type=click.FloatRange(min=0, min_open=True), help="Peak LR [default: the preset's]."),
    "weight_decay": dict(type=click.FloatRange(min=0), help="Decoupled, on matrices only."),
    "max_grad_norm": dict(type=click.FloatRange(min=0, min_open=True), help="Clip each step's gradient norm to this."),
    "total_steps": dict(
        type=click.IntRange(min=1),
        help="Length of the LR schedule in optimizer steps: global steps, or with --local-steps inner steps "
        "[default: the preset's; with --local-steps, as many batches of --batch-size as its global batches hold].",
    ),
    "target_batch_size": dict(type=click.IntRange(min=1), help="Samples per global step, whole swarm."),
    "local_steps": dict(
        type=click.IntRange(min=0),
        help="DiLoCo: take this many steps of the local optimizer, then average the change of the parameters with "
        "the other peers and take one outer step (one averaging round per this many local batches, instead of one "
        "per global step). --max-steps and --checkpoint-every then count outer steps. 0: average gradients every "
        "global step.",
    ),
    "outer_lr": dict(
        type=click.FloatRange(min=0, min_open=True),
        help="DiLoCo's outer learning rate (1 with no momentum: the mean of the peers' parameters).",
    ),
    "outer_momentum": dict(
        type=click.FloatRange(min=0, max=1),
        help="DiLoCo's outer Nesterov momentum (the DiLoCo papers': 0.9, with --outer-lr 0.7).",
    ),
    "outer_bits": dict(
        type=click.Choice(OUTER_BITS),
        help="DiLoCo: bits per value of the pseudo-gradients sent (1: signs, 4: levels, both with a scale per 64 "
        "values and their error sent in the next round; 8: as gradients are sent).",
    ),
    "matchmaking_time": dict(
        type=click.FloatRange(min=0.1), help="Seconds a round's leader gathers its group before averaging."
    ),
    "averaging_timeout": dict(type=click.FloatRange(min=1), help="Seconds a round may take before it is given up."),
    "aggregation": dict(
        type=click.Choice(AGGREGATIONS),
        help="How each peer reduces the gradients it averages: the mean, or CenteredClip, which bounds what one bad "
        "peer can do; poisoned parts (NaN, far too large) are dropped in both.",
    ),
    "clip_tau": dict(
        type=click.FloatRange(min=0, min_open=True),
        help="CenteredClip's radius, in median distances of the peers' parts from their median.",
    ),
    "seed": dict(type=int, help="The initialisation every first peer of the run shares."),
}


def run_options(command: Callable) -> Callable:
    """The run's settings (RUN_OPTIONS), as options of `command`."""
    for field in reversed(dataclasses.fields(RunSettings)):
        command = setting(RunSettings, field.name, **RUN_OPTIONS[field.name])(command)
    return command


def run_settings(flags: dict) -> RunSettings:
    """The run's settings, taken out of a command's parsed options."""
    return RunSettings(**{field.name: flags.pop(field.name) for field in dataclasses.fields(RunSettings)})


def given_run_options(context: click.Context) -> tuple[str, ...]:
    """The run settings given on the command line of `context` (not left at their defaults)."""
    return tuple(
        field.name
        for field in dataclasses.fields(RunSettings)
        if context.get_parameter_source(field.name) not in (None, click.core.ParameterSource.DEFAULT)
    )


REACHABILITY_HELP = (
    "Can others connect to this machine? auto: an initial peer tries at start (behind NAT: a client); public: yes, "
    "without asking; client: no (home router, notebook): it averages through reachable peers."
)
BANDWIDTH = click.FloatRange(min=0, min_open=True)
BANDWIDTH_HELP = (
    "This machine's upload in Mbit/s: the share of each round it reduces follows it (at most 4x the other reducers' "
    "median) [default: none, the same share as the others]."
)

RUN_FILE = click.option(
    "--run",
    "run_file",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="RUN.TOML",
    help="The run's spec (`ttt run init`): every run-wide option comes from it; one given beside must agree.",
)


def spec_and_settings(flags: dict, context: click.Context) -> tuple[RunSpec | None, RunSettings]:
    """The run's spec of --run (None without it) and the run's settings: the spec's, or the options'."""
    from training.spec import adopt, read_spec

    run, run_file = run_settings(flags), flags.pop("run_file")
    if run_file is None:
        return None, run
    spec = read_spec(run_file)
    return spec, adopt(spec, run, given_run_options(context))


def auth_options(command: Callable) -> Callable:
    """The options with which a peer (ttt train, ttt monitor) joins an authenticated run."""
    options = [
        click.option("--authority-key", metavar="RUN.PUB", help="The run's public key: the run admits token holders."),
        setting(AuthSettings, "token", metavar="FILE", help="A token from `ttt auth issue` (with its --identity)."),
        setting(AuthSettings, "auth_server", metavar="URL", help="The run's `ttt auth serve` (tokens renew)."),
        setting(
            AuthSettings,
            "username",
            help="On the auth server's allowlist; the password from TTT_PASSWORD or a prompt [default: log in with "
            "the Hugging Face token of HF_TOKEN or huggingface-cli login].",
        ),
        setting(
            AuthSettings,
            "refresh",
            "--auth-refresh",
            dest="auth_refresh",  # the monitor's --refresh is its own
            type=click.FloatRange(min=0.5),
            help="Seconds between checks of the token and the revocation list.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def auth_settings(flags: dict) -> AuthSettings | None:
    """AuthSettings from a peer's --authority-key, --token, --auth-server, --username (None: an open run)."""
    fields = {name: flags.pop(name) for name in ("authority_key", "token", "auth_server", "username")}
    fields["refresh"] = flags.pop("auth_refresh")
    if fields["authority_key"] is None:
        if fields["token"] or fields["auth_server"]:
            raise click.UsageError("--token and --auth-server need --authority-key (the run's run.pub)")
        return None
    if bool(fields["token"]) == bool(fields["auth_server"]):
        raise click.UsageError("--authority-key needs one of --token FILE and --auth-server URL")
    if fields["username"] and not fields["auth_server"]:
        raise click.UsageError("--username logs in at an --auth-server; a --token needs no username")
    if fields["username"]:
        password = os.environ.get("TTT_PASSWORD")
        fields["password"] = password if password is not None else click.prompt("password", hide_input=True, err=True)
    return AuthSettings(**fields)


def peer_settings(flags: dict, context: click.Context) -> PeerSettings:
    """PeerSettings from `ttt train`'s parsed options (`context`: where they were parsed)."""
    auth = auth_settings(flags)
    for name in ("initial_peers", "host_maddrs", "announce_maddrs"):
        flags[name] = list(flags[name])
    if flags["join"] and flags["run_file"]:
        raise click.UsageError("--join and --run both give the run's settings; give one of them")
    if not (flags["join"] or flags["run_file"] or flags["run_id"]):
        raise click.UsageError("join a run with --join ADDRESS, or name the run: --run-id NAME (or --run FILE)")
    spec, run = spec_and_settings(flags, context)
    return PeerSettings(run=run, spec=spec, run_options_given=given_run_options(context), **flags, auth=auth)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="ttt")
def main() -> None:
    """ttt: preprocess image-caption data into VQGAN codes, train a DALL-E-like model together, generate images."""


@main.command(
    short_help="Make a VQGAN-code dataset from image-caption metadata (Dask).",
    cls=RenamingCommand,
    renamed={"--output": "--dataset"},
)
@setting(
    PreprocessOptions,
    "inputs",
    "--input",
    multiple=True,
    metavar="GLOB",
    help="Metadata files (parquet/csv/tsv; globs; repeatable). Default: the embedded sample.",
)
@setting(
    PreprocessOptions,
    "input_format",
    type=click.Choice(["parquet", "csv", "tsv"]),
    help="Override the format the file suffix implies.",
)
@setting(
    PreprocessOptions,
    "from_images",
    type=click.Path(file_okay=False),
    help="An img2dataset output folder: skip the download.",
)
@setting(
    PreprocessOptions,
    "output",
    "--dataset",
    help="A folder, or hf://datasets/ORG/NAME to publish to the Hub (token from HF_TOKEN).",
)
@setting(PreprocessOptions, "local_dir", help="Where an hf:// output is staged locally [default: ./NAME].")
@setting(PreprocessOptions, "shards", help="Number of output shards (units of work).")
@setting(
    PreprocessOptions, "image_size", type=int, help="Image side in pixels [default: 64 for the sample, 256 otherwise]."
)
@setting(
    PreprocessOptions,
    "resize_mode",
    type=click.Choice(["center_crop", "border"]),
    help="Fit each image to the square: crop its centre, or pad it with a border.",
)
@setting(PreprocessOptions, "vqgan_config", type=click.Path(dir_okay=False), help="taming-transformers VQGAN YAML.")
@setting(PreprocessOptions, "vqgan_ckpt", type=click.Path(dir_okay=False), help="The matching .ckpt (with state_dict).")
@setting(ColumnMap, "url", "--url-col", dest="url_col", help="The input's image URL column.")
@setting(ColumnMap, "caption", "--caption-col", dest="caption_col", help="The input's caption column.")
@setting(ColumnMap, "width", "--width-col", dest="width_col", help="The image width column (empty: none).")
@setting(ColumnMap, "height", "--height-col", dest="height_col", help="The image height column (empty: none).")
@setting(ColumnMap, "nsfw", "--nsfw-col", dest="nsfw_col", help="The NSFW tag column (empty: none).")
@setting(ColumnMap, "key", "--key-col", dest="key_col", help="Stable key column (absent: hash of the URL).")
@setting(
    ColumnMap, "similarity", "--similarity-col", dest="similarity_col", help="The CLIP similarity column (empty: none)."
)
@setting(ColumnMap, "license", "--license-col", dest="license_col", help="The license column (empty: none).")
@setting(FilterConfig, "min_caption_length", help="Drop shorter captions (0: keep all).")
@setting(FilterConfig, "max_aspect_ratio", help="Drop wider/taller images (0: no limit).")
@click.option(
    "--allowed-nsfw",
    default=",".join(default_of(FilterConfig, "allowed_nsfw")),
    show_default=True,
    help="Comma-separated NSFW labels to keep, or 'any'.",
)
@click.option("--allow-nonpositive-size", is_flag=True, help="Keep rows whose width/height is missing or <= 0.")
@click.option("--keep-duplicate-urls", is_flag=True, help="Keep every row of a repeated URL.")
@setting(PreprocessOptions, "scheduler", metavar="ADDRESS", help="An existing Dask scheduler (tcp://10.0.0.5:8786).")
@setting(PreprocessOptions, "workers", type=int, help="LocalCluster worker processes [default: one per core].")
@setting(PreprocessOptions, "device", help="Encode on auto|cpu|cuda|cuda:N.")
@setting(
    PreprocessOptions,
    "precision",
    type=click.Choice(["fp32", "bf16", "fp16"]),
    help="Encoder precision (reduced precision only helps on GPUs).",
)
@setting(PreprocessOptions, "batch_size", help="Images per encoder batch.")
@setting(
    PreprocessOptions,
    "compression_level",
    type=click.IntRange(1, 11),
    help="Brotli level of the shards (10-11 pack 13-bit codes ~8% smaller; lower writes faster).",
)
@setting(PreprocessOptions, "timeout", help="Download timeout per image, seconds.")
@setting(PreprocessOptions, "retries", help="Download retries per image.")
@setting(PreprocessOptions, "download_threads", help="Download threads per shard task.")
@setting(PreprocessOptions, "sample_rows", help="Rows of the embedded sample.")
@setting(PreprocessOptions, "sample_port", help="Port of the sample's local HTTP server.")
@setting(PreprocessOptions, "sample_latency", help="Seconds the sample server waits per response (web latency).")
@setting(PreprocessOptions, "license", help="License id for the data card.")
@setting(PreprocessOptions, "overwrite", is_flag=True, help="Replace a dataset made with different settings.")
@setting(PreprocessOptions, "dry_run", is_flag=True, help="With an hf:// output: list what would be uploaded.")
@JSON_SUMMARY
def preprocess(**flags: Any) -> None:
    """Filter -> download (img2dataset) -> VQGAN-encode -> Brotli parquet shards -> data card -> publish.

    Runs on Dask; re-running the same command after a crash or Ctrl-C resumes.
    """
    from pipeline.preprocess.run import preprocess as run_preprocess

    columns, filters = column_map(flags), filter_config(flags)
    flags["inputs"] = list(flags["inputs"])
    command = shlex.join(["ttt", *sys.argv[1:]])
    fail_cleanly(lambda: run_preprocess(PreprocessOptions(columns=columns, filters=filters, command=command, **flags)))


@main.group(short_help="Train a small VQGAN on the sample domain or your own images.")
def vqgan() -> None:
    """The VQGAN that turns images into codes: train a small one for a small domain."""


@vqgan.command("train", short_help="Train a small taming VQModel on CPU; writes the released checkpoint layout.")
@setting(
    VQGANTrainSettings,
    "out",
    type=click.Path(file_okay=False, path_type=Path),
    help="Writes configs/model.yaml, checkpoints/last.ckpt, README.md (model card), metrics.json.",
)
@setting(
    VQGANTrainSettings,
    "images",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="A folder of your images (searched recursively). Default: the embedded sample's domain.",
)
@setting(
    VQGANTrainSettings,
    "config",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A taming VQModel YAML. Default: the sample VQGAN's architecture.",
)
@setting(VQGANTrainSettings, "steps", type=click.IntRange(min=1), help="Training steps.")
@setting(VQGANTrainSettings, "batch_size", type=click.IntRange(min=1), help="Images per step.")
@setting(VQGANTrainSettings, "learning_rate", type=click.FloatRange(min=0, min_open=True), help="Adam's step size.")
@setting(VQGANTrainSettings, "seed", type=int, help="Initialisation and data order.")
@setting(
    VQGANTrainSettings, "heldout", type=click.IntRange(min=1), help="Held-out images to measure reconstruction on."
)
@setting(VQGANTrainSettings, "device", help="auto, cpu, cuda, cuda:1, ...")
@setting(VQGANTrainSettings, "threads", type=click.IntRange(min=1), help="CPU threads for torch [default: all cores].")
@setting(VQGANTrainSettings, "overwrite", is_flag=True, help="Replace a checkpoint already in --out.")
def vqgan_train(**flags: Any) -> None:
    """Train with L1 + L2 + codebook loss (no LPIPS/discriminator), then measure held-out PSNR, codebook use and,
    on the sample domain, how many reconstructions the sample judge accepts."""
    from pipeline.vqgan.train import train_vqgan

    fail_cleanly(lambda: train_vqgan(VQGANTrainSettings(**flags)))


@main.command(
    "stream-bench",
    short_help="Measure how fast the streaming loader feeds a trainer from a dataset.",
    cls=RenamingCommand,
    positional="--dataset",
)
@click.option(
    "--dataset",
    default=DEFAULT_DATASET,
    show_default=True,
    help="A dataset folder, a glob of parquet files, or hf://datasets/ORG/NAME.",
)
@click.option("--batch-size", type=click.IntRange(min=1), default=64, show_default=True, help="Rows per batch.")
@click.option(
    "--text-len", type=click.IntRange(min=1), default=64, show_default=True, help="Caption tokens per row."
)
@click.option("--workers", type=click.IntRange(min=0), default=0, show_default=True, help="DataLoader workers.")
@click.option(
    "--shuffle-buffer", type=click.IntRange(min=0), default=10_000, show_default=True, help="Rows shuffled together."
)
@click.option("--seconds", type=click.FloatRange(min=0.1), default=10.0, show_default=True, help="Per measurement.")
def stream_bench(dataset: str, **flags: Any) -> None:
    """Read --dataset as a trainer would (shuffled, tokenized batches) and print rows per second."""
    from pipeline.core.stream_bench import bench_stream

    fail_cleanly(lambda: bench_stream(dataset, num_workers=flags.pop("workers"), **flags))


@main.command(
    short_help="Join (or start) a collaborative training run as one hivemind peer.",
    cls=RenamingCommand,
    renamed={"--client-mode": "--reachability client"},
)
@click.option(
    "--join",
    metavar="ADDRESS",
    help="A run's address: its monitor's URL (http://HOST:PORT) or a peer's multiaddress. The run's settings come "
    "from the run: no other run option is needed.",
)
@RUN_FILE
@run_options
@setting(
    PeerSettings,
    "stream",
    "--stream/--no-stream",
    help="Read shards on demand, or first copy the dataset to local disk (for many epochs over a slow link).",
)
@setting(PeerSettings, "initial_peers", multiple=True, metavar="MULTIADDR", help="A running peer's address.")
@setting(PeerSettings, "host_maddrs", multiple=True, metavar="MULTIADDR", help="Where this peer listens.")
@setting(PeerSettings, "announce_maddrs", multiple=True, help="Public addresses to announce (NAT, port forwarding).")
@setting(PeerSettings, "identity_path", "--identity", help="Private key file: a persistent peer id across restarts.")
@setting(PeerSettings, "reachability", type=click.Choice(REACHABILITY), help=REACHABILITY_HELP)
@setting(PeerSettings, "bandwidth", type=BANDWIDTH, metavar="MBIT", help=BANDWIDTH_HELP)
@setting(
    PeerSettings,
    "batch_size",
    type=BatchSize(),
    help="This peer's batch; auto: the largest that fits this device's free memory (see `ttt calc`).",
)
@setting(
    PeerSettings,
    "max_memory",
    type=click.FloatRange(min=0, min_open=True),
    metavar="GIB",
    help="Use at most this much device memory [default: what is free] (a shared GPU, or a budget for auto).",
)
@setting(
    PeerSettings,
    "max_steps",
    type=click.IntRange(min=1),
    help="Stop after this many global (with --local-steps: outer) steps.",
)
@setting(
    PeerSettings,
    "wait_for_peers",
    type=click.IntRange(min=1),
    help="Start training once this many peers (this one included) have joined the run.",
)
@setting(
    PeerSettings,
    "join_timeout",
    type=click.FloatRange(min=0, max=MAX_JOIN_HOLD),
    help="Seconds the swarm holds its step at most while this peer joins, so that it takes part in the next "
    "round (0: join without asking).",
)
@setting(PeerSettings, "checkpoint_dir", help="Where this peer's checkpoints and hivemind's log go.")
@setting(PeerSettings, "checkpoint_every", type=click.IntRange(min=1), help="Global (with --local-steps: outer) steps.")
@setting(PeerSettings, "resume", is_flag=True, help="Continue from the latest checkpoint in --checkpoint-dir.")
@setting(PeerSettings, "display_name", "--name", help="Shown on the run's leaderboard [default: peer id].")
@setting(PeerSettings, "device", help="Train on auto|cpu|cuda|cuda:N.")
@setting(PeerSettings, "threads", type=click.IntRange(min=1), help="CPU threads for torch.")
@setting(PeerSettings, "loader_workers", type=click.IntRange(min=0), help="Processes that read and decode batches.")
@setting(
    PeerSettings,
    "audit_rate",
    type=click.FloatRange(min=0, max=1),
    help="Share of global steps at which this peer recomputes one microbatch of another peer, to check its work "
    "(0: none).",
)
@setting(
    PeerSettings,
    "outer_overlap",
    "--outer-overlap/--no-outer-overlap",
    help="DiLoCo: average in the background while the next local steps run, and take the outer step when the "
    "round ends (one round late); --no-outer-overlap stops training for each round.",
)
@auth_options
def train(**flags: Any) -> None:
    """Train the DALL-E-like model together with the other peers of a run (hivemind): join one with --join ADDRESS,
    or start one from its spec (--run RUN.TOML) or from the run options."""
    context = click.get_current_context()
    settings = fail_cleanly(lambda: peer_settings(flags, context))  # before the heavy imports: mistakes said at once
    from training.peer.join import train as run_train

    fail_cleanly(lambda: run_train(settings))


@main.command(
    short_help="Will it fit? Memory, host RAM and traffic of a training setup, per term.",
    cls=RenamingCommand,
    renamed={"--model": "--preset"},
)
@click.option("--preset", metavar="NAME", help=f"A preset: {', '.join(MODELS)}; or give a custom shape instead.")
@click.option("--layers", type=int, help="Custom shape: layers.")
@click.option("--width", type=int, help="Custom shape: hidden size.")
@click.option("--heads", type=int, help="Custom shape: attention heads (width must be divisible by them).")
@click.option("--seq-len", type=int, help="Tokens per sample (also overrides a preset's, except DALL-E-like ones).")
@click.option("--vocab", type=int, help="Custom shape: vocabulary size.")
@click.option("--ff-hidden", type=int, help="Custom shape: feed-forward width [default: 4 x width].")
@setting(Setup, "batch_size", type=click.IntRange(min=1), help="Micro-batch: samples per forward/backward.")
@setting(Setup, "optimizer", type=click.Choice(CALC_OPTIMIZERS), help="The optimizer, and its state's precision.")
@setting(Setup, "offload", is_flag=True, help="Keep the optimizer (state, fp32 copies) in host RAM, as ttt train does.")
@setting(Setup, "checkpointing", is_flag=True, help="Gradient checkpointing: keep each layer's input only.")
@setting(Setup, "reversible", is_flag=True, help="Reversible layers: keep no per-layer activations.")
@setting(Setup, "share", "--share/--no-share", help="Share the repeating groups' weights [default: the model's].")
@setting(Setup, "precision", type=click.Choice(PRECISIONS), help="mixed: autocast with fp32 weights.")
@setting(Setup, "attention", type=click.Choice(ATTENTIONS), help="naive keeps every head's attention scores.")
@setting(Setup, "swarm", "--swarm/--alone", help="As a hivemind peer (its accumulators and averaging buffers).")
@setting(
    Setup, "audits", "--audits/--no-audits",
    help="As a peer that audits others (`ttt train`'s default): a second model, and the last steps' parameters.",
)  # fmt: skip
@setting(Setup, "peers", type=click.IntRange(min=1), help="Peers in an averaging group, for the traffic.")
@setting(Setup, "uplink_mbit", type=click.FloatRange(min=0, min_open=True), help="Your upload speed, Mbit/s.")
@setting(Setup, "pcie_gbyte", type=click.FloatRange(min=0, min_open=True), help="Host-GPU copy speed, GB/s.")
@click.option(
    "--fit", "fit_gib", type=float, metavar="GIB", help="Also say the largest --batch-size for this GPU memory."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (bytes) for scripts.")
def calc(as_json: bool, **options: Any) -> None:
    """Estimate the memory a model needs to train: device memory, host RAM, the split into parameters,
    gradients, optimizer state and activations, host-GPU copies per step when offloading, and the averaging
    traffic per global step with ttt's averaging compression. `bench/calc.py` checks the terms against real tensors.

    \b
    ttt calc --preset ttt-1.1b --batch-size 1 --optimizer lamb-8bit --offload --reversible
    ttt calc --preset gpt2-l --optimizer adamw --checkpointing --precision mixed --alone
    ttt calc --layers 24 --width 1024 --heads 16 --seq-len 1280 --vocab 16384 --json
    """
    from training.calc.command import run_calc

    fail_cleanly(lambda: run_calc(options, as_json))


@main.command(
    short_help="The run's monitor peer: history, checkpoints and a dashboard at http://HOST:PORT/.",
    cls=RenamingCommand,
    renamed={"--client-mode": "--reachability client"},
)
@RUN_FILE
@run_options
@setting(
    MonitorSettings,
    "initial_peers",
    multiple=True,
    metavar="MULTIADDR",
    help="A peer of the run [default: none, this monitor starts the run and prints the addresses trainers join with].",
)
@setting(MonitorSettings, "host_maddrs", multiple=True, metavar="MULTIADDR", help="Where this monitor listens.")
@setting(MonitorSettings, "announce_maddrs", multiple=True, help="Public addresses to announce (NAT, port forwarding).")
@setting(MonitorSettings, "identity_path", "--identity", help="Private key file: the same address across restarts.")
@setting(MonitorSettings, "reachability", type=click.Choice(REACHABILITY), help=REACHABILITY_HELP)
@setting(
    MonitorSettings,
    "bandwidth",
    type=BANDWIDTH,
    metavar="MBIT",
    help="With --assist-averaging: this machine's upload in Mbit/s, as `ttt train --bandwidth`.",
)
@setting(MonitorSettings, "host", help="Serve the dashboard on this address (0.0.0.0: to everyone).")
@setting(MonitorSettings, "port", type=click.IntRange(min=0, max=65535), help="The dashboard's port.")
@setting(MonitorSettings, "refresh", type=click.FloatRange(min=0.1), help="Seconds between reads of the metrics.")
@setting(
    MonitorSettings,
    "active_window",
    type=click.FloatRange(min=1),
    help="Seconds a peer's last record counts as active.",
)
@setting(MonitorSettings, "db", metavar="FILE", help="The history's SQLite file [default: in --checkpoint-dir].")
@setting(MonitorSettings, "checkpoint_dir", help="Checkpoints of the swarm's model, previews and history.")
@setting(MonitorSettings, "checkpoint_every", type=click.IntRange(min=0), help="Global steps (0: no checkpoints).")
@setting(MonitorSettings, "push_to", metavar="hf://ORG/NAME", help="Push each checkpoint to this Hub model repo.")
@setting(MonitorSettings, "dry_run", is_flag=True, help="With --push-to: list what would be uploaded, send nothing.")
@setting(
    MonitorSettings,
    "preview_prompts",
    "--preview-prompt",
    multiple=True,
    help="Drawn after each checkpoint (repeatable) [default: three of the sample's].",
)
@setting(MonitorSettings, "vqgan_config", type=click.Path(dir_okay=False), help="The data's VQGAN YAML, for previews.")
@setting(MonitorSettings, "vqgan_ckpt", type=click.Path(dir_okay=False), help="The data's VQGAN checkpoint.")
@setting(MonitorSettings, "wandb_project", "--wandb", metavar="PROJECT", help="Also log to Weights & Biases.")
@setting(MonitorSettings, "assist_averaging", is_flag=True, help="The run's public helper: keeps and serves the state.")
@setting(
    MonitorSettings,
    "audit_rate",
    type=click.FloatRange(min=0, max=1),
    help="With --assist-averaging: recompute another peer's microbatch at this share of global steps, and every "
    "failed verdict another auditor publishes, from the run's --dataset (0: check only what it reduced).",
)
@setting(
    MonitorSettings,
    "revoke_convicted",
    metavar="AUTHORITY",
    type=click.Path(file_okay=False),
    help="The run's authority folder (`ttt auth init`): revoke each user whose work two other users' audits failed.",
)
@auth_options
def monitor(**flags: Any) -> None:
    """Watch run --run-id: aggregate every peer's metrics into a SQLite history, checkpoint the swarm's model, and
    serve a dashboard (loss, speed, peers, leaderboard, previews, join page) with /api/state and /metrics."""
    auth = auth_settings(flags)
    from training.monitor.run import monitor as run_monitor

    for name in ("initial_peers", "host_maddrs", "announce_maddrs", "preview_prompts"):
        flags[name] = list(flags[name])
    if not (flags["run_file"] or flags["run_id"]):
        raise click.UsageError("name the run: --run FILE (its spec, `ttt run init`) or --run-id NAME")
    spec, run = fail_cleanly(lambda: spec_and_settings(flags, click.get_current_context()))
    fail_cleanly(lambda: run_monitor(MonitorSettings(run=run, spec=spec, **flags, auth=auth)))


@main.command(short_help="A run at a glance from its swarm, without a monitor: spec, step, loss, speed, peers.")
@click.argument("address")
@click.option("--run-id", help="The run, when several share the swarm at ADDRESS.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts (one line per read).")
@click.option(
    "--watch", type=click.FloatRange(min=1), metavar="SECONDS", help="Read and print again every SECONDS, until Ctrl-C."
)
def status(address: str, run_id: str | None, as_json: bool, watch: float | None) -> None:
    """The run at ADDRESS (a peer's multiaddress, or its monitor's URL), read from the swarm's DHT: its spec, global
    step and loss, samples per second, and each peer's name, reachability, speed, step and version."""
    from training.monitor.status import show_status

    fail_cleanly(lambda: show_status(address, run_id, as_json, watch))


@main.group("run", short_help="A run's spec (run.toml): the settings its monitor and every peer start from.")
def run_spec() -> None:
    """The run spec: every run-wide setting, written once by the organiser.

    \b
    ttt run init --run-id demo --dataset hf://datasets/ORG/NAME --preset small --authority ./authority
    ttt monitor --run run.toml --assist-averaging
    ttt train --join http://HOST:8080          (what volunteers type)
    """


@run_spec.command("init", short_help="Write run.toml from the run options, each with its help as a comment.")
@run_options
@click.option(
    "--out-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default="run.toml",
    show_default=True,
    help="The spec file to write.",
)
@click.option(
    "--authority",
    type=click.Path(file_okay=False, path_type=Path),
    help="The run's authority folder (`ttt auth init`): sign the spec, so that peers can check it.",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing file.")
def run_init(out_file: Path, authority: Path | None, overwrite: bool, **flags: Any) -> None:
    if flags["run_id"] is None:
        raise click.UsageError("name the run: --run-id NAME")
    from training.spec import init_spec

    helps = {name: option["help"] for name, option in RUN_OPTIONS.items()}
    fail_cleanly(lambda: init_spec(run_settings(flags), out_file, authority, overwrite, helps))


@main.group(short_help="Admit peers to a run: keys, users, tokens, revocations and the auth server.")
def auth() -> None:
    """Authentication of a run: only peers with a token signed by the run's authority key take part.

    \b
    ttt auth init --run-id demo --out ./authority
    ttt auth add-user alice --allowlist users.toml
    ttt auth serve --authority ./authority --allowlist users.toml
    ttt train ... --authority-key ./authority/run.pub --auth-server http://HOST:8765 --username alice
    """


# The run's authority folder (run.key, run.pub), for the commands that sign with it.
AUTHORITY_FOLDER = click.option(
    "--authority",
    type=click.Path(file_okay=False, path_type=Path),
    default="./authority",
    show_default=True,
    help="The run's authority folder (ttt auth init).",
)


@auth.command("init", short_help="Create the run's authority key pair (run.key, run.pub).")
@click.option("--run-id", required=True, help="The run these keys admit peers to.")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default="./authority",
    show_default=True,
    help="The folder for run.key and run.pub.",
)
def auth_init(run_id: str, out: Path) -> None:
    from training.auth.commands import init_authority

    fail_cleanly(lambda: init_authority(run_id, out))


@auth.command(
    "keygen",
    short_help="Create a peer key (--identity) and its public half for an offline token.",
    cls=RenamingCommand,
    renamed={"--out": "--out-file"},
)
@click.option(
    "--out-file", type=click.Path(dir_okay=False, path_type=Path), required=True, help="e.g. bob.key (+ bob.pub)"
)
def auth_keygen(out_file: Path) -> None:
    from training.auth.commands import make_peer_key

    fail_cleanly(lambda: make_peer_key(out_file))


@auth.command("add-user", short_help="Add a user to an allowlist, or change their password.")
@click.argument("username")
@click.option(
    "--allowlist",
    type=click.Path(dir_okay=False, path_type=Path),
    default="users.toml",
    show_default=True,
    help="The allowlist file (created when missing).",
)
@click.password_option(envvar="TTT_PASSWORD", help="[default: asked twice; or TTT_PASSWORD]")
def auth_add_user(username: str, allowlist: Path, password: str) -> None:
    from training.auth.commands import add_user

    fail_cleanly(lambda: add_user(username, allowlist, password))


@auth.command(
    "issue",
    short_help="Sign a token for a user's peer key without a server.",
    cls=RenamingCommand,
    renamed={"--out": "--out-file", "--lifetime": "--token-lifetime"},
)
@AUTHORITY_FOLDER
@click.option("--user", "username", required=True, help="The username the token names.")
@click.option("--peer-key", type=click.Path(dir_okay=False, path_type=Path), required=True, help="Their .pub file.")
@click.option(
    "--out-file", type=click.Path(dir_okay=False, path_type=Path), required=True, help="The token file to write."
)
@setting(AuthServerSettings, "token_lifetime", type=click.FloatRange(min=1), help="Seconds the token lasts.")
def auth_issue(authority: Path, username: str, peer_key: Path, out_file: Path, token_lifetime: float) -> None:
    from training.auth.commands import issue_offline

    fail_cleanly(lambda: issue_offline(authority, username, peer_key, out_file, token_lifetime))


@auth.command("revoke", short_help="Remove a user from the run (or --lift it); peers apply it within a refresh.")
@click.argument("username")
@AUTHORITY_FOLDER
@click.option("--lift", is_flag=True, help="Admit the user again.")
def auth_revoke(username: str, authority: Path, lift: bool) -> None:
    from training.auth.commands import revoke

    fail_cleanly(lambda: revoke(authority, username, lift))


@auth.command("serve", short_help="Issue tokens to allowlisted users (or a Hub organisation's members).")
@setting(AuthServerSettings, "authority", help="The run's authority folder (ttt auth init).")
@setting(AuthServerSettings, "allowlist", metavar="USERS.TOML", help="Admit these users (ttt auth add-user).")
@setting(AuthServerSettings, "hf_org", metavar="ORG", help="Admit the members of this Hugging Face organisation.")
@setting(AuthServerSettings, "host", help="Listen on this address (0.0.0.0: everyone).")
@setting(AuthServerSettings, "port", type=click.IntRange(min=0, max=65535), help="Listen on this port.")
@setting(AuthServerSettings, "token_lifetime", type=click.FloatRange(min=1), help="Seconds a token lasts.")
@setting(AuthServerSettings, "certfile", type=click.Path(dir_okay=False), help="Serve HTTPS with this certificate.")
@setting(AuthServerSettings, "keyfile", type=click.Path(dir_okay=False), help="The certificate's private key.")
def auth_serve(**flags: Any) -> None:
    """Sign access tokens for the volunteers this server admits, and serve the run's revocation list."""
    from training.auth.commands import serve

    fail_cleanly(lambda: serve(AuthServerSettings(**flags)))


@main.command(short_help="Draw images for a prompt with a trained checkpoint (KV-cached sampling, VQGAN decode).")
@click.argument("prompt")
@setting(GenerateSettings, "checkpoint", help="Checkpoint folder, step folder or hf://ORG/NAME.")
@setting(GenerateSettings, "out", help="Folder for the PNGs and the grid.")
@setting(GenerateSettings, "num_samples", type=click.IntRange(min=1), help="Images to sample.")
@setting(GenerateSettings, "keep", type=click.IntRange(min=1), help="Keep the best K (CLIP) or first K [default: all].")
@setting(GenerateSettings, "batch_size", type=click.IntRange(min=1), help="Images sampled at once.")
@setting(SamplingSettings, "temperature", type=click.FloatRange(min=0), help="0: greedy.")
@setting(SamplingSettings, "top_k", type=click.IntRange(min=0), help="Keep the k likeliest codes (0: off).")
@setting(
    SamplingSettings,
    "top_p",
    type=click.FloatRange(min=0, max=1, min_open=True),
    help="Keep the likeliest codes whose probability reaches p (nucleus; 1: off).",
)
@setting(GenerateSettings, "seed", type=int, help="The sampling seed: the same prompt and seed draw the same images.")
@setting(
    GenerateSettings, "vqgan_config", type=click.Path(dir_okay=False), help="The data's VQGAN YAML [default: sample]."
)
@setting(GenerateSettings, "vqgan_ckpt", type=click.Path(dir_okay=False), help="The data's VQGAN checkpoint.")
@setting(
    GenerateSettings,
    "rerank_clip",
    metavar="MODEL:WEIGHTS",
    help="CLIP re-ranking: ViT-B-32:/path/clip.pt or local-dir:DIR.",
)
@setting(GenerateSettings, "device", help="auto|cpu|cuda|cuda:N.")
@JSON_SUMMARY
def generate(prompt: str, as_json: bool, **flags: Any) -> None:
    """Sample images for PROMPT from a `ttt train` checkpoint and write them as PNGs plus a captioned grid."""
    from inference.generate import generate as run_generate

    sampling = {name: flags.pop(name) for name in ("temperature", "top_k", "top_p")}
    settings = fail_cleanly(lambda: GenerateSettings(prompt, sampling=SamplingSettings(**sampling), **flags))
    fail_cleanly(lambda: run_generate(settings, as_json=as_json))


@main.command(short_help="The whole loop offline: preprocess the sample, train with 2 local peers, generate.")
@setting(DemoSettings, "steps", type=click.IntRange(min=1), help="Global training steps.")
@setting(DemoSettings, "peers", type=click.IntRange(min=1), help="Local hivemind peers.")
@setting(DemoSettings, "samples_per_prompt", type=click.IntRange(min=1), help="Images drawn per prompt.")
@setting(DemoSettings, "dataset", help="Where the sample's dataset is written.")
@setting(DemoSettings, "checkpoint_dir", help="Where the peers checkpoint.")
@setting(DemoSettings, "out", help="Where the drawn images go.")
@setting(DemoSettings, "seed", type=int, help="The run's and the sampling's seed.")
@setting(DemoSettings, "sample_port", type=int, help="Port of the sample's local HTTP server.")
def demo(**flags: Any) -> None:
    """Preprocess the embedded sample, train the tiny preset with local peers, draw prompts it saw and never saw,
    and print how many images the sample judge accepts."""
    from inference.demo import run_demo

    fail_cleanly(lambda: run_demo(DemoSettings(**flags)))


def dataset_folder(verb: str) -> Callable:
    """--dataset of the commands that read a dataset folder on this machine (`ttt publish`, `ttt inspect`)."""
    return click.option(
        "--dataset",
        type=click.Path(exists=True, file_okay=False, path_type=Path),
        default=DEFAULT_DATASET,
        show_default=True,
        help=f"The dataset folder to {verb}.",
    )


@main.command(
    short_help="Push a dataset folder to the Hugging Face Hub (resumable).", cls=RenamingCommand, positional="--dataset"
)
@click.argument("target", metavar="hf://datasets/ORG/NAME")
@dataset_folder("push")
@click.option("--dry-run", is_flag=True, help="List what would be uploaded, send nothing.")
def publish(target: str, dataset: Path, dry_run: bool) -> None:
    """Push --dataset to the Hub repo TARGET in batched commits; re-running resumes a partial upload."""
    from pipeline.preprocess.publish import publish as run_publish

    fail_cleanly(lambda: run_publish(dataset, target, dry_run=dry_run, echo=click.echo))


@main.command(
    short_help="Show a dataset's facts and decode samples back to a PNG grid.",
    cls=RenamingCommand,
    renamed={"--out": "--out-file"},
    positional="--dataset",
)
@dataset_folder("show")
@click.option("--show", default=16, show_default=True, help="Rows to decode into the grid (0: facts only).")
@click.option(
    "--out-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default="inspect.png",
    show_default=True,
    help="The PNG grid to write.",
)
@click.option("--vqgan-config", type=click.Path(dir_okay=False), help="The dataset's VQGAN YAML [default: sample].")
@click.option("--vqgan-ckpt", type=click.Path(dir_okay=False), help="The dataset's VQGAN checkpoint.")
@click.option("--device", default="auto", show_default=True, help="Decode on auto|cpu|cuda.")
@JSON_SUMMARY
def inspect(dataset: Path, **options: Any) -> None:
    """Print --dataset's facts and row counts, and decode its first rows to a captioned PNG grid.

    For the embedded sample the grid shows each caption's scene beside the decoded codes.
    """
    from pipeline.inspect_dataset import inspect_dataset

    fail_cleanly(lambda: inspect_dataset(dataset, **options))


if __name__ == "__main__":
    main()
