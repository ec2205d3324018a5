"""The memory calculator (`ttt calc`): what a training setup keeps on the device and on the host, and what it sends.

A model is described by its parameter tensors (`Architecture.parameter_tensors`), so parameters, gradients
and optimizer state are counted the way the real tensors are allocated: bitsandbytes' 8-bit state is
blockwise per tensor (and 32-bit for tensors under 4,096 values), hivemind's averaging compresses each
tensor by its size. Activations are what autograd keeps for the backward pass, term by term, for ttt's
block (pre-norm attention with rotary queries and keys, GEGLU feed-forward) and the classic pre-/post-norm
block of the paper calculator's models; `bench/calc.py` checks all of these against real tensors.

The device total adds what is alive only for a moment (the logits and their gradient, a layer recomputed
by reversible layers or checkpointing) and, on a GPU, a margin for the allocator (`GPU_MARGIN`).

Pure arithmetic without torch: `ttt calc` answers at once and the monitor's Join page calls the same code.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from pipeline.core.errors import UserError
from training.config import (
    AVERAGE_STATE_EVERY,
    COMPRESSION_THRESHOLD,
    DEFAULT_OPTIMIZER,
    MIN_8BIT_SIZE,
    OPTIMIZER_STATES,
    PRESETS,
    ModelConfig,
)

GIB = 2**30
# ttt train's --optimizer choices, and two the calculator knows for other trainers' setups.
OPTIMIZERS = (*OPTIMIZER_STATES, "adamw-16bit", "adafactor")
PRECISIONS = ("fp32", "mixed", "bf16", "fp16")
ATTENTIONS = ("fused", "naive")
# Of the GPU total, for what cannot be measured on a CPU: 10% for the CUDA caching allocator's rounding and
# fragmentation, and 25% for what the one GPU measurement so far showed above the terms that are exact on the CPU
# (an H100, ttt-1.1b at batch 1: a peak of 1.41 GiB where the terms add up to 1.05; likely the CUDA attention
# kernels' workspace in the recomputed layers). bench/gpu.py measures it again on any GPU.
GPU_MARGIN = 0.35
QMAP_BYTES = 256 * 4  # bitsandbytes' quantisation map: its Adam8bit keeps two, shared by all tensors
AUDIT_SNAPSHOTS = 4  # steps of parameters an auditor keeps (training/audit/auditor.py's SNAPSHOTS_KEPT; a test
# checks they agree: importing it would import torch, and `ttt calc` is arithmetic)
EIGHT_BIT_BLOCK = 64  # values per bfloat16 scale in the 8-bit averaging codec (training/swarm/compression.py)


class CalcError(UserError):
    """A shape or setting the calculator cannot work with; the message says which and what to do."""


@dataclass(frozen=True)
class Architecture:
    """A transformer's shape, as much of it as memory depends on.

    `embeddings` are the token tables (text and image codes for DALL-E-like models); `logits` the
    (positions, classes) pairs the loss is computed over; `extra` any tensors outside the blocks (BERT's
    pooler, T5's relative position biases).
    """

    name: str
    layers: int
    width: int
    heads: int
    head_dim: int
    ff_hidden: int
    seq_len: int  # tokens each sample runs through the layers
    embeddings: tuple[int, ...]
    logits: tuple[tuple[int, int], ...]
    positions: int = 0  # learned position embeddings (0: rotary or relative positions)
    rotary: bool = False  # queries and keys are rotated into new tensors, which the attention keeps
    gated_ff: bool = False  # GEGLU: the up projection is twice as wide and its product is kept
    attention_bias: str = "all"  # "all" (q, k, v and output), "out" (output only) or "none"
    ff_bias: bool = True
    norm: str = "layer"  # "layer" (weight and bias, mean and rstd kept) or "rms" (weight, rstd)
    tied_output: bool = True  # the logits reuse the embeddings; else an output head (with a bias)
    shared_blocks: int | None = None  # with parameter sharing: the distinct blocks; None: every layer its own
    cross_attention_layers: int = 0  # an encoder-decoder's decoder layers, which attend to the encoder too
    pattern_masks: bool = False  # ttt's row/column/conv masks: a dense mask per layer, not just causal
    extra: tuple[int, ...] = ()
    input_ids: int | None = None  # token ids the embeddings read per sample; None: seq_len
    targets: int | None = None  # target ids per sample; None: seq_len

    def __post_init__(self) -> None:
        sizes = {"layers": self.layers, "width": self.width, "heads": self.heads, "head_dim": self.head_dim}
        sizes |= {"ff_hidden": self.ff_hidden, "seq_len": self.seq_len}
        for name, value in sizes.items():
            if value < 1:
                raise CalcError(f"{name} must be a positive number, got {value}")
        if any(rows < 1 for rows in self.embeddings) or any(p < 1 or c < 1 for p, c in self.logits):
            raise CalcError("vocabulary sizes must be positive numbers")
        if self.shared_blocks is not None and not 1 <= self.shared_blocks <= self.layers:
            raise CalcError(f"shared blocks must be between 1 and the {self.layers} layers, got {self.shared_blocks}")

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def distinct_blocks(self) -> int:
        return self.shared_blocks or self.layers

    def block_tensors(self, cross_attention: bool) -> list[tuple[int, ...]]:
        """The shape of each parameter tensor of one block."""
        width, inner, hidden = self.width, self.inner, self.ff_hidden
        norm = [(width,), (width,)] if self.norm == "layer" else [(width,)]
        attention = [*norm, (3 * inner, width), (width, inner)]
        attention += {"all": [(3 * inner,), (width,)], "out": [(width,)], "none": []}[self.attention_bias]
        up = (2 if self.gated_ff else 1) * hidden
        feed_forward = [*norm, (up, width), (width, hidden)] + ([(up,), (width,)] if self.ff_bias else [])
        return attention + (attention if cross_attention else []) + feed_forward

    def parameter_tensors(self) -> list[tuple[int, ...]]:
        """The shape of every parameter tensor of the model, as it allocates them."""
        tensors = [(rows, self.width) for rows in self.embeddings]
        if self.positions:
            tensors.append((self.positions, self.width))
        distinct_plain = min(self.distinct_blocks, self.layers - self.cross_attention_layers)
        for index in range(self.distinct_blocks):
            tensors += self.block_tensors(cross_attention=index >= distinct_plain)
        final_norms = 2 if self.cross_attention_layers else 1  # an encoder-decoder has one per stack
        tensors += ([(self.width,), (self.width,)] if self.norm == "layer" else [(self.width,)]) * final_norms
        if not self.tied_output:
            classes = sum(c for _, c in self.logits)
            tensors += [(classes, self.width), (classes,)]
        return tensors + [(numel,) for numel in self.extra]

    def parameter_count(self) -> int:
        return sum(math.prod(shape) for shape in self.parameter_tensors())


def architecture_of(name: str, config: ModelConfig) -> Architecture:
    """ttt's model (training/model.py) in the calculator's terms."""
    return Architecture(
        name=name,
        layers=config.layers,
        width=config.width,
        heads=config.heads,
        head_dim=config.head_dim,
        ff_hidden=config.ff_mult * config.width,
        seq_len=config.input_len,
        embeddings=(config.text_vocab_size, config.codebook_size),
        positions=config.image_tokens,  # the learned embedding of the grid cell each position predicts
        logits=((config.text_len - 1, config.text_vocab_size), (config.image_tokens, config.codebook_size)),
        rotary=True,
        gated_ff=True,
        attention_bias="out",
        shared_blocks=config.distinct_blocks if config.share_groups else None,
        pattern_masks=True,
        # The embeddings read the text and all codes but the last; the targets are the text after its first
        # token (a new tensor) and the codes themselves (the same tensor the embeddings read).
        input_ids=config.text_len + config.image_tokens,
        targets=config.text_len - 1,
    )


def gpt(name: str, layers: int, width: int, heads: int, context: int, vocab: int = 50257) -> Architecture:
    """GPT-2 / GPT-3: learned positions, pre-norm, GELU feed-forward 4x wide, biases, tied output."""
    return Architecture(name, layers, width, heads, width // heads, 4 * width, context, (vocab,), ((context, vocab),),
                        positions=context)  # fmt: skip


def bert(name: str, layers: int, width: int, heads: int) -> Architecture:
    """BERT: positions and token types, post-norm (the same tensors), pooler; logits over all positions."""
    return Architecture(name, layers, width, heads, width // heads, 4 * width, 512, (30522,), ((512, 30522),),
                        positions=512 + 2, extra=(width * width, width))  # fmt: skip


def t5(name: str, width: int, heads: int, head_dim: int, ff_hidden: int) -> Architecture:
    """T5: 24 encoder + 24 decoder layers (with cross-attention), RMS norms, no biases, relative positions."""
    return Architecture(name, 48, width, heads, head_dim, ff_hidden, 512, (32128,), ((512, 32128),),
                        attention_bias="none", ff_bias=False, norm="rms", cross_attention_layers=24,
                        extra=(32 * heads, 32 * heads))  # fmt: skip


MODELS: dict[str, Architecture] = {
    # The paper calculator's models with their published shapes (BERT: Devlin et al. 2019; T5: Raffel et al.
    # 2020; GPT-2: Radford et al. 2019, as released; GPT-3: Brown et al. 2020, table 2.1; GPT-J: Wang and
    # Komatsuzaki 2021; DALL-E: Ramesh et al. 2021).
    "bert-base": bert("bert-base", 12, 768, 12),
    "bert-large": bert("bert-large", 24, 1024, 16),
    "t5-3b": t5("t5-3b", 1024, 32, 128, 16384),
    "t5-11b": t5("t5-11b", 1024, 128, 128, 65536),
    "gpt2-s": gpt("gpt2-s", 12, 768, 12, 1024),
    "gpt2-m": gpt("gpt2-m", 24, 1024, 16, 1024),
    "gpt2-l": gpt("gpt2-l", 36, 1280, 20, 1024),
    "gpt2-xl": gpt("gpt2-xl", 48, 1600, 25, 1024),
    "gpt3-s": gpt("gpt3-s", 12, 768, 12, 2048),
    "gpt3-m": gpt("gpt3-m", 24, 1024, 16, 2048),
    "gpt3-l": gpt("gpt3-l", 24, 1536, 16, 2048),
    "gpt3-xl": gpt("gpt3-xl", 24, 2048, 24, 2048),
    "gpt3-3b": gpt("gpt3-3b", 32, 2560, 32, 2048),
    "gpt3-7b": gpt("gpt3-7b", 32, 4096, 32, 2048),
    "gpt3-13b": gpt("gpt3-13b", 40, 5140, 40, 2048),
    "gpt3-175b": gpt("gpt3-175b", 96, 12288, 96, 2048),
    "gpt-j-6b": Architecture(
        "gpt-j-6b",
        28,
        4096,
        16,
        256,
        16384,
        2048,
        (50400,),
        ((2048, 50400),),
        rotary=True,
        attention_bias="none",
        tied_output=False,
    ),  # fmt: skip
    # 64 layers of 3968 with 62 heads; 256 text tokens (16384 + 256 padding tokens) and 32x32 codes from 8192,
    # learned text positions and row/column embeddings for the image; an output head over both vocabularies.
    "dalle-12b": Architecture(
        "dalle-12b",
        64,
        3968,
        62,
        64,
        4 * 3968,
        256 + 1024,
        (16384 + 256, 8192),
        ((255, 16384 + 256), (1024, 8192)),
        positions=256 + 32 + 32,
        tied_output=False,
        pattern_masks=True,
    ),  # fmt: skip
    **{name: architecture_of(name, preset.model) for name, preset in PRESETS.items()},
}

# What each model was published with, for the test that the shapes above are the published ones.
PUBLISHED_PARAMETERS = {
    "bert-base": 110e6, "bert-large": 340e6, "t5-3b": 2.8e9, "t5-11b": 11e9,
    "gpt2-s": 124e6, "gpt2-m": 355e6, "gpt2-l": 774e6, "gpt2-xl": 1.5e9,
    "gpt3-s": 125e6, "gpt3-m": 350e6, "gpt3-l": 760e6, "gpt3-xl": 1.3e9, "gpt3-3b": 2.7e9, "gpt3-7b": 6.7e9,
    "gpt3-13b": 13e9, "gpt3-175b": 175e9, "gpt-j-6b": 6e9, "dalle-12b": 12e9,
}  # fmt: skip


@dataclass(frozen=True)
class Setup:
    """How the model is trained: what `ttt calc`'s options choose."""

    batch_size: int = 1  # micro-batch: samples per forward/backward
    optimizer: str = DEFAULT_OPTIMIZER  # one of OPTIMIZERS: whose state, in what precision
    offload: bool = False  # optimizer (its state, fp32 parameters and gradients) in host RAM
    checkpointing: bool = False  # keep each layer's input only; recompute the layer in the backward pass
    reversible: bool = False  # keep nothing per layer; recompute each layer's inputs from its outputs
    share: bool | None = None  # share the weights of the repeating groups (ttt, ALBERT); None: the model's
    precision: str = "fp32"  # fp32; mixed (autocast to half, fp32 weights); bf16 or fp16: everything 16-bit
    attention: str = "fused"  # fused kernels keep no scores; naive keeps the softmax of every head
    swarm: bool = True  # as a peer of a hivemind run (`ttt train`): its gradient accumulators and averaging buffers
    audits: bool = False  # as a swarm peer that audits others (training/audit/): a second model to recompute with
    peers: int = 4  # in the averaging group, for its traffic
    uplink_mbit: float = 50.0  # this peer's upload speed
    pcie_gbyte: float = 12.0  # host-device copy speed (PCIe 3.0 x16 in practice)

    def __post_init__(self) -> None:
        for name, choices in (("optimizer", OPTIMIZERS), ("precision", PRECISIONS), ("attention", ATTENTIONS)):
            if getattr(self, name) not in choices:
                raise CalcError(f"{name} {getattr(self, name)!r} is unknown; choose one of {', '.join(choices)}")
        if self.batch_size < 1 or self.peers < 1:
            raise CalcError("batch size and peers must be positive numbers")
        if not (0 < self.uplink_mbit < math.inf and 0 < self.pcie_gbyte < math.inf):
            raise CalcError("uplink and PCIe speeds must be positive, finite numbers")
        if self.reversible and self.checkpointing:
            raise CalcError("choose reversible layers or checkpointing, not both (reversible keeps less)")


def train_setup(
    config: ModelConfig,
    batch_size: int,
    local_steps: int = 0,
    optimizer: str = DEFAULT_OPTIMIZER,
    audit_rate: float = 0.0,
) -> Setup:
    """What `ttt train` runs, in the calculator's terms: its optimizer offloaded to the CPU, fp32, as a swarm peer,
    auditing others when `audit_rate` is above 0; with DiLoCo (`local_steps`), the optimizer steps on the device, no
    gradient accumulators are kept and nobody audits (its outer parameters, momentum and pseudo-gradients in host
    RAM, and the copy of the parameters each overlapped round began from, are not modelled: 16 bytes per
    parameter)."""
    diloco = local_steps > 0
    return Setup(
        batch_size=batch_size,
        optimizer=optimizer,
        offload=not diloco,
        reversible=config.reversible,
        swarm=not diloco,
        audits=audit_rate > 0 and not diloco,
    )


def find_model(name: str) -> Architecture:
    if name not in MODELS:
        raise CalcError(f"preset {name!r} is unknown; choose one of {', '.join(MODELS)} or give its shape")
    return MODELS[name]


def with_sharing(model: Architecture, share: bool | None) -> Architecture:
    """The model with or without shared groups: ttt's groups of 4 repeating layers plus the last, as
    training/model.py builds them; other models share all layers in one block, as ALBERT does."""
    if share is None:
        return model
    if not share:
        return replace(model, shared_blocks=None)
    if model.pattern_masks:
        return replace(model, shared_blocks=min(4, model.layers - 1) + 1)
    return replace(model, shared_blocks=1)


def optimizer_state_bytes(shape: tuple[int, ...], optimizer: str) -> int:
    """State of the optimizer's two moments (and step) for one tensor, as the optimizers ttt uses allocate it.

    ttt train's --optimizer choices: training/config.py's OPTIMIZER_STATES (8-bit moments with a float32 absmax per
    block of 256, 32-bit below 4,096 values; bitsandbytes' Adam8bit adds two quantisation maps per optimizer:
    `estimate`). adamw-16bit: AdamW with bf16 moments and a float32 step. adafactor: without momentum: float32 row
    and column statistics for a matrix, a full second moment for a vector.
    """
    numel = math.prod(shape)
    if optimizer in OPTIMIZER_STATES:
        return OPTIMIZER_STATES[optimizer].state_bytes(numel)
    if optimizer == "adafactor":
        return 4 * (sum(shape) if len(shape) == 2 else numel)
    return 2 * 2 * numel + 4


def compressed_bytes(numel: int) -> int:
    """One tensor as ttt's averaging sends it (training/swarm/compression.py): 8 bits per value and a 2-byte scale
    per block for tensors of >= 2^16 values, fp16 for the rest."""
    return numel + 2 * -(-numel // EIGHT_BIT_BLOCK) if numel >= COMPRESSION_THRESHOLD else 2 * numel


@dataclass
class Activations:
    """Bytes kept for backward (per micro-batch), by where they are kept."""

    per_layer: int  # everything one layer keeps when nothing is recomputed
    kept_layers: int  # what the layers keep with this setup (all of them, their inputs, or the last output)
    head: int  # the final norm, the logits' inputs, the log-probabilities and the token ids
    transient: int  # alive only for a moment: the logits and their gradient, a recomputed layer

    @property
    def kept(self) -> int:
        return self.kept_layers + self.head


def activation_bytes(model: Architecture, setup: Setup) -> Activations:
    """What autograd keeps per layer and around the layers, term by term as `bench/calc.py` finds it saved."""
    b, length, width, inner, hidden = setup.batch_size, model.seq_len, model.width, model.inner, model.ff_hidden
    tokens = b * length
    half = setup.precision != "fp32"
    value = 2 if half else 4  # the dtype of the matmuls' inputs and outputs
    stream = 4 if setup.precision in ("fp32", "mixed") else 2  # the residual stream (fp32 under autocast)
    stats = 4  # layer norms keep float32 statistics (mean and rstd) in every precision
    norm_stats = (2 if model.norm == "layer" else 1) * tokens * stats

    attention = tokens * width * stream + tokens * width * value + norm_stats  # norm input and output
    attention += 3 * tokens * inner * value  # q, k, v in one tensor
    if model.rotary:
        attention += 2 * tokens * inner * value  # the rotated q and k are new tensors
    attention += tokens * inner * value + b * model.heads * length * 4  # the output and its log-sum-exp
    if setup.attention == "naive":
        attention += b * model.heads * length * length * value  # the softmax of every head
    if model.pattern_masks:
        attention += length * length * value  # the boolean mask, turned into an additive one per call

    up = (2 if model.gated_ff else 1) * hidden
    feed_forward = tokens * width * stream + tokens * width * value + norm_stats  # norm input and output
    feed_forward += tokens * up * value + tokens * hidden * value  # the up projection and the activation
    if model.gated_ff:
        feed_forward += tokens * hidden * value  # value * gelu(gate), the down projection's input
    plain = attention + feed_forward
    cross = attention - tokens * inner * value  # keys and values come from the encoder
    layers = model.layers - model.cross_attention_layers
    all_layers = layers * plain + model.cross_attention_layers * (plain + cross)
    if setup.reversible:
        kept_layers = 2 * tokens * width * stream  # the two streams after the last layer
    elif setup.checkpointing:
        kept_layers = model.layers * tokens * width * stream  # each layer's input
    else:
        kept_layers = all_layers
    log_probabilities = b * sum(positions * classes for positions, classes in model.logits)
    logit_bytes = 4 if setup.precision in ("fp32", "mixed") else 2  # log_softmax runs in float32 under autocast
    head = tokens * width * stream + norm_stats  # the final norm's input and statistics
    head += b * sum(positions for positions, _ in model.logits) * width * value  # its output, for the logits
    head += log_probabilities * logit_bytes
    head += 8 * b * ((model.input_ids or length) + (model.targets or length))  # int64 token ids
    recomputes = setup.reversible or setup.checkpointing  # one layer at a time, in the backward pass
    recomputed = plain + (cross if model.cross_attention_layers else 0) if recomputes else 0
    transient = max(2 * log_probabilities * logit_bytes, recomputed)
    return Activations(per_layer=plain, kept_layers=kept_layers, head=head, transient=transient)


@dataclass
class Estimate:
    """What one setup of one model needs; bytes unless named otherwise."""

    model: str
    parameters_count: int
    setup: dict
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int  # kept for backward
    transient: int  # the peak's working memory on top
    accumulators: int  # hivemind's local gradient sums (on the device)
    host_copies: int  # fp32 host copies of the parameters and gradients (hivemind's averaging, the offloaded optimizer)
    audit_model: int  # an auditor's second model: its parameters and gradients (on the device)
    audit_snapshots: int  # an auditor's copies of the parameters of its last steps (in host memory)
    margin: int  # the GPU allocator's share (counted in device_total, which is for a GPU)
    device_total: int
    host_total: int
    cpu_total: int  # on a CPU-only machine device and host are the same RAM
    transfer_per_step: int  # host <-> device, per global step, when offloading
    transfer_seconds: float
    averaging_per_step: int  # sent by this peer per global step: gradients, and a tenth of a state round
    averaging_seconds: float
    components: dict = field(default_factory=dict)
    largest_batch_size: int | None = None  # with a memory to fit in (`ttt calc --fit`): the largest batch that does

    def to_dict(self) -> dict:
        return asdict(self)


def estimate(model: Architecture, setup: Setup) -> Estimate:
    """What training `model` with `setup` keeps where, and what it sends per global step."""
    model = with_sharing(model, setup.share)
    tensors = model.parameter_tensors()
    count = model.parameter_count()
    parameter_bytes = 2 if setup.precision in ("bf16", "fp16") else 4
    parameters = gradients = count * parameter_bytes
    state = sum(optimizer_state_bytes(shape, setup.optimizer) for shape in tensors)
    if setup.optimizer == "adam-8bit" and any(math.prod(shape) >= MIN_8BIT_SIZE for shape in tensors):
        state += 2 * QMAP_BYTES
    activations = activation_bytes(model, setup)
    accumulators = gradients if setup.swarm else 0
    # hivemind's averagers keep float32 copies of the parameters and gradients in shared host memory, and an
    # offloaded optimizer steps on exactly those tensors (hivemind reuses them); offloading alone needs them too.
    host_copies = 2 * count * 4 if setup.swarm or setup.offload else 0
    # Under autocast the matmuls keep the 16-bit copies of the weights they were given for the backward pass.
    kept = activations.kept + (2 * count if setup.precision == "mixed" else 0)
    # An auditor recomputes another peer's microbatch with a second model, from the parameters it kept of that step.
    # The recompute's activations come after this peer's own are freed: counted as one microbatch of this peer's
    # (a peer that commits larger microbatches than its auditors train with makes them need more).
    auditing = setup.audits and setup.swarm
    audit_model = parameters + gradients if auditing else 0
    audit_snapshots = AUDIT_SNAPSHOTS * parameters if auditing else 0
    on_device = parameters + gradients + accumulators + kept + activations.transient + audit_model
    if not setup.offload:
        on_device += state
    margin = math.ceil(GPU_MARGIN * on_device)
    host = host_copies + audit_snapshots + (state if setup.offload else 0)
    transfer = count * (4 + parameter_bytes) if setup.offload else 0  # gradients to the host, parameters back
    group = setup.peers
    gradient_bytes = sum(compressed_bytes(math.prod(shape)) for shape in tensors)
    # A butterfly all-reduce: each peer sends the others their parts of its vector, then its averaged part back.
    share_sent = 2 * (group - 1) / group if setup.swarm else 0
    averaging = round(share_sent * gradient_bytes * (1 + 1 / AVERAGE_STATE_EVERY))
    return Estimate(
        model=model.name,
        parameters_count=count,
        setup=asdict(setup),
        parameters=parameters,
        gradients=gradients,
        optimizer_state=state,
        activations=kept,
        transient=activations.transient,
        accumulators=accumulators,
        host_copies=host_copies,
        audit_model=audit_model,
        audit_snapshots=audit_snapshots,
        margin=margin,
        device_total=on_device + margin,
        host_total=host,
        cpu_total=on_device + host,
        transfer_per_step=transfer,
        transfer_seconds=transfer / (setup.pcie_gbyte * 1e9),
        averaging_per_step=averaging,
        averaging_seconds=averaging * 8 / (setup.uplink_mbit * 1e6),
        components={"activations_per_layer": activations.per_layer, "activations_head": activations.head},
    )


def needed_bytes(result: Estimate, on_gpu: bool) -> int:
    """What must fit in the device's memory: the GPU's share on a GPU, everything on a CPU-only machine."""
    return result.device_total if on_gpu else result.cpu_total


def largest_batch(model: Architecture, setup: Setup, budget: int, on_gpu: bool, limit: int = 4096) -> int:
    """The largest micro-batch (at most `limit`) whose estimate fits in `budget` bytes; 0 when not even one does."""
    low, high = 0, limit
    while low < high:  # memory grows with the batch, so the batches that fit are 1..answer
        middle = (low + high + 1) // 2
        if needed_bytes(estimate(model, replace(setup, batch_size=middle)), on_gpu) <= budget:
            low = middle
        else:
            high = middle - 1
    return low


def describe_model(config: ModelConfig) -> str:
    shared = architecture_of("", config).parameter_count()
    unshared = architecture_of("", ModelConfig(**{**config.to_dict(), "share_groups": False})).parameter_count()
    return (
        f"{config.layers} layers x {config.width} wide, {config.heads} heads of {config.head_dim}; "
        f"text {config.text_len}, image {config.grid}x{config.grid} from {config.codebook_size}; "
        f"{shared / 1e6:,.1f} M parameters ({unshared / 1e6:,.1f} M without sharing, "
        f"{unshared / shared:.1f}x fewer with sharing)"
    )
