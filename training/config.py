"""What a training run is configured with: the model's shape, the named presets, and one peer's settings.

Plain dataclasses without torch, so that the CLI takes its defaults and choices from here and
`ttt --help` stays instant.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from pipeline.core.errors import UserError
from pipeline.core.layout import DEFAULT_DATASET

DEFAULT_CHECKPOINT_DIR = "./ckpt"
TOKEN_LIFETIME = 6 * 3600.0  # seconds an access token lasts, as the paper's server issued them
MAX_JOIN_HOLD = 300.0  # seconds: the longest a peer holds a step for a joining peer (the most --join-timeout accepts)

AUTO = "auto"  # --batch-size auto: the largest batch the memory calculator says fits this device
AVERAGE_STATE_EVERY = 10  # global steps between averaging rounds of the parameters themselves
COMPRESSION_THRESHOLD = 2**16  # averaging sends tensors of at least this many values in 8 bits, the rest in fp16
# --reachability: auto asks an initial peer to connect back at start (training/swarm/reachability.py); public: a full
# peer without asking; client: hivemind's client mode, for a machine nobody can connect to (home NAT, notebooks)
REACHABILITY = ("auto", "public", "client")
OUTER_BITS = (1, 4, 8)  # DiLoCo: bits per value of a pseudo-gradient sent (training/swarm/compression.py)
AGGREGATIONS = ("mean", "centered-clip")  # how averaging reduces what peers send (training/swarm/aggregation.py)

# --optimizer: the local optimizer (training/optimizer.py builds them); what their state costs is stated once here,
# without torch, for the memory calculator. Every peer of a run uses the same: they download each other's state.
MIN_8BIT_SIZE = 4096  # tensors with fewer values keep 32-bit state (bitsandbytes' `min_8bit_size`)
BLOCK_SIZE = 256  # values per float32 absmax in the blockwise 8-bit state (as bitsandbytes' 8-bit optimizers)


@dataclass(frozen=True)
class OptimizerState:
    """What one choice of --optimizer keeps per parameter tensor: its two moments, and a step counter."""

    eight_bit: bool  # moments of tensors with >= MIN_8BIT_SIZE values in blockwise 8 bits
    step_bytes: int  # per tensor, besides the moments (torch's AdamW keeps its step as a float32 tensor)
    family: str  # "lamb" or "adam": which of the preset's learning rates it takes

    def state_bytes(self, numel: int) -> int:
        """Bytes of the state of one tensor of `numel` values: 2 uint8 codes per value and 2 float32 absmax per block
        of BLOCK_SIZE in 8 bits; 2 float32 per value in 32 bits."""
        if self.eight_bit and numel >= MIN_8BIT_SIZE:
            return 2 * (numel + 4 * -(-numel // BLOCK_SIZE)) + self.step_bytes
        return 8 * numel + self.step_bytes

    @property
    def bytes_per_value(self) -> float:
        """State bytes per parameter value of a large tensor: 2 + 8/256 in 8 bits, 8 in 32 bits."""
        return 2 + 8 / BLOCK_SIZE if self.eight_bit else 8.0


OPTIMIZER_STATES = {
    "lamb-8bit": OptimizerState(eight_bit=True, step_bytes=0, family="lamb"),  # the paper's: LAMB, 8-bit moments
    "lamb": OptimizerState(eight_bit=False, step_bytes=0, family="lamb"),
    "adam-8bit": OptimizerState(eight_bit=True, step_bytes=0, family="adam"),  # bitsandbytes' Adam8bit
    "adamw": OptimizerState(eight_bit=False, step_bytes=4, family="adam"),  # torch's AdamW
}
# What a peer's messages mean to the others: raised when they change in a way an older peer would misread (2: DiLoCo's
# 4-bit pseudo-gradients; 3: the model's cell embedding, one more tensor in every average; 4: the record carries every
# run setting, `run_settings`; 5: gradients and states in blockwise 8 bits, training/swarm/compression.py, and
# commitments that name their leased blocks; 6: a reducer keeps its stream open until the sender hangs up, which an
# older sender, reading until the stream ends, would wait for until the round's timeout). Every peer publishes its own
# (training/metrics.py); a peer of another is refused.
PROTOCOL = 6


@functools.cache
def ttt_version() -> str:
    """The installed ttt's version (its package metadata, read once: every record a peer publishes carries it)."""
    return importlib.metadata.version("ttt")


OPTIMIZERS = tuple(OPTIMIZER_STATES)
DEFAULT_OPTIMIZER = "lamb-8bit"

GROUP_PATTERNS = ("row", "column", "row", "row")
PATTERNS = ("row", "column", "conv")


