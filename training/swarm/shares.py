"""Who reduces how much of a round: each reducer's share of the flat vector, by the bandwidth it declared.

In hivemind's all-reduce every full peer reduces a part of the averaged vector; every other member sends it that
part and receives the result. A reducer with a slow link holds up the whole round, so a part should follow its
reducer's link: `ttt train --bandwidth` and `ttt monitor --bandwidth` declare a peer's upload in Mbit/s, which
hivemind gathers with the group.

hivemind turns the declared bandwidths into parts by a linear program (`load_balance_peers`) whose model is a round
of full peers, each sending its own vector besides the parts it reduces. It gives everything to the fastest peer
whenever the others are much slower, and clients (NAT'd homes) count for nothing in it: with two helpers of 100 and
10 Mbit/s in an all-NAT run, one reduced every part (measured: (0, 0, 0, 1000000, 0)), a parameter server in all but
name, and a peer that declares the most takes the round. Here each reducer's part is in proportion to its declared
bandwidth, counted at most SHARE_CAP times the median of the other reducers' declared ones: a reducer returns what
it likes for its part (the checks of what reducers return are not built: docs/training.md#checked-work), so one
that lies about its link takes at most 4 / (n + 3) of a round of n reducers. A reducer that declared nothing counts
as the median of the others (as counted); without declared bandwidths the parts are equal, as hivemind's are.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from hivemind.averaging.allreduce import AveragingMode

SHARE_CAP = 4.0  # a reducer's declared bandwidth counts at most this many times the other reducers' median


def reducer_shares(bandwidths: Sequence[float | None], modes: Sequence[AveragingMode]) -> tuple[float, ...]:
    """Each member's share of a round's reduction (hivemind's `peer_fractions`: they need not add up to 1), from
    the bandwidths the members declared (None, or anything but a positive number: not declared) and their modes (a
    client reduces nothing). Every member computes the same shares from the same gathered data."""
    reducing = [mode != AveragingMode.CLIENT for mode in modes]
    declared = [float(b) if reduces and usable(b) else None for b, reduces in zip(bandwidths, reducing, strict=True)]
    counted = [None if b is None else capped(b, index, declared) for index, b in enumerate(declared)]
    known = [bandwidth for bandwidth in counted if bandwidth is not None]
    usual = statistics.median(known) if known else 1.0  # what a reducer that declared nothing counts as
    return tuple(
        0.0 if not reduces else usual if bandwidth is None else bandwidth
        for bandwidth, reduces in zip(counted, reducing, strict=True)
    )


def usable(bandwidth: object) -> bool:
    """Whether a member's declared bandwidth is one (another member's gathered data: anything)."""
    number = isinstance(bandwidth, int | float) and not isinstance(bandwidth, bool)
    return number and math.isfinite(bandwidth) and bandwidth > 0


def capped(bandwidth: float, index: int, declared: Sequence[float | None]) -> float:
    """The bandwidth that member `index` declared, at most SHARE_CAP times the median of the others' declared."""
    others = [b for i, b in enumerate(declared) if b is not None and i != index]
    return min(bandwidth, SHARE_CAP * statistics.median(others)) if others else bandwidth
