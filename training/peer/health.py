"""A peer's guards against ending up broken or apart from the others.

- Rollback: non-finite parameters (a poisoned round, an overflow) go back to the last good ones, then to the
  swarm's state.
- Lineage repair: when more peers held another lineage than this one's at a recent global step (this peer's round
  failed, or the others averaged without it), it downloads the swarm's state at once: a state round averages the
  parameters but not the optimizer's statistics, and joins no lineages (what a lineage is: training/swarm/optimizer.py).
- The final agreement: finished peers agree on their final parameters before they leave.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import torch
from rich.console import Console

from training.peer.report import ProgressReport
from training.peer.rounds import Mode
from training.peer.view import RunView
from training.swarm.member import SwarmMember
from training.swarm.optimizer import left_behind

FINISH_WAIT = 60.0  # seconds a finished peer waits at least for the others to finish their last step
FINISH_MARGIN = 30.0  # seconds beyond --averaging-timeout: a peer behind may end its step by a round that long


def finish_wait(averaging_timeout: float) -> float:
    """How long a finished peer waits for the others: long enough for a peer behind to end its last step by a round
    that looks for its group until --averaging-timeout, then to download the state.

    A peer that downloaded the state a step behind the others looked for the group of its next round while they
    took their last step together and finished; it looked until the timeout (60 s), found nobody and ended the
    step alone, and by then the others had waited their minute and left (clean-clone run 159, a loaded host)."""
    return max(FINISH_WAIT, averaging_timeout + FINISH_MARGIN)


class LastGoodState:
    """A CPU copy of the parameters after the last healthy global step, to roll back a poisoned one."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.keep(model)

    def keep(self, model: torch.nn.Module) -> None:
        self.parameters = [p.detach().cpu().clone() for p in model.parameters()]

    @torch.no_grad()
    def restore_if_broken(self, model: torch.nn.Module) -> bool:
        """If any parameter is NaN or infinite, copy the last good values back and return True.

        One sum per tensor and one check of their total: a NaN or an infinity anywhere makes it non-finite, and
        healthy parameters never add up past float32's range (checking each tensor took 10x longer)."""
        sums = torch.stack([p.sum(dtype=torch.float32) for p in model.parameters()])
        if torch.isfinite(sums.sum()):
            return False
        for parameter, good in zip(model.parameters(), self.parameters, strict=True):
            parameter.copy_(good)
        return True


class Health:
    """Rollback and lineage repair of one peer's parameters."""

    def __init__(
        self, model: torch.nn.Module, member: SwarmMember, view: RunView, report: ProgressReport, console: Console
    ) -> None:
        self.model, self.member, self.view, self.report, self.console = model, member, view, report, console
        self.last_good = LastGoodState(model)
        self.repaired_at = -1  # the latest global step a lineage repair was for

    def keep(self) -> None:
        """The parameters are healthy now: the state to roll back to."""
        self.last_good.keep(self.model)

    def restore_if_broken(self) -> bool:
        """Non-finite parameters go back to the last good ones, then to the swarm's state; True if they were."""
        if not self.last_good.restore_if_broken(self.model):
            return False
        self.console.print("[red]non-finite parameters: rolled back to the last good state[/]")
        if self.member.peers > 1:
            self.member.download_state()
        return True

    def repair_if_split(self) -> bool:
        """Mid-run repair: when more peers held another lineage than this one's at a recent global step (its round
        failed, or averaged without them), download the swarm's state at once (`left_behind`). Whether it
        downloaded.

        The run's records come from the last read, a batch or so old, and their peers may have moved on since the
        step this one compares: each record names its peer's lineages of its recent steps, compared with those this
        peer published at the same steps (`ProgressReport.lineages`).

        One repair per step: hivemind downloads from any peer of the latest step, which may be apart too, and the
        others' records name that step for 4 steps more. An honest peer of test_audit that downloaded a helper's
        state apart at step 5 downloaded it again 17 times, one batch after another (clean-clone run 219); it is
        apart in its next round, and repairs then for that step."""
        found = left_behind(self.report.lineages, (m.lineages_held() for m in self.view.others(finished_too=True)))
        if found is None or found[0] <= self.repaired_at:
            return False
        step, holders = found
        self.repaired_at = step
        self.console.print(
            f"[yellow]step {step}: {holders} peers held parameters that this one's had left (a round without them): "
            "downloading the swarm's state now[/]"
        )
        self.member.download_state()
        self.keep()
        self.report.lineages = {}  # what this peer held before says nothing of what it holds now
        self.report.publish()
        return True


def agree_on_final_parameters(
    step: int, view: RunView, member: SwarmMember, mode: Mode, download: Callable[[bool], bool], wait: float
) -> bool:
    """Agree with the other finished peers on the final parameters, at most `wait` seconds (`finish_wait`); whether
    they did.

    A peer whose averaging round failed applied only its own gradient and ended apart from the others. Finished
    peers publish a hash of their parameters; a peer outside the largest group downloads the state from the others
    (`download`, which says whether a state arrived). Only a group with a full peer in it can be downloaded from:
    such groups come first, then larger ones, then the larger hash. When no finished peer serves its state (every
    trainer behind NAT), the state all can reach is a helper's (`ttt monitor --assist-averaging`): each finished
    peer downloads it once, and they agree on it. Before, one home kept its own hash, another downloaded the
    helper's, which was neither, again and again until the deadline (seen in test_wan's all-NAT run).

    Everyone waits until all peers at this step agree, so nobody leaves while another still needs it. A peer this
    one gave up on (`mode.given_up_on`) is waited for as long as it answers a ping: slow, it may still end its last
    step apart (seen: its matchmaking began after the others' group closed) and need the others' state; gone
    without a goodbye, it holds nobody up.
    """
    deadline, tries, fetched = time.monotonic() + wait, 0, False
    while time.monotonic() < deadline:
        peers = view.read_now()
        behind = [m for m in peers if not m.finished and m.step <= step]
        given_up = [m for m in behind if mode.given_up_on(m)]
        if len(given_up) < len(behind) or view.answering(given_up):
            time.sleep(1.0)  # someone is still on its last step
            continue
        finished = [m for m in peers if m.finished and m.step == step]
        hashes = Counter(m.parameters_hash for m in finished)
        if len(hashes) <= 1:
            return True
        served = {m.parameters_hash for m in finished if m.serves_state}
        if served:
            needs_download = member.parameters_hash() != max(hashes, key=lambda h: (h in served, hashes[h], h))
        else:
            needs_download = not fetched
        if needs_download:
            fetched = download(tries == 0) or fetched  # the first try, or another: nobody may serve a state at all
            tries += 1
        time.sleep(1.0)
    return False
