"""How well a checkpoint draws the embedded sample's domain: the share of images the sample judge accepts.

The held-out prompts are two-shape scenes that never occur in the embedded sample (the default
1,200 rows), in either phrasing ("A above B" or "B below A"; a test checks it), so drawing
them takes composing colours, shapes and relations the model saw only in other combinations.
The seen prompts occur in the training data (four single shapes, four two-shape scenes), for contrast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.generate import sample_images
from inference.settings import SamplingSettings
from pipeline.sample.judge import judge
from training.checkpoint import Checkpoint

HELDOUT_PROMPTS = (
    "a red circle above a green triangle",
    "a yellow triangle below a purple triangle",
    "a blue circle left of a white circle",
    "a purple square right of a blue circle",
    "a yellow circle above a white triangle",
    "a green square below a white triangle",
    "a purple square left of a yellow square",
    "a red circle right of a yellow square",
)
SEEN_PROMPTS = (
    "a red circle",
    "a blue square",
    "a yellow triangle",
    "a white circle",
    "a yellow triangle below a blue circle",
    "a red square right of a green triangle",
    "a green triangle left of a yellow triangle",
    "a white circle left of a red square",
)


@dataclass
class Acceptance:
    accepted: dict[str, int]  # per prompt
    samples_per_prompt: int

    @property
    def total(self) -> int:
        return self.samples_per_prompt * len(self.accepted)

    @property
    def share(self) -> float:
        return sum(self.accepted.values()) / self.total


def judge_acceptance(
    checkpoint: Checkpoint,
    vqgan: torch.nn.Module,
    prompts: tuple[str, ...],
    samples_per_prompt: int,
    sampling: SamplingSettings,
    seed: int = 0,
    batch_size: int = 16,
) -> Acceptance:
    """Sample `samples_per_prompt` images per prompt and count those the sample judge accepts."""
    accepted = {}
    for prompt in prompts:
        images = sample_images(checkpoint, vqgan, prompt, samples_per_prompt, batch_size, sampling, seed)
        accepted[prompt] = sum(judge(image, prompt).match for image in images)
    return Acceptance(accepted, samples_per_prompt)
