"""Robust aggregation, the pure math: poisoned pieces dropped, CenteredClip instead of the mean.

A reducer of an all-reduce round holds one piece of a part from each sender (training/swarm/allreduce.py). It

1. drops poisoned pieces, in every mode: non-finite values, or a norm above `POISON_NORM_RATIO` times the
   group's median norm (with at least 3 pieces: between 2 there is no telling which one is wrong);
2. reduces the rest with the mean weighted by samples (hivemind's), or with CenteredClip (Karimireddy et
   al. 2021, as in BTARD, the paper's authors' follow-up): start from the coordinate-wise median m and iterate
   v += sum_i w_i min(1, r / ||x_i - v||) (x_i - v) / sum_i w_i until a step moves v by less than
   `CLIP_TOLERANCE` * r or after `CLIP_MAX_ITERATIONS` steps, with the radius r = tau * the median of the
   ||x_i - m||. A piece farther than r from the result counts as clipped: it pulled with a bounded force.

Each sender's weight is the number of samples it says it processed, which no one can check: `bounded_claims` caps
it first, so that one lie about a number cannot buy a sender the round (or the swarm's progress).

A sender on probation (in a run with audits, one whose work no audit this reducer trusts has yet passed:
training/audit/standing.py) is held to one median peer: its claim counts at most the median claim, and its piece is
shortened to at most the median piece's norm (`held_to_median`). Until someone has recomputed a piece of its work,
its word buys it no more pull than an ordinary peer's, whatever it sends.

Nothing here knows about hivemind: tensors and numbers in, a tensor out.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hivemind.averaging.partition import AllreduceException

POISON_NORM_RATIO = 10.0  # a piece this many times longer than the group's median piece is dropped
CLIP_TOLERANCE = 1e-3  # CenteredClip stops when a step moves the centre by less than this times the radius
CLIP_MAX_ITERATIONS = 20
CLAIM_CAP = 2.0  # a peer's claimed samples count at most this many times the median claim of its group
PROBATION_CLAIM_CAP = 1.0  # the same for a sender on probation: one median peer


@dataclass(frozen=True)
class Aggregation:
    """How a peer reduces the parts it owns; every peer of a run must use the same."""

    method: str = "mean"  # or "centered-clip"
    tau: float = 1.0  # CenteredClip's radius, in median distances of the pieces from their median

    def __str__(self) -> str:
        return self.method if self.method == "mean" else f"{self.method}:{self.tau:g}"


MEAN = Aggregation()


@dataclass
class Reduction:
    """One part reduced: the result, and the senders whose pieces were dropped or clipped."""

    average: torch.Tensor
    dropped: list[int]
    clipped: list[int]


def poisoned(pieces: torch.Tensor) -> torch.Tensor:
    """A mask of the pieces (one per row) that are not finite, or far longer than the group's median one."""
    finite = torch.isfinite(pieces).all(dim=1)
    bad = ~finite
    if finite.sum() >= 3:
        norms = pieces[finite].norm(dim=1)
        limit = POISON_NORM_RATIO * norms.median()
        bad[finite] = norms > limit
    return bad


