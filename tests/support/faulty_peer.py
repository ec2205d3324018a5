"""A `ttt train` peer that misbehaves on purpose, for bench/robust.py and the tests.

    python -m tests.support.faulty_peer FAULT [ttt train options]     (from the repository's root)

FAULT is one fault, or several joined by "+" (scale:-5+claim:1000):
    scale[:F]   sends its gradients multiplied by F (-10 if not given)
    noise       sends random gradients of 100 times its honest norm
    replay      sends, for each microbatch, the gradient of its previous one (zeros for its first): an earlier
                gradient replayed, as a copycat's
    nan         sends NaN gradients
    claim:K     claims K times the samples it processes: its weight in each round and its share of the swarm's
                progress
    leave:STEP  stays out of the gradient round of global step STEP (as a peer whose matchmaking failed), so that
                it applies its own gradients alone at that step
    cut:ROUND   (DiLoCo) in the ROUNDth averaging round it takes part in, sends the others only the first result
                of the part it reduces, then ends their streams (as a stream reset while the results were on their
                way): its own round succeeds, theirs lose that part
    lie[:F]     a sketch liar: commits the honest sketch of each microbatch, then sends its gradient multiplied by F
                (-9 if not given)
    rows        trains honestly on rows it did not lease: each batch it is handed swapped for as many rows of a row
                group that none of the batch's leased blocks holds; it commits to those rows, their honest sketches
                and the blocks it was handed
    accuse      a false accuser: audits at every global step (whatever --audit-rate says) and fails every
                microbatch it checks or re-checks, its recomputed sketch negated as the verdict's evidence
    stall:ROUND (DiLoCo) in the ROUNDth round, sends the others only the first result of its part and then nothing
                more, keeping their streams open (as a connection that hangs): its own round succeeds
    slow[:S]    sleeps S seconds (1 if not given) before each microbatch's forward pass: an honest peer on a slow
                machine, whatever the pace of the machine the test runs on
    hide:STEP   honest until global step STEP (proven by the audits meanwhile), then a quiet poisoner out of their
                sight: it commits under a lineage of its own, which no auditor holds, and sends its gradients x -9
                (what it commits, with its samples claimed honestly: the reducers' checks pass it)

The peer is otherwise the real one (same options, same protocol): the gradient faults are hooks on its
parameters' gradients, so what its averager sends is what a broken or malicious peer would send.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator

import torch
from rich.console import Console

from cli import fail_cleanly, peer_settings, train
from pipeline.core.blocks import EpochPlan
from pipeline.core.stream import read_rows
from training.config import PeerSettings
from training.peer.join import join
from training.peer.loop import Peer
from training.swarm.allreduce import RobustAllReduceRunner

ROUND_SECONDS = 2.0  # the all-reduce of a round on 127.0.0.1, which a peer that left waits for in vain

GRADIENT_FAULTS = {
    "scale": lambda factor: lambda grad: grad * float(factor or -10.0),
    "noise": lambda _: lambda grad: torch.randn_like(grad) * (100.0 * grad.norm() / grad.numel() ** 0.5),
    "nan": lambda _: lambda grad: torch.full_like(grad, float("nan")),
    "replay": lambda _: replayed(),
}
STALL_SECONDS = 600.0  # how long a stalled stream of results stays open and silent


def replayed() -> Callable[[torch.Tensor], torch.Tensor]:
    """A hook (on one parameter) that swaps each gradient for the one before it."""
    previous: list[torch.Tensor] = []

    def replay(grad: torch.Tensor) -> torch.Tensor:
        earlier = previous.pop() if previous else torch.zeros_like(grad)
        previous.append(grad.detach().clone())
        return earlier

    return replay


def accuse_everyone(peer: Peer) -> None:
    """Make the peer's audits run at every global step and fail whatever they check: each recomputed sketch is
    negated, so that it lies a whole two lengths from the committed one (an honest one is within 0.08)."""
    if peer.audits is None:
        sys.exit("faulty peer: accuse needs the audits (--audit-rate above 0, and no --local-steps)")
    recomputer = peer.audits.recomputer
    recompute = recomputer.recompute

    def recompute_falsely(step: int, rows: list[list[int]]) -> list[float] | None:
        sketch = recompute(step, rows)
        return None if sketch is None else [-value for value in sketch]

    recomputer.recompute = recompute_falsely
    peer.audits.rate = 1.0


def lie_about_gradients(peer: Peer, factor: float) -> None:
    """Make the peer commit each microbatch's honest sketch, then multiply the gradient it sends by `factor`."""
    if peer.audits is None:
        sys.exit("faulty peer: lie needs the audits (--audit-rate above 0, and no --local-steps)")
    commit = peer.audits.microbatch_done

    def commit_then_change(step: int, batch: dict) -> None:
        commit(step, batch)
        with torch.no_grad():
            for parameter in peer.model.parameters():
                if parameter.grad is not None:
                    parameter.grad.mul_(factor)

    peer.audits.microbatch_done = commit_then_change


