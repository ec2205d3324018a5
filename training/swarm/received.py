"""What a reducer received from each sender of a gradient round, as a few numbers the senders committed to.

A reducer of an all-reduce round receives one contiguous slice of each sender's gradient (its span: hivemind's
`TensorPartContainer` splits the flat vector in proportion to the members' bandwidths). With a `Projection` (a
signed sum of chosen coordinates into regions of the flat vector: the audits' sketch, training/audit/sketch.py), it
sums, per sender, the signed received values of the coordinates inside its span, region by region, and keeps the
regions that lie wholly inside it. Those sums are the sketch numbers of those regions of what the sender sent: the
audits compare them with what the sender committed to (training/audit/received.py).

Nothing here knows what the numbers mean; the averager's process keeps the last rounds' sums until the peer's main
process asks for them (`RobustAveraging.received_rounds`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ROUNDS_KEPT = 8  # rounds' sums an averager keeps for its main process, which asks at every global step


@dataclass(frozen=True)
class Projection:
    """Signed coordinates of the flat vector, summed by region (training/audit/sketch.py's `Sketcher`)."""

    coordinates: torch.Tensor  # indices into the flat vector (the tensors in their order, flattened), ascending
    signs: torch.Tensor  # one per coordinate
    buckets: torch.Tensor  # one per coordinate: its region
    bounds: torch.Tensor  # region b is [bounds[b], bounds[b + 1])

    def regions_within(self, start: int, end: int) -> list[int]:
        """The regions that lie wholly inside [start, end)."""
        return [b for b in range(len(self.bounds) - 1) if start <= self.bounds[b] and self.bounds[b + 1] <= end]


@dataclass
class SpanSums:
    """One round's sums at one reducer: for each sender, its pieces' signed values summed by region."""

    projection: Projection
    span: tuple[int, int]  # this reducer's [start, end) of the flat vector
    part_starts: list[int]  # where each of its parts begins in the flat vector
    sums: dict[int, torch.Tensor] = field(default_factory=dict)  # sender index -> one sum per region

    def add(self, sender: int, part_index: int, piece: torch.Tensor) -> None:
        """Add the coordinates inside one received piece (part `part_index` of this reducer's span)."""
        start = self.part_starts[part_index]
        coordinates = self.projection.coordinates
        inside = (coordinates >= start) & (coordinates < start + piece.numel())
        if sender not in self.sums:
            self.sums[sender] = torch.zeros(len(self.projection.bounds) - 1, dtype=torch.float64)
        values = piece.reshape(-1)[coordinates[inside] - start].double() * self.projection.signs[inside].double()
        self.sums[sender].index_add_(0, self.projection.buckets[inside], values)

    def regions(self) -> list[int]:
        return self.projection.regions_within(*self.span)


def span_of(part_sizes_by_peer: list[list[int]], peer_index: int) -> tuple[tuple[int, int], list[int]]:
    """A reducer's span of the flat vector, and where each of its parts begins, from every member's part sizes (the
    parts follow each other in the members' order)."""
    start = sum(sum(sizes) for sizes in part_sizes_by_peer[:peer_index])
    starts, offset = [], start
    for size in part_sizes_by_peer[peer_index]:
        starts.append(offset)
        offset += size
    return (start, offset), starts
