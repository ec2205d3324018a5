"""A sketch of one microbatch's gradient: SKETCH_SIZE numbers that a peer commits to, and others recompute.

A run's sketches all read the same SKETCH_COORDINATES coordinates of the gradient (drawn over the whole parameter
vector from the run's seed), each with a random sign. Sketch number b sums the signed coordinates that lie in region b,
the b-th of SKETCH_SIZE equal slices of the flat parameter vector (the parameters in their order, flattened). It is
linear (the sketch of a sum is the sum of the sketches), costs microseconds for any model, and a gradient that is
scaled, zero, replayed from another batch or computed on other rows moves it by about its own length.

The regions make it checkable in pieces: a reducer of an all-reduce round receives one contiguous slice of each
sender's gradient, and the sketch numbers of the regions inside its slice are the sums it can compute from what it
received (training/audit/received.py).

The seed is public (the run's id): a peer that computes the honest gradient and adds something only to coordinates
no sketch reads, or inside the sketch's null space, is not seen. That attack needs the honest gradient's compute
anyway; closing it needs a seed revealed after the commitment (not built).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

SKETCH_COORDINATES = 4096  # gradient coordinates one step's sketches read
SKETCH_SIZE = 32  # numbers in one sketch
# A recomputed sketch this far from the committed one (relative to the recomputed sketch's length) fails the audit.
# Honest peers of one lineage hold the same parameters (every member of a round gets the same bits): their distances
# were 0.016 (median), 0.030 (90%) and 0.078 at most in 196 audits of 48 steps (four tiny peers); the attacks above
# move a sketch by about its whole length (1 and more). docs/training.md#checked-work has the figures.
AUDIT_TOLERANCE = 0.5
OUTLIER_WEIGHT = 25.0  # how many times as likely as an ordinary microbatch an outlying one is audited, at most


def run_seed(run_id: str) -> int:
    """The seed of a run's sketches, the same on every peer of the run."""
    return int.from_bytes(hashlib.sha256(f"{run_id}|sketch".encode()).digest()[:8], "little") >> 1


@dataclass(frozen=True)
class Sketcher:
    """Which coordinates of which parameters a run's sketches read, with their signs and regions."""

    picks: tuple[tuple[int, torch.Tensor], ...]  # (parameter index, flat indices into that parameter's gradient)
    coordinates: torch.Tensor  # the same coordinates as indices into the flat parameter vector, ascending
    signs: torch.Tensor  # +-1.0, one per coordinate, in the order of `coordinates`
    buckets: torch.Tensor  # 0..SKETCH_SIZE-1, one per coordinate: the region it lies in
    bounds: torch.Tensor  # SKETCH_SIZE + 1 offsets into the flat vector: region b is [bounds[b], bounds[b + 1])

    @classmethod
    def for_run(cls, sizes: Sequence[int], seed: int) -> Sketcher:
        """The sketcher of a model whose parameters have `sizes` elements, in a run of `seed`."""
        generator = torch.Generator().manual_seed(seed)
        starts = torch.tensor([0, *sizes]).cumsum(0)
        total = int(starts[-1])
        flat = torch.randint(total, (SKETCH_COORDINATES,), generator=generator).sort().values
        owner = torch.searchsorted(starts, flat, right=True) - 1
        picks = tuple(
            (int(index), flat[owner == index] - starts[index]) for index in owner.unique().tolist()
        )  # fmt: skip
        signs = torch.randint(2, (SKETCH_COORDINATES,), generator=generator).float() * 2 - 1
        bounds = torch.arange(SKETCH_SIZE + 1) * total // SKETCH_SIZE
        buckets = torch.searchsorted(bounds, flat, right=True) - 1
        return cls(picks, flat, signs, buckets, bounds)

    def sketch(self, grads: Sequence[torch.Tensor | None]) -> list[float]:
        """The sketch of the gradient whose parameters' gradients are `grads` (None: a parameter without one)."""
        values = [
            grads[index].detach().reshape(-1)[coordinates].float().cpu()
            if grads[index] is not None
            else torch.zeros(len(coordinates))
            for index, coordinates in self.picks
        ]
        summed = torch.zeros(SKETCH_SIZE, dtype=torch.float64)
        summed.index_add_(0, self.buckets, (torch.cat(values) * self.signs).double())
        return summed.tolist()


def sketch_distance(claimed: Sequence[float], recomputed: Sequence[float]) -> float:
    """How far a committed sketch is from the recomputed one, relative to the recomputed one's length."""
    claimed_, recomputed_ = torch.tensor(claimed, dtype=torch.float64), torch.tensor(recomputed, dtype=torch.float64)
    length = float(recomputed_.norm())
    difference = float((claimed_ - recomputed_).norm())
    if length == 0.0:
        return 0.0 if difference == 0.0 else float("inf")
    return difference / length


def audit_weights(sketches: Sequence[Sequence[float]]) -> list[float]:
    """How likely an audit picks each of one step's committed microbatches (at one lineage), relative to the others:
    (its sketch's distance from the median sketch / the median of those distances) squared, within 1 and
    OUTLIER_WEIGHT. Honest microbatches at the same parameters scatter around one gradient and weigh about 1 each;
    one that is scaled far from them (a quiet poisoner's -9x: about 9 times the scatter) is picked up to OUTLIER_WEIGHT
    times as often. Whatever the others commit, an outlier at the cap is picked at least as often as uniform picks
    would: a decoy cannot draw the audits away from it beyond the cap. Fewer than three sketches: uniform."""
    if len(sketches) < 3:
        return [1.0] * len(sketches)
    stacked = torch.tensor(sketches, dtype=torch.float64)
    distances = (stacked - stacked.median(dim=0).values).norm(dim=1)
    typical = float(distances.median())
    if typical == 0.0:
        return [1.0] * len(sketches)
    return ((distances / typical) ** 2).clamp(1.0, OUTLIER_WEIGHT).tolist()