@dataclass
class ModelConfig:
    text_vocab_size: int = 257  # the byte tokenizer's 256 bytes + pad
    text_len: int = 48
    pad_id: int = 256
    codebook_size: int = 512
    grid: int = 8  # image codes form a grid x grid square
    width: int = 128
    layers: int = 6
    heads: int = 4
    head_dim: int = 32
    ff_mult: int = 4
    conv_kernel: int = 11  # DALL-E's conv-like mask is 11 x 11
    share_groups: bool = True
    reversible: bool = True
    image_loss_weight: float = 7.0  # DALL-E: 1/8 text, 7/8 image
    rotary_base: float = 10_000.0
    schedule: list[str] = field(default_factory=list)  # one pattern per layer; empty: the paper's

    def __post_init__(self) -> None:
        if not self.schedule:
            self.schedule = [GROUP_PATTERNS[i % 4] for i in range(self.layers - 1)] + ["conv"]
        if len(self.schedule) != self.layers or any(p not in PATTERNS for p in self.schedule):
            raise ValueError(f"schedule needs {self.layers} patterns out of {PATTERNS}, got {self.schedule}")
        if self.head_dim % 4:
            raise ValueError("head_dim must be divisible by 4 (2-D rotary embeddings rotate pairs on two axes)")

    @property
    def image_tokens(self) -> int:
        return self.grid * self.grid

    @property
    def input_len(self) -> int:
        return self.text_len + self.image_tokens - 1

    @property
    def distinct_blocks(self) -> int:
        """Blocks with their own weights: every layer, or with sharing the group's (at most 4) and the last."""
        return min(4, self.layers - 1) + 1 if self.share_groups else self.layers

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Preset:
    """A named model size with the optimizer settings it is trained with."""

    model: ModelConfig
    learning_rate: float  # peak, after the warm-up, of LAMB (whose steps are relative to each tensor's norm)
    total_steps: int  # length of the linear schedule, in global steps
    # Peak of the Adam family (--optimizer adam-8bit, adamw): a tenth of LAMB's, as measured on the tiny preset
    # (bench.optimizer: 3e-3 vs 3e-2); untuned on the larger ones.
    adam_learning_rate: float

    def peak_learning_rate(self, optimizer: str) -> float:
        return self.learning_rate if OPTIMIZER_STATES[optimizer].family == "lamb" else self.adam_learning_rate


PRESETS = {
    # The embedded sample: 48 bytes of caption, 8x8 codes from 512; trains on 2 CPU cores in minutes.
    "tiny": Preset(ModelConfig(), learning_rate=3e-2, total_steps=200, adam_learning_rate=3e-3),
    # A mid-size model for 256 px images (32x32 codes from 8192), for benchmarks and single GPUs.
    "small": Preset(
        ModelConfig(text_len=64, codebook_size=8192, grid=32, width=512, layers=16, heads=8, head_dim=64),
        learning_rate=2.5e-3,
        total_steps=10_000,
        adam_learning_rate=2.5e-4,
    ),
    # The paper's model: 64 layers, 1024 wide, 16 heads of 64, text length 256, 32x32 codes from 8192;
    # the paper's peak learning rate and schedule.
    "ttt-1.1b": Preset(
        ModelConfig(text_len=256, codebook_size=8192, grid=32, width=1024, layers=64, heads=16, head_dim=64),
        learning_rate=2.5e-3,
        total_steps=31_250,
        adam_learning_rate=2.5e-4,
    ),
}


class SettingsError(UserError):
    pass