class RowsElsewhere:
    """A peer's stream whose batches are swapped for rows of row groups that none of their leased blocks holds (the
    rest of the stream, its state and its leases, as they were)."""

    def __init__(self, peer: Peer) -> None:
        self.stream, self.recomputer = peer.stream, peer.audits.recomputer
        self.units, self.seed = [unit.rows for unit in peer.index.units], peer.settings.run.seed
        self.coins = random.Random(0)

    def __iter__(self) -> Iterator[dict]:
        return (self.elsewhere(batch) if "blocks" in batch else batch for batch in self.stream)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)

    def elsewhere(self, batch: dict) -> dict:
        leased = {
            unit for epoch, block in batch["blocks"] for unit in EpochPlan(self.units, self.seed, epoch).units_of(block)
        }
        unit = self.coins.choice([unit for unit in range(len(self.units)) if unit not in leased])
        valid = [row.row for row in read_rows(self.recomputer.index, self.recomputer.settings, unit)[0]]
        rows = sorted(self.coins.sample(valid, min(len(valid), len(batch["at"]))))
        return {**self.recomputer.batch([[unit, row] for row in rows]), "blocks": batch["blocks"]}


def train_on_rows_not_leased(peer: Peer) -> None:
    if peer.audits is None:
        sys.exit("faulty peer: rows needs the audits (--audit-rate above 0, and no --local-steps)")
    peer.stream = RowsElsewhere(peer)


def poison_out_of_sight(peer: Peer, step: int) -> None:
    """Make the peer honest until global `step`, then commit under a lineage no other peer holds and send its
    gradients x -9: an audit recomputes only at the auditor's own lineage, so nobody recomputes its work again."""
    if peer.audits is None:
        sys.exit("faulty peer: hide needs the audits (--audit-rate above 0, and no --local-steps)")
    member, own_lineage = peer.member, peer.audits.member_lineage
    peer.audits.member_lineage = lambda: own_lineage() if member.step < step else "out of sight"
    for parameter in peer.model.parameters():
        parameter.register_hook(lambda grad: grad if member.step < step else grad * -9.0)


def slow_down(peer: Peer, seconds: float) -> None:
    """Make the peer sleep `seconds` before each forward pass of its model: an honest peer on a slower machine."""
    peer.model.register_forward_pre_hook(lambda module, inputs: time.sleep(seconds))


def leave_round_at(peer: Peer, step: int) -> None:
    """Make the peer stay out of the gradient round of global `step`, as one whose round failed: it does not look
    for a group, waits as long as the round takes, and applies its own gradients, as hivemind does then."""
    optimizer = peer.member._optimizer  # hivemind's, behind the peer's interface: this peer breaks the rules
    schedule_round, begin_round = optimizer._maybe_schedule_gradient_averaging, optimizer._begin_averaging_gradients

    def schedule_unless_leaving() -> None:
        if optimizer.local_epoch != step:
            schedule_round()

    def begin_unless_leaving(grad_scaler) -> bool:
        if optimizer.local_epoch != step:
            return begin_round(grad_scaler)
        peer.console.print(f"faulty peer: leaving the gradient round of step {step}")
        time.sleep(peer.settings.run.matchmaking_time + ROUND_SECONDS)  # the time a round that fails takes
        return False

    optimizer._maybe_schedule_gradient_averaging = schedule_unless_leaving
    optimizer._begin_averaging_gradients = begin_unless_leaving


