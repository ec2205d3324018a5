"""What `ttt generate` and `ttt demo` are configured with. Light on imports: the CLI takes its defaults from here."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.core.errors import UserError
from pipeline.core.layout import DEFAULT_DATASET
from pipeline.sample import DEFAULT_SAMPLE_PORT
from training.config import DEFAULT_CHECKPOINT_DIR

DEFAULT_OUT = "./samples"


class GenerateError(UserError):
    pass


@dataclass(frozen=True)
class SamplingSettings:
    """How each code is drawn; the defaults are `ttt generate`'s. Plain sampling is top_p=1."""

    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # keep the k most likely codes; 0: all
    top_p: float = 0.75  # keep the most likely codes whose probability reaches p; 1: all. The paper found
    # top-p 0.75 (or top-k 256) much better than plain sampling, and so does bench/generate.py.

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise GenerateError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise GenerateError(f"top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise GenerateError(f"top-p must be in (0, 1], got {self.top_p}")


@dataclass
class GenerateSettings:
    prompt: str
    checkpoint: str = DEFAULT_CHECKPOINT_DIR  # a checkpoint folder, a step folder or hf://ORG/NAME
    out: str = DEFAULT_OUT
    num_samples: int = 8
    keep: int | None = None  # None: keep all
    batch_size: int = 8  # images sampled at once
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    seed: int = 0
    vqgan_config: str | None = None
    vqgan_ckpt: str | None = None
    rerank_clip: str | None = None  # MODEL:WEIGHTS, e.g. ViT-B-32:/models/clip.pt
    device: str = "auto"

    def __post_init__(self) -> None:
        if not self.prompt.strip():
            raise GenerateError("the prompt is empty; say what to draw, e.g. ttt generate 'a red circle'")
        if self.keep is not None and not 1 <= self.keep <= self.num_samples:
            raise GenerateError(f"--keep {self.keep} must be between 1 and --num-samples {self.num_samples}")


@dataclass
class DemoSettings:
    dataset: str = DEFAULT_DATASET
    checkpoint_dir: str = DEFAULT_CHECKPOINT_DIR
    out: str = DEFAULT_OUT
    peers: int = 2  # local hivemind peers
    steps: int = 200  # global steps of at least 64 samples
    samples_per_prompt: int = 8
    seed: int = 0
    sample_port: int = DEFAULT_SAMPLE_PORT  # where the preprocess serves the sample's images on 127.0.0.1