def centered_clip(pieces: torch.Tensor, weights: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CenteredClip of the rows of `pieces` weighted by `weights`: the centre, and which rows it clipped.

    The radius is `tau` times the median distance of the pieces from their coordinate-wise median, so that one
    setting holds for any model and any point of training (gradients shrink as a run goes on; a fixed radius
    larger than the honest pieces' spread clips nothing, and CenteredClip becomes the mean).
    """
    centre = pieces.median(dim=0).values
    radius = tau * (pieces - centre).norm(dim=1).median()
    if radius <= 0:  # most pieces are equal: their value is the answer
        return centre, torch.zeros(len(pieces), dtype=torch.bool)
    weights = weights / weights.sum()
    for _ in range(CLIP_MAX_ITERATIONS):
        offsets = pieces - centre
        scale = (radius / offsets.norm(dim=1).clamp_min(1e-12)).clamp(max=1.0)
        step = (weights * scale) @ offsets
        centre = centre + step
        if step.norm() <= CLIP_TOLERANCE * radius:
            break
    return centre, (pieces - centre).norm(dim=1) > radius


def bounded_claims(claims: Sequence[float], probation: Sequence[bool] | None = None) -> list[float]:
    """Each claim (samples processed, or samples per second) capped at `CLAIM_CAP` times the median positive claim
    (`PROBATION_CLAIM_CAP` times for a claim whose `probation` is True).

    The rule bounds what one liar can do, whatever it claims: it counts as at most `CLAIM_CAP` median peers, so among
    n honest peers of equal claims its share of a round's weight (and of the swarm's progress) is at most
    CLAIM_CAP / (n + CLAIM_CAP): 1/2 beside two honest peers, 1/3 beside four. Honest peers stay weighted as they
    claim up to `CLAIM_CAP` times the median; a faster one (a GPU among CPUs) counts as that much. Between two peers
    the cap never binds (the larger claim is at most twice their median): there is no majority to tell who lies.
    """
    positive = [claim for claim in claims if claim > 0]  # a peer with nothing to add has no say in the cap
    if not positive:
        return [float(claim) for claim in claims]
    median = statistics.median(positive)
    caps = [PROBATION_CLAIM_CAP if probation and probation[i] else CLAIM_CAP for i in range(len(claims))]
    return [min(float(claim), cap * median) for claim, cap in zip(claims, caps, strict=True)]


def held_to_median(pieces: torch.Tensor, probation: Sequence[bool]) -> torch.Tensor:
    """The pieces (one per row), those on probation shortened to at most the median piece's norm."""
    norms = pieces.norm(dim=1)
    scale = (norms.median() / norms.clamp_min(1e-12)).clamp(max=1.0)
    held = torch.tensor([bool(flag) for flag in probation])
    return torch.where(held[:, None], pieces * scale[:, None], pieces)


def reduce_pieces(
    pieces: Sequence[torch.Tensor],
    weights: Sequence[float],
    aggregation: Aggregation,
    probation: Sequence[bool] | None = None,
) -> Reduction:
    """Reduce one part from the senders' pieces (None: a sender that sent nothing for it). A sender of weight 0 (a
    keeper's zeros, a peer tagging along) adds nothing to the average and is left out of the statistics too: its
    zeros would drag the median the poisoned-piece check and CenteredClip start from. `probation`: per sender, whether
    it is held to one median peer (None: nobody is)."""
    senders = [i for i, piece in enumerate(pieces) if piece is not None and weights[i] > 0]
    if not senders:
        raise AllreduceException("no sender contributed to this part")
    shape = pieces[senders[0]].shape
    stacked = torch.stack([pieces[i].reshape(-1).float() for i in senders])
    bad = poisoned(stacked)
    dropped = [senders[i] for i in torch.nonzero(bad).flatten().tolist()]
    kept = [i for i in range(len(senders)) if not bad[i]]
    held = [bool(probation and probation[i]) for i in senders]
    claimed = bounded_claims([weights[i] for i in senders], held)
    kept_weights = torch.tensor([claimed[i] for i in kept])
    if not kept or kept_weights.sum() <= 0:
        raise AllreduceException(f"every contribution to this part was poisoned (senders {dropped})")
    stacked = stacked[kept]
    if any(held):  # the norms and their median only where somebody is on probation: every part of every round
        stacked = held_to_median(stacked, [held[i] for i in kept])
    if aggregation.method == "centered-clip":
        average, clipped_rows = centered_clip(stacked, kept_weights, aggregation.tau)
        clipped = [senders[kept[i]] for i in torch.nonzero(clipped_rows).flatten().tolist()]
    else:
        average, clipped = (kept_weights / kept_weights.sum()) @ stacked, []
    return Reduction(average.reshape(shape).to(pieces[senders[0]].dtype), dropped, clipped)