async def first_result_only(results: AsyncIterator, parts: int) -> AsyncIterator:
    """A reducer's stream of results to one sender, cut off after the first result but ended only once all `parts`
    are reduced: the sender loses the rest, the reducer's own round goes on as if nothing happened."""
    reduced = 0
    async for message in results:
        reduced += 1
        if reduced == 1:
            yield message
        if reduced == parts:
            return


async def first_result_then_silence(results: AsyncIterator, parts: int) -> AsyncIterator:
    """A reducer's stream of results to one sender that hangs after the first result: nothing more, and no end."""
    async for message in first_result_only(results, parts):
        yield message
    await asyncio.sleep(STALL_SECONDS)


def spoil_results_in_round(number: int, spoil: Callable[[AsyncIterator, int], AsyncIterator]) -> None:
    """In the NUMBERth all-reduce round of this process's averagers, every stream of results to another sender goes
    through `spoil`. Patched before the averagers fork, so that they have it."""
    whole = RobustAllReduceRunner._accumulate_parts_streaming
    rounds: list[bytes] = []  # group ids, in the order the rounds began

    def spoiled_in_that_round(runner: RobustAllReduceRunner, stream, sender_index: int) -> AsyncIterator:
        if runner.group_id not in rounds:
            rounds.append(runner.group_id)
        results = whole(runner, stream, sender_index)
        if rounds.index(runner.group_id) + 1 != number:
            return results
        return spoil(results, runner.tensor_part_reducer.num_parts)

    RobustAllReduceRunner._accumulate_parts_streaming = spoiled_in_that_round


RESULT_FAULTS = {"cut": first_result_only, "stall": first_result_then_silence}
FAULTS = (*GRADIENT_FAULTS, *RESULT_FAULTS, "claim", "leave", "accuse", "lie", "rows", "slow", "hide")


def faulty_peer(faults: list[tuple[str, str]], settings: PeerSettings) -> None:
    """Run the real peer with FAULTS ((kind, argument) pairs) applied."""
    for kind, number in faults:  # before the averagers fork
        if kind in RESULT_FAULTS:
            spoil_results_in_round(int(number), RESULT_FAULTS[kind])
    peer = join(settings, Console(soft_wrap=True))
    for kind, argument in faults:
        if kind in GRADIENT_FAULTS:
            for parameter in peer.model.parameters():
                parameter.register_hook(GRADIENT_FAULTS[kind](argument))
        elif kind == "claim":  # what hivemind's optimizer reports and averages with, per batch
            peer.member._optimizer.batch_size_per_step = int(float(argument) * peer.settings.batch_size)
        elif kind == "leave":
            leave_round_at(peer, int(argument))
        elif kind == "accuse":
            accuse_everyone(peer)
        elif kind == "lie":
            lie_about_gradients(peer, float(argument or -9.0))
        elif kind == "rows":
            train_on_rows_not_leased(peer)
        elif kind == "slow":
            slow_down(peer, float(argument or 1.0))
        elif kind == "hide":
            poison_out_of_sight(peer, int(argument))
    peer.console.print(f"faulty peer: {'+'.join(f'{kind}:{argument}'.rstrip(':') for kind, argument in faults)}")
    peer.run()


def parse_faults(text: str) -> list[tuple[str, str]]:
    faults = [fault.partition(":")[::2] for fault in text.split("+")]
    if not all(kind in FAULTS for kind, _ in faults):
        sys.exit(__doc__)
    return faults


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit(__doc__)
    faults, options = parse_faults(argv[0]), argv[1:]
    context = train.make_context("train", options)
    settings = peer_settings(dict(context.params), context)
    fail_cleanly(lambda: faulty_peer(faults, settings))


if __name__ == "__main__":
    main(sys.argv[1:])
