"""How well a checkpoint draws the embedded sample's domain: the share of images the sample judge accepts.

The held-out prompts are held-out layouts (pipeline/sample/domain.py's `is_heldout_layout`): no row of the
sample shows one, in either phrasing ("A above B" or "B below A"), so drawing them takes composing colours,
shapes and relations the model saw only in other combinations. Four per relation, half of them two different
shapes. The seen prompts occur in the embedded sample (four single shapes, three two-shape scenes per relation),
for contrast; a test checks both.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from inference.generate import open_checkpoint, sample_images
from inference.settings import GenerateSettings, SamplingSettings
from pipeline.sample.judge import Verdict, judge
from pipeline.vqgan.codec import load_vqgan, sample_vqgan_spec
from training.checkpoint import Checkpoint

HELDOUT_PROMPTS = (
    "a blue square above a purple circle",
    "a blue square below a yellow triangle",
    "a green circle left of a white triangle",
    "a purple triangle right of a red circle",
    "a green square above a yellow square",
    "a red circle below a purple circle",
    "a white triangle left of a blue triangle",
    "a red square right of a green square",
    "a blue triangle above a yellow circle",
    "a purple circle below a white square",
    "a green square left of a white triangle",
    "a blue circle right of a yellow triangle",
    "a purple circle above a red circle",
    "a green square below a red square",
    "a green triangle left of a yellow triangle",
    "a blue triangle right of a white triangle",
)
SEEN_PROMPTS = (
    "a red circle",
    "a blue square",
    "a yellow triangle",
    "a white circle",
    "a blue square above a white triangle",
    "a red circle above a purple triangle",
    "a purple square above a red circle",
    "a blue triangle above a blue square",
    "a blue square below a red square",
    "a yellow square below a purple circle",
    "a blue triangle left of a purple triangle",
    "a red circle left of a green square",
    "a yellow circle left of a white triangle",
    "a purple circle right of a red circle",
    "a blue square right of a red triangle",
    "a yellow square right of a red square",
)
CONFIDENCE = 0.95
BOOTSTRAP_DRAWS = 4000


def wilson_interval(successes: int, trials: int) -> tuple[float, float]:
    """Wilson's score interval of a proportion at CONFIDENCE (1.96 standard deviations)."""
    z, share = 1.959964, successes / trials
    centre = (share + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * np.sqrt(share * (1 - share) / trials + z * z / (4 * trials * trials))
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class Acceptance:
    accepted: dict[str, int]  # per prompt
    samples_per_prompt: int
    verdicts: dict[str, list[Verdict]] = field(default_factory=dict)  # per prompt, where judged here

    @property
    def total(self) -> int:
        return self.samples_per_prompt * len(self.accepted)

    @property
    def share(self) -> float:
        return sum(self.accepted.values()) / self.total

    def interval(self) -> tuple[float, float]:
        """A CONFIDENCE interval of the share. The images of one prompt pass or fail together far more than images
        of different prompts, so it is bootstrapped over prompts (seeded: the same counts give the same interval);
        where that says nothing (every prompt at 0% or at 100%), Wilson's interval over the images bounds it."""
        shares = np.array(list(self.accepted.values())) / self.samples_per_prompt
        draws = np.random.default_rng(0).choice(shares, size=(BOOTSTRAP_DRAWS, len(shares))).mean(axis=1)
        low, high = np.quantile(draws, [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2])
        wilson_low, wilson_high = wilson_interval(sum(self.accepted.values()), self.total)
        return float(min(low, wilson_low)), float(max(high, wilson_high))

    def count_of(self, prompt: str) -> str:
        return f"{self.accepted[prompt]} of {self.samples_per_prompt}"

    def summary(self) -> str:
        """"62% of 128 images (95% CI 48-75%)"."""
        low, high = self.interval()
        return f"{self.share:.0%} of {self.total} images ({CONFIDENCE:.0%} CI {low:.0%}-{high:.0%})"


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
    verdicts = {}
    for prompt in prompts:
        images = sample_images(checkpoint, vqgan, prompt, samples_per_prompt, batch_size, sampling, seed, False)
        verdicts[prompt] = [judge(image, prompt) for image in images]
    accepted = {prompt: sum(verdict.match for verdict in found) for prompt, found in verdicts.items()}
    return Acceptance(accepted, samples_per_prompt, verdicts)


def judge_sample_prompts(checkpoint_dir: str, samples_per_prompt: int, seed: int) -> dict[str, Acceptance]:
    """The judge's counts for every seen prompt and every held-out composition, sampled as `ttt generate` does by
    default (top-p 0.75, its batch size: a prompt's images are the ones `ttt generate` draws with the same seed)."""
    checkpoint = open_checkpoint(checkpoint_dir, "cpu")
    vqgan = load_vqgan(sample_vqgan_spec(), "cpu")
    judged = functools.partial(judge_acceptance, checkpoint, vqgan, samples_per_prompt=samples_per_prompt,
                               sampling=SamplingSettings(), seed=seed, batch_size=GenerateSettings.batch_size)
    return {"seen": judged(SEEN_PROMPTS), "held out": judged(HELDOUT_PROMPTS)}
