"""hivemind's matchmaking, paced: a peer that looks for a group reads the group's leaders from the DHT at most every
LEADER_READ seconds; and a search given up stops at once.

hivemind's `PotentialLeaders._update_queue_periodically` (averaging/matchmaking.py:500) reads the averagers declared
under the group key (`GroupKeyManager.get_averagers`, averaging/key_manager.py:70) again whenever `pop_next_leader`
finds its queue empty, and that asks again at once: a peer that looks for a leader before one declared itself reads
the DHT as fast as it answers, for as long as it looks. Measured on 127.0.0.1 (tiny preset): a public helper, which
looks for the trainers' group for most of each step, read the key 24,699 times in 55 s beside one trainer (450 a
second), which read it 15 times a second; beside two trainers, the helper's DHT and averager processes took 10.8
and 11.2 CPU-seconds in 65 s. Each read is a DHT request to the peers that store the key.

A leader declares itself for `matchmaking_time` (5 s by default); reading at most four times a second finds it
within a quarter of a second, as the reads of the network would at best.

The same read leaves out the leaders this peer refuses (`avoid_leaders`: those its audits convicted, whose requests
its averagers refuse): its averagers neither accept a convicted peer into their groups nor join a convicted leader's.

A search given up stops at once. hivemind's `StepControl.cancel` tells the averager first (`_cancel`) and marks the
step cancelled after; an averager that wakes before the mark (the main process busy on 2 shared cores) reads the step
as not cancelled and goes on looking for a group until the round's timeout, holding its matchmaking: the peer's next
round waited behind it ("Another look_for_group is already in progress") while the others averaged without it, and a
DiLoCo peer chased the swarm from download to download (seen in clean-clone runs 101 and 107). The step is now marked
first.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Iterable
from typing import Protocol

from hivemind.averaging.control import StepControl
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.p2p import PeerID
from hivemind.utils import MPFuture

LEADER_READ = 0.25  # seconds: the least time between two reads of a group key's leaders by one peer


class LeaderRefusal(Protocol):
    """Whom a peer's averagers refuse (training/audit/standing.py), as its matchmaking asks."""

    def keep_reading(self, dht) -> None: ...

    def refuses(self, peer_id: PeerID) -> bool: ...

    def convict(self, peer_ids: Iterable[str]) -> None: ...

    def leave_out(self, peer_ids: Iterable[str]) -> None: ...  # counted for nothing by the reducers (standing.py)


upstream_get_averagers = GroupKeyManager.get_averagers
upstream_cancel = StepControl.cancel  # hivemind's: tells the averager, then marks the step
next_read: weakref.WeakKeyDictionary[GroupKeyManager, float] = weakref.WeakKeyDictionary()
avoided: LeaderRefusal | None = None  # the leaders this process's averagers never join


async def paced_get_averagers(self: GroupKeyManager, group_key: str, only_active: bool):
    """hivemind's read of a group key's averagers, LEADER_READ seconds at least after this peer's previous one, less
    the refused ones."""
    wait = next_read.get(self, 0.0) - time.monotonic()
    if wait > 0:
        await asyncio.sleep(wait)
    next_read[self] = time.monotonic() + LEADER_READ
    averagers = await upstream_get_averagers(self, group_key, only_active)
    if avoided is None:
        return averagers
    avoided.keep_reading(self.dht)
    return [(peer_id, expiration) for peer_id, expiration in averagers if not avoided.refuses(peer_id)]


def cancel_marked_first(self: StepControl) -> bool:
    """hivemind's `StepControl.cancel`, with the step marked cancelled before its averager is told."""
    if self._trigger is not None:
        self._trigger.cancel()
    cancelled = MPFuture.cancel(self)
    if self._cancel is not None:
        self._cancel.set_result(None)
    return cancelled


def override_matchmaking(avoid: LeaderRefusal | None = None) -> None:
    """Every averager made after this (in this process, and in the averagers' processes it forks) paces its reads,
    and with `avoid`, never joins a leader it refuses; every step cancelled stops its search at once."""
    global avoided
    avoided = avoid
    GroupKeyManager.get_averagers = paced_get_averagers
    StepControl.cancel = cancel_marked_first
