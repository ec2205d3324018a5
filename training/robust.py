"""Averaging that one bad peer cannot wreck: poisoned parts dropped, CenteredClip instead of the mean.

In hivemind's all-reduce every peer of a group owns a part of the tensors: each sender sends it its piece of
that part, it reduces them and sends the result back. hivemind reduces with a running weighted sum, so one
peer that sends huge or NaN gradients ruins everyone's model. Here the reducer keeps the pieces of a part
until all senders have sent theirs, then

1. drops poisoned pieces, in every mode: non-finite values, or a norm above `POISON_NORM_RATIO` times the
   group's median norm (with at least 3 pieces: between 2 there is no telling which one is wrong);
2. reduces the rest with the mean weighted by samples (hivemind's), or with CenteredClip (Karimireddy et
   al. 2021, as in BTARD, the paper's authors' follow-up): start from the coordinate-wise median m and iterate
   v += sum_i w_i min(1, r / ||x_i - v||) (x_i - v) / sum_i w_i until a step moves v by less than
   `CLIP_TOLERANCE` * r or after `CLIP_MAX_ITERATIONS` steps, with the radius r = tau * the median of the
   ||x_i - m||. A piece farther than r from the result counts as clipped: it pulled with a bounded force.

The averager process counts, per sender, the pieces it dropped or clipped; the peer reads the counts after each
global step (`RobustAveraging.outlier_counts`) and publishes them, so a monitor can show who sends outliers.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import as_aiter, azip

POISON_NORM_RATIO = 10.0  # a piece this many times longer than the group's median piece is dropped
CLIP_TOLERANCE = 1e-3  # CenteredClip stops when a step moves the centre by less than this times the radius
CLIP_MAX_ITERATIONS = 20


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


def reduce_pieces(pieces: Sequence[torch.Tensor], weights: Sequence[float], aggregation: Aggregation) -> Reduction:
    """Reduce one part from the senders' pieces (None: a sender that sent nothing for it)."""
    senders = [i for i, piece in enumerate(pieces) if piece is not None]
    if not senders:
        raise AllreduceException("no sender contributed to this part")
    shape = pieces[senders[0]].shape
    stacked = torch.stack([pieces[i].reshape(-1).float() for i in senders])
    bad = poisoned(stacked)
    dropped = [senders[i] for i in torch.nonzero(bad).flatten().tolist()]
    kept = [i for i in range(len(senders)) if not bad[i]]
    kept_weights = torch.tensor([float(weights[senders[i]]) for i in kept])
    if not kept or kept_weights.sum() <= 0:
        raise AllreduceException(f"every contribution to this part was poisoned (senders {dropped})")
    stacked = stacked[kept]
    if aggregation.method == "centered-clip":
        average, clipped_rows = centered_clip(stacked, kept_weights, aggregation.tau)
        clipped = [senders[kept[i]] for i in torch.nonzero(clipped_rows).flatten().tolist()]
    else:
        average, clipped = (kept_weights / kept_weights.sum()) @ stacked, []
    return Reduction(average.reshape(shape).to(pieces[senders[0]].dtype), dropped, clipped)


class RobustPartReducer(TensorPartReducer):
    """hivemind's reducer, keeping a part's pieces until every sender has sent its own, then `reduce_pieces`."""

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, aggregation: Aggregation) -> None:
        self.aggregation = aggregation
        self.outliers: Counter[tuple[int, str]] = Counter()  # (sender index, "dropped" | "clipped") -> pieces
        self.pieces: list[torch.Tensor | None] = [None] * num_senders
        self.weights = [0.0] * num_senders
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        self.pieces = [None] * self.num_senders
        self.accumulator = None  # the pieces are kept instead of summed

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        """hivemind's `accumulate_part`, keeping the piece instead of adding it to a sum."""
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1

        while part_index > self.current_part_index:
            await asyncio.wait(
                {self.current_part_future, asyncio.create_task(self.finished.wait())},
                return_when=asyncio.FIRST_COMPLETED,
            )
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {self.__class__.__name__}")

        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index

        current_part_future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            self.pieces[sender_index], self.weights[sender_index] = tensor_part, weight
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        return await current_part_future

    def check_current_part_finished(self) -> None:
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            try:
                reduction = reduce_pieces(self.pieces, self.weights, self.aggregation)
            except AllreduceException as error:
                self.current_part_future.set_exception(error)
            else:
                self.outliers.update({(sender, "dropped"): 1 for sender in reduction.dropped})
                self.outliers.update({(sender, "clipped"): 1 for sender in reduction.clipped})
                self.current_part_future.set_result(reduction.average)
            self.reset_accumulators()

    def finalize(self) -> None:
        self.pieces = []
        super().finalize()


class RobustAllReduceRunner(AllReduceRunner):
    """hivemind's all-reduce with a `RobustPartReducer`."""

    def __init__(self, *, aggregation: Aggregation, **kwargs) -> None:
        super().__init__(**kwargs)
        shapes = self.tensor_part_reducer.part_shapes
        self.tensor_part_reducer.finished.set()  # hivemind's summing reducer, never used: nothing to finalize
        self.tensor_part_reducer = RobustPartReducer(shapes, len(self.sender_peer_ids), aggregation)

    def outliers_by_sender(self) -> Counter[tuple[str, str]]:
        """(sender peer id, "dropped" | "clipped") -> its pieces this peer dropped or clipped in this round."""
        outliers = self.tensor_part_reducer.outliers
        return Counter({(self.sender_peer_ids[i].to_base58(), kind): n for (i, kind), n in outliers.items()})


class RobustAveraging:
    """A mixin for hivemind averagers: their all-reduce rounds reduce with `aggregation`, and they count outliers.

    The counts live in the averager's own process; `outlier_counts()` asks it for them over hivemind's pipe.
    """

    def __init__(self, *args, aggregation: Aggregation = MEAN, **kwargs) -> None:
        self.aggregation = aggregation
        self.outliers: Counter[tuple[str, str]] = Counter()
        super().__init__(*args, **kwargs)

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs
    ) -> None:
        """hivemind's `_run_allreduce_inplace_` with a `RobustAllReduceRunner`, counting its outliers."""
        group_id = group_info.group_id if group_id is None else group_id
        runner = RobustAllReduceRunner(
            aggregation=self.aggregation,
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        assert group_id in self._running_groups, f"Group id {group_id} was not registered in _register_allreduce_group"
        self._running_groups[group_id].set_result(runner)
        try:
            if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
                async for tensor, update in azip(as_aiter(*tensors), runner):
                    tensor.add_(update, alpha=self._averaging_alpha)
                    self.last_updated = get_dht_time()
                    self._state_updated.set()
            else:
                async for _ in runner:
                    raise ValueError("aux peers should not receive averaged tensors")
        finally:
            self.outliers.update(runner.outliers_by_sender())

    def outlier_counts(self) -> dict[tuple[str, str], int]:
        """Since this averager started: (sender peer id, "dropped" | "clipped") -> pieces (from any process)."""
        future = MPFuture()
        self._outer_pipe.send(("_outlier_counts", [], dict(future=future)))
        return future.result()

    async def _outlier_counts(self, future: MPFuture) -> None:
        future.set_result(dict(self.outliers))