def find_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise SettingsError(f"--preset {name!r} is unknown; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def model_config(preset: str, tokenizer_path: str | None) -> ModelConfig:
    """The preset's model, with the tokenizer's vocabulary and pad id, and its text length when the tokenizer caps
    captions at fewer tokens (a tokenizers JSON's truncation; the sample's: 8 words): pad positions would only take
    compute, and attention, from the caption."""
    from pipeline.core.text import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    model = find_preset(preset).model.to_dict()
    text_len = min(model["text_len"], tokenizer.max_length or model["text_len"])
    return ModelConfig(**{**model, "text_vocab_size": tokenizer.vocab_size, "pad_id": tokenizer.pad_id,
                          "text_len": text_len})  # fmt: skip


def schedule_steps(preset: Preset, local_steps: int, target_batch_size: int, batch_size: int) -> int:
    """The learning-rate schedule's default length in optimizer steps: the preset's global steps; with DiLoCo
    (`local_steps`), as many inner steps as the preset's global batches hold batches of `batch_size`."""
    if not local_steps:
        return preset.total_steps
    return preset.total_steps * max(1, target_batch_size // batch_size)


@dataclass
class AuthSettings:
    """How a peer proves it is admitted to an authenticated run (training/auth/); absent: an open run."""

    authority_key: str  # the run's run.pub: what every token and revocation list is checked against
    token: str | None = None  # a token file from `ttt auth issue` (offline; not renewed)
    auth_server: str | None = None  # http(s)://host:port of `ttt auth serve`: tokens are renewed before expiry
    username: str | None = None  # on the server's allowlist (the password comes with it); None: a Hub account
    password: str | None = None
    hf_token: str | None = None  # a Hugging Face read token, for a server that admits an organisation's members
    refresh: float = 60.0  # seconds between checks of the token and the revocation list


@dataclass
class AuthServerSettings:
    """`ttt auth serve`: the run's auth server."""

    authority: str = "./authority"
    allowlist: str | None = None  # users.toml; exactly one of allowlist and hf_org
    hf_org: str | None = None  # admit the members of this Hugging Face organisation instead
    host: str = "0.0.0.0"
    port: int = 8765
    token_lifetime: float = TOKEN_LIFETIME
    certfile: str | None = None  # serve HTTPS with this certificate (and keyfile)
    keyfile: str | None = None


@dataclass(frozen=True)
class RunSettings:
    """What every peer of one run shares, as its organiser set it: the data, the model, the optimizer and how the
    peers average. `ttt train` and `ttt monitor` declare these options once (cli.py's `run_options`); every peer
    publishes them (`agreed_values`) and a peer set otherwise is refused before it takes part in any round."""

    run_id: str = "ttt-demo"
    dataset: str = DEFAULT_DATASET  # a folder, a parquet glob, hf://datasets/ORG/NAME or an fsspec URL
    preset: str = "tiny"
    tokenizer: str | None = None  # a tokenizers JSON file; None: byte-level UTF-8
    optimizer: str = DEFAULT_OPTIMIZER  # one of OPTIMIZERS: the peers download each other's state
    learning_rate: float | None = None  # peak; None: the preset's for the optimizer
    weight_decay: float = 0.01  # decoupled, on matrices only
    max_grad_norm: float = 1.0
    total_steps: int | None = None  # of the learning-rate schedule, in optimizer steps; None: `schedule_steps`
    target_batch_size: int = 64  # samples per global step, the whole swarm's
    local_steps: int = 0  # DiLoCo: inner steps between two outer steps (training/swarm/diloco.py); 0: synchronous
    outer_lr: float = 1.0  # DiLoCo's outer step: by default the average of the peers' parameters (docs/training.md)
    outer_momentum: float = 0.0  # > 0: a Nesterov step (the DiLoCo papers' 0.7, 0.9)
    outer_bits: int = 4  # DiLoCo: pseudo-gradients in 4 bits, 1 or 8 (training/swarm/compression.py)
    matchmaking_time: float = 5.0
    averaging_timeout: float = 60.0
    aggregation: str = "mean"  # one of AGGREGATIONS
    clip_tau: float = 1.0  # CenteredClip's radius (--aggregation centered-clip)
    seed: int = 0  # the initialisation every first peer of a run shares


@dataclass(frozen=True)
class RunSpec:
    """A run's settings as its organiser wrote them, with the authority's signature when the run has one
    (training/spec.py reads, writes, signs and checks specs)."""

    settings: RunSettings
    authority_key: str = ""  # the run's run.pub line (signed specs only)
    signature: str = ""  # base64: the authority's signature of `signed_bytes()`

    def signed_bytes(self) -> bytes:
        return json.dumps(asdict(self.settings), sort_keys=True).encode()

    def values(self) -> dict[str, AgreedValue]:
        """The spec as a DHT record and the monitor's page carry it."""
        return {**asdict(self.settings), "authority_key": self.authority_key, "signature": self.signature}


# RunSettings whose value names a file on the peer's own machine: the peers compare what the file holds (its
# `identity`), not its path.
MACHINE_PATHS = ("dataset", "tokenizer")


def run_option(name: str) -> str:
    """The command-line option of a RunSettings field."""
    return f"--{name.replace('_', '-')}"


@dataclass
class PeerSettings:
    """One volunteer's peer (`ttt train`): the run's settings, and those of this peer's own machine."""

    run: RunSettings = field(default_factory=RunSettings)
    # --join: a run's address (a peer's multiaddress, or its monitor's URL); the run's spec there gives `run`
    join: str | None = None
    run_options_given: tuple[str, ...] = ()  # the run settings given on the command line: they must be the spec's
    spec: RunSpec | None = None  # the spec this peer trains by (--run, --join), which it publishes in turn
    stream: bool = True  # False: copy the dataset to local disk first, then train from it
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    identity_path: str | None = None
    reachability: str = "auto"  # one of REACHABILITY: how the peer decides whether it joins as a client
    client_mode: bool = False  # hivemind's: others cannot connect to it (decided by `reachability` at start)
    bandwidth: float | None = None  # Mbit/s of upload: its share of each round it reduces (training/swarm/shares.py)
    batch_size: int | str = 16  # or AUTO: the largest that fits this device (chosen before training)
    max_memory: float | None = None  # GiB this peer may use at most; None: what the device has free
    max_steps: int | None = None  # stop after this many global (with local_steps: outer) steps
    outer_overlap: bool = True  # DiLoCo: each outer round runs while the next inner steps go on (peer/overlap.py)
    wait_for_peers: int = 1  # hold the first step until this many peers of the run (this one included) are here
    join_timeout: float = 60.0  # a joining peer asks the swarm to hold its step this long at most; 0: do not ask
    checkpoint_dir: str = DEFAULT_CHECKPOINT_DIR
    checkpoint_every: int = 10
    resume: bool = False
    display_name: str | None = None  # on the leaderboard; None: the end of the peer id
    device: str = "auto"
    threads: int | None = None
    loader_workers: int = 1
    # The share of global steps at which this peer recomputes one microbatch another peer committed (training/audit/);
    # 0: it audits nobody (and convicts nobody). Synchronous runs only.
    audit_rate: float = 0.1
    auth: AuthSettings | None = None


@dataclass
class MonitorSettings:
    """The run's monitor peer (`ttt monitor`): reads every peer's metrics, keeps the history, serves the dashboard."""

    run: RunSettings = field(default_factory=RunSettings)
    spec: RunSpec | None = None  # --run: the spec file the run was started from (signed or not); None: the options
    initial_peers: list[str] = field(default_factory=list)  # none: this monitor is the run's first node
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    identity_path: str | None = None
    reachability: str = "auto"  # as a peer's (PeerSettings.reachability)
    client_mode: bool = False  # decided by `reachability` at start
    bandwidth: float | None = None  # with assist_averaging: as a peer's (PeerSettings.bandwidth)
    host: str = "127.0.0.1"  # the dashboard's address; 0.0.0.0 serves it to everyone
    port: int = 8080
    refresh: float = 10.0  # seconds between reads of the run's metrics
    active_window: float = 180.0  # a peer whose last record is older than this is no longer active
    db: str | None = None  # the history's SQLite file; None: monitor.sqlite in checkpoint_dir
    checkpoint_dir: str = "./ckpt-monitor"
    checkpoint_every: int = 50  # global steps between downloads of the swarm's state; 0: none
    push_to: str | None = None  # hf://ORG/NAME: upload each checkpoint there
    dry_run: bool = False  # with push_to: list what would be uploaded, send nothing
    preview_prompts: list[str] = field(default_factory=list)  # drawn after each checkpoint; empty: the sample's
    vqgan_config: str | None = None  # the VQGAN the run's data was encoded with, to draw previews; None: the sample's
    vqgan_ckpt: str | None = None
    wandb_project: str | None = None
    assist_averaging: bool = False  # the public helper: in every round without samples, keeps and serves the state
    # With assist_averaging: the share of global steps at which the helper recomputes one microbatch another peer
    # committed, from the run's dataset; above 0 it also re-checks the others' failed verdicts. 0: it recomputes
    # nothing and checks only what it reduced (training/audit/helper.py).
    audit_rate: float = 0.0
    auth: AuthSettings | None = None
    revoke_convicted: str | None = None  # the run's authority folder: revoke the users the audits convict


AgreedValue = str | int | float | bool | None


def agreed_values(run: RunSettings, identities: Mapping[str, str]) -> dict[str, AgreedValue]:
    """The run's settings as a peer publishes them for the others to compare with theirs: every field, those that
    name a file of the peer's own machine (MACHINE_PATHS) by what the file holds (`identities`; a monitor that never
    reads the dataset leaves it out)."""
    values = {name: value for name, value in asdict(run).items() if name not in MACHINE_PATHS}
    return {**values, **identities}


def flag(name: str, value: AgreedValue) -> str:
    """A run setting as its option reads, e.g. `--local-steps 0`, or `--learning-rate (default)` when unset."""
    if value is None:
        return f"{run_option(name)} (default)"
    return f"{run_option(name)} {value:g}" if isinstance(value, float) else f"{run_option(name)} {value}"


def disagreement(
    run_id: str, theirs: Mapping[str, AgreedValue], ours: Mapping[str, AgreedValue], we: str = "this peer"
) -> str | None:
    """The first of our settings that another peer of the run publishes otherwise, with both values, in words (`we`:
    who holds ours); None when they agree (settings one side does not publish are not compared)."""
    for name, value in ours.items():
        if name in theirs and theirs[name] != value:
            return f"run {run_id!r} trains with {flag(name, theirs[name])}, {we} with {flag(name, value)}"
    return None
