"""hivemind.Optimizer, made to say what happened in each global step and to let newcomers in.

What happened. hivemind averages a step's gradients in an all-reduce round among the peers that found each
other in matchmaking; a peer that missed the round applies its own gradients alone, and a peer that fell
behind downloads the swarm's state instead of training. Neither shows from outside. `SwarmOptimizer`
records, for every global step, how many peers its gradient round averaged (1: this peer alone), and how
long each state download took, so that the progress line and the published metrics show who trains together.

Letting newcomers in: the swarm holds a step for a joining peer (the protocol: training/swarm/joins.py); the
progress tracker here never ends a step before the latest hold.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from functools import partial
from typing import AsyncIterator  # noqa: UP035 (hivemind's servicer recognises only typing's alias)

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import P2P, P2PContext, PeerID, StubBase
from hivemind.proto import averaging_pb2
from hivemind.utils import ValueWithExpiration, get_dht_time, get_logger

from training.swarm.admission import AdmittedOnly, CallerCheck
from training.swarm.aggregation import MEAN, Aggregation, bounded_claims
from training.swarm.allreduce import LINGER, Probation, RobustAveraging, RoundResult
from training.swarm.received import Projection

LINEAGE_STEPS = 4  # global steps back that a peer compares its lineage with the others' (records arrive late)

logger = get_logger(__name__)

LONELY_REFRESH = 1.0  # seconds between two looks at the swarm's progress while a peer sees no other peer's
STATE_ROUND_LOOK = 3  # matchmaking times a state round looks for its group before it gives up
LOST_RESULT_GRACE = 5.0  # seconds a finished round's result may take to reach this process (`result_lost`)
GROUP_LOOK = 0.1  # seconds between two looks at whether a round still looking for its group has anyone to meet


def never() -> bool:
    return False


def finished_group(control: StepControl | None) -> RoundResult | None:
    """A finished round's group as the averager returned it (`RoundResult`); None when there was no round, or it
    failed (hivemind then applied this peer's own gradients)."""
    if control is None or not control.done() or control.cancelled():
        return None
    try:
        return control.result(timeout=0)
    except BaseException:
        return None


def round_members(group: RoundResult | None, own_peer_id: str) -> list[str]:
    """The sorted peer ids of a finished round's group; this peer alone when there was none or it failed."""
    return [own_peer_id] if group is None else sorted(peer_id.to_base58() for peer_id in group)


def round_ahead(group: RoundResult | None, own_peer_id: str) -> tuple[int, int] | None:
    """(this peer's global step, the others') when the other members of its gradient round gathered a later step than
    it did (`SwarmGradientAverager.schedule_step`); None with no round, or in a round of its own step.

    hivemind lets a peer one step behind the swarm step on, and its next round is then the others' round of the step
    after: it applies their gradients of a step ahead to its parameters of a step before, and leaves their lineage
    (seen on the NAT testbed: a newcomer whose first batch ended after the others' round said `round 3` where they
    said `round 2`, then repaired by a download at its next step)."""
    if group is None:
        return None
    steps = {peer_id.to_base58(): step for peer_id, step in group.items() if isinstance(step, int)}
    own = steps.pop(own_peer_id, None)
    if own is None or not steps:
        return None
    others = Counter(steps.values()).most_common(1)[0][0]
    return (own, others) if others > own else None


def result_lost(control: StepControl) -> bool:
    """Whether the averager finished this round (its stage says so) while its result has not reached this process
    LOST_RESULT_GRACE seconds later. Seen on the NAT testbed beside a busy core: the round of a home that had joined
    its group while it downloaded the state was FINISHED, and hivemind's wait for its result ran out its whole
    averaging timeout (60 s), then again tagging along with it before the next download (not traced further)."""
    if control.stage != AveragingStage.FINISHED or control.done():
        return False
    try:
        control.result(LOST_RESULT_GRACE)
    except FutureTimeout:
        return True
    except BaseException:  # it failed: hivemind handles that
        return False
    return False


def nobody_left(control: StepControl, nobody_to_meet: Callable[[], bool], timeout: float) -> bool:
    """Wait while the round looks for its group (at most `timeout` seconds); whether to give it up because
    `nobody_to_meet()` says so meanwhile. A volunteer who gave a smaller --max-steps left a run of two, and the last
    peer looked for a group until --averaging-timeout (60 s) before it took its step alone; the peer a step behind
    the others' last one did the same (clean-clone run 159)."""
    deadline = time.monotonic() + timeout
    while not control.done() and control.stage == AveragingStage.LOOKING_FOR_GROUP:
        if nobody_to_meet():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(GROUP_LOOK)
    return False


def fingerprint(tensors: Iterable[torch.Tensor]) -> str:
    """A short hash of the tensors' bits: equal for peers that hold the same values."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


def lineage_after(lineage: str, members: Sequence[str]) -> str:
    """The lineage of parameters after one more round with `members` (see `FailFastStateAverager`)."""
    return hashlib.sha256(f"{lineage}|{','.join(members)}".encode()).hexdigest()[:16]


def lineage_after_round(lineage: str, group: RoundResult | None, own_peer_id: str) -> str:
    """The lineage of parameters after a gradient or state round (`group`, its result as `finished_group` read it),
    chained onto this peer's own: with the round's id and members, which every member that got the whole result
    shares and no other round gives; with this peer alone when there was no round, it failed, or its result came
    here in part (its own values kept there). A state round averages the parameters, not the optimizer's
    statistics, so members whose lineages differed before it step apart after it: each chains onto its own."""
    if group is None or group.apart:
        return lineage_after(lineage, [own_peer_id])
    return lineage_after(lineage, [group.group_id.hex(), *round_members(group, own_peer_id)])


def left_behind(own: Mapping[int, str], others: Iterable[Mapping[int, str]]) -> tuple[int, int] | None:
    """The latest global step at which more peers held another lineage than this one's, by more than one (a tie, or
    a majority of one, moves nobody: there is no majority to join), and how many held it; None when there was none.
    `own`: the lineage this peer held at each of its recent steps; `others`: each other peer's, as its record says
    (`PeerMetrics.lineages_held`).

    Each peer counts at every recent step it names, not only at the one it is at now: in a crowd, the peers of a
    step's larger group had moved on to the next step when those of a smaller one compared, and only the smaller
    group's records named that step. Four peers of a group of six then downloaded the state of a group of three
    (bench.scale, 8 trainers)."""
    counts: dict[int, Counter[str]] = {}
    for held in others:
        for step, lineage in held.items():
            if lineage and step in own:
                counts.setdefault(step, Counter())[lineage] += 1
    for step, lineages in sorted(counts.items(), reverse=True):
        majority, holders = lineages.most_common(1)[0]
        if majority != own[step] and holders > lineages[own[step]] + 1:
            return step, holders
    return None


def recent_lineages(lineages: dict[int, str], step: int, lineage: str, restart: bool = False) -> dict[int, str]:
    """A peer's lineages of its last LINEAGE_STEPS global steps (`left_behind` compares them), `lineage` now held at
    `step`: a new dict, so that another thread reading the old one never sees it change. `restart`: a state was
    downloaded since, and what this peer held before says nothing of what it holds now. Kept, a step it had been
    apart at before a catch-up download sent it to download again at once (clean-clone run 213: a joiner in the
    others' round of a later step downloaded at its next step, then again for the step before that download)."""
    kept = {held_at: held for held_at, held in lineages.items() if held_at > step - LINEAGE_STEPS and not restart}
    return kept | {step: lineage}


@dataclass
class SwarmBuffers:
    """The tensors a peer's hivemind optimizer adds to the model's parameters and gradients (`ttt calc` measures
    them): gradient accumulators, host copies (averaged gradients and state, offloaded parameters and their
    gradients) and the optimizer that keeps the run's optimizer state."""

    accumulators: list[torch.Tensor]
    host_copies: list[torch.Tensor]
    optimizer: torch.optim.Optimizer


@dataclass(frozen=True)
class Download:
    """One state download: its seconds, and whether a state arrived (no peer may have served one)."""

    seconds: float
    arrived: bool


class SwarmProgressTracker(ProgressTracker):
    """hivemind's progress tracker, which in addition does not end a global step before `hold_until`, which counts
    each peer's claimed samples and speed at most as `bounded_claims` allows (one peer that claims a thousand times
    its samples no longer ends every global step alone), and which, while it sees no other peer, looks again every
    `LONELY_REFRESH` seconds.

    Looking again. Peers report their progress only once they have samples, so peers that start together see only
    themselves at first; hivemind then looks again after a quarter of its own ETA (8 s measured, in a run whose
    global step took 6 s). Every peer of a run that had waited for its four peers took its first global step alone,
    the swarm started split four ways, and no peer could tell which parameters the others held."""

    def __init__(self, *args, **kwargs) -> None:
        self.hold_until = 0.0  # DHT time
        super().__init__(*args, **kwargs)

    @property
    def ready_to_update_epoch(self) -> bool:
        if self.global_epoch > self.local_progress.epoch:
            return True  # the others have ended the step already: follow them
        return get_dht_time() >= self.hold_until and super().ready_to_update_epoch

    @property
    def estimated_next_update_time(self) -> float:
        return max(super().estimated_next_update_time, self.hold_until)

    def _parse_swarm_progress_data(self, metadata):
        progress = super()._parse_swarm_progress_data(bounded_progress(metadata))
        if progress.num_peers <= 1:
            progress.next_fetch_time = min(progress.next_fetch_time, get_dht_time() + LONELY_REFRESH)
        return progress


def bounded_progress(metadata: dict | None) -> dict | None:
    """The swarm's progress records (subkey -> ValueWithExpiration of a LocalTrainingProgress dict), with each peer's
    samples per second bounded among all peers', and its samples accumulated among those of the peers at the latest
    epoch (hivemind counts only those toward the step). Records it cannot read are left for hivemind to judge."""
    if not isinstance(metadata, dict):
        return metadata
    entries = {key: item for key, item in metadata.items() if isinstance(getattr(item, "value", None), dict)}
    try:
        latest = max(int(item.value["epoch"]) for item in entries.values())
        current = [key for key, item in entries.items() if item.value["epoch"] == latest]
        claimed_rates = [item.value["samples_per_second"] for item in entries.values()]
        rates = dict(zip(entries, bounded_claims(claimed_rates), strict=True))
        samples = bounded_claims([entries[key].value["samples_accumulated"] for key in current])
    except (KeyError, TypeError, ValueError):  # malformed: hivemind's own parsing refuses it
        return metadata
    accumulated = dict(zip(current, samples, strict=True))
    bounded = dict(metadata)
    for key, item in entries.items():
        value = {**item.value, "samples_per_second": rates[key]}
        if key in accumulated:
            value["samples_accumulated"] = int(accumulated[key])
        bounded[key] = ValueWithExpiration(value, item.expiration_time)
    return bounded


class SwarmGradientAverager(AdmittedOnly, RobustAveraging, GradientAverager):
    """hivemind's gradient averager, reducing with the run's aggregation and answering only admitted peers in an
    authenticated run, which neither serves nor downloads its buffers as a state.

    hivemind's optimizer downloads the gradient averager's state after the training state, and then resets it:
    the last round's averaged gradients, as large as the parameters, for nothing. It was 2.4 s of each 6.3 s
    catch-up download of the tiny preset at 20 Mbit/s (the NAT testbed), sent by a public peer's uplink.

    Every member of a round gets the same bits (`same_result`, training/swarm/allreduce.py): with hivemind's
    differences, each member's averaged gradient differed by the compression noise, which each one's optimizer carried
    into its parameters step after step. Peers of one lineage then held parameters far enough apart that an honest
    peer's gradient, recomputed by its auditors, failed (training/audit/: three auditors convicted an honest peer at
    step 32 of four peers)."""

    same_result = True
    all_or_nothing = False
    step_now: Callable[[], int] | None = None  # the optimizer's global step (`SwarmOptimizer` sets it)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, allow_state_sharing=False, **kwargs)

    def schedule_step(self, scheduled_time: float | None = None, **kwargs) -> StepControl:
        """hivemind's, gathering this peer's global step with its group: a reducer then knows which step's
        commitments the senders' gradients must match (`RobustAveraging.keep_received`)."""
        if self.step_now is not None:
            kwargs.setdefault("gather", self.step_now())
        return super().schedule_step(scheduled_time, **kwargs)

    def load_state_from_peers(self, **kwargs) -> None:
        return None


class StateExchange(DecentralizedAverager):
    """The state averager's link to hivemind's DecentralizedAverager (it sits between the two in
    `FailFastStateAverager`'s bases), where every state round is created and every downloaded state passes: it
    remembers the latest round, refuses a downloaded state that is short of the tensors its metadata lists
    (`announced_tensors`) or not finite (a broken or hostile peer's), and adopts the lineage of the state it loads.
    A state download ends when the downloader holds the whole state and hangs up (`rpc_download_state`)."""

    lineage = ""
    last_round: StepControl | None = None
    downloaded: tuple[dict, list[torch.Tensor]] | None = None  # the last state loaded: (metadata, tensors)

    def announced_tensors(self, metadata: dict) -> int | None:
        """How many tensors a downloaded state with this metadata holds; None: not known at this level."""
        return None

    def step(self, *args, **kwargs):
        control = super().step(*args, **kwargs)
        if isinstance(control, StepControl):
            self.last_round = control
        return control

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's state download, ended by an empty message; the stream then stays open until the downloader
        hangs up, as it does on that message (`whole_state`), or for `LINGER` seconds. Closed at once, as hivemind
        closes it when this handler returns, the stream can be reset, and a reset loses the state's tail (see
        `RobustAllReduceRunner.rpc_aggregate_part`)."""
        sent = False
        async for message in super().rpc_download_state(request, context):
            sent = True
            yield message
        if sent:
            yield averaging_pb2.DownloadData()
            await asyncio.sleep(LINGER)  # hivemind cancels this when the downloader hangs up

    @classmethod
    def get_stub(cls, p2p: P2P, peer: PeerID, *, namespace: str | None = None) -> StubBase:
        """hivemind's stub to another averager, whose state download hangs up at the state's end (`whole_state`)."""
        stub = super().get_stub(p2p, peer, namespace=namespace)
        download = stub.rpc_download_state

        async def rpc_download_state(request: averaging_pb2.DownloadRequest, timeout: float | None = None):
            return whole_state(await download(request, timeout=timeout))

        stub.rpc_download_state = rpc_download_state
        return stub

    def load_state_from_peers(self, **kwargs):
        loaded = super().load_state_from_peers(**kwargs)
        if loaded is None:
            return None
        metadata, tensors = loaded
        announced = self.announced_tensors(metadata)
        if announced is not None and len(tensors) != announced:
            logger.warning(f"refused a downloaded state of {len(tensors)} tensors where its metadata lists {announced}")
            return None
        if not all(torch.isfinite(tensor).all() for tensor in tensors):
            logger.warning("refused a downloaded state with non-finite values")
            return None
        if isinstance(metadata.get("lineage"), str) and metadata.get("epoch", -1) >= self.local_epoch:
            self.lineage = metadata["lineage"]
        self.downloaded = loaded
        return loaded


async def whole_state(stream: AsyncIterator[averaging_pb2.DownloadData]) -> AsyncIterator[averaging_pb2.DownloadData]:
    """A state download's messages up to the empty one that ends the state (`StateExchange.rpc_download_state`),
    on which it hangs up (the server keeps the stream open until then). A stream that ends without it ends the
    download as in hivemind: a state cut short is refused by its count (`StateExchange.load_state_from_peers`)."""
    try:
        async for message in stream:
            if message.ByteSize() == 0:
                return
            yield message
    finally:
        await stream.aclose()  # hanging up


class InlineExecutor(Executor):
    """Runs each submitted call at once, in the calling thread."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as err:
            future.set_exception(err)
        return future


class FailFastStateAverager(AdmittedOnly, RobustAveraging, TrainingStateAverager, StateExchange):
    """hivemind's state averager (reducing with the run's aggregation, answering only admitted peers in an
    authenticated run), whose rounds give up after one matchmaking that finds no group, which keeps the
    parameters' lineage, and which steps the optimizer in the training thread.

    The training thread. hivemind runs each optimizer step and state round in a thread of its own, even when the
    training loop waits for it, as the peer's always does (`make_optimizer`: no delayed steps). torch's CPU
    operations in a second thread start a second OpenMP team, and once libgomp manages more threads than there
    are cores it stops spinning between parallel regions: every forward and backward after the first step ran
    about 20% slower on 2 cores (bench/train.py). Run inline, the optimizer shares the training thread's team.

    Giving up. hivemind looks for a state round's group until `averaging_timeout` (60 s), retrying, and a lone peer
    waits as a leader for followers all that time; the peer does not train meanwhile (seen: a newcomer whose state
    round began just after the others' group had formed sat 78 s in it, and the others went on without it). A state
    round only corrects drift (gradient rounds keep peers in step), so here it looks for its group once, for at most
    `STATE_ROUND_LOOK` matchmaking times, and a peer that found none goes on training.

    Lineage. Every member of a gradient round gets the same bits (`SwarmGradientAverager`), but a hash of the
    parameters cannot tell which of two peers apart is behind. The lineage names the rounds the parameters went
    through: each gradient round chains its group's id and sorted peer ids (this peer alone when the round failed), a
    state round too (it leaves members of one lineage with the same parameters up to its compression noise, their
    bits differing from then on: measured in docs/training.md#checked-work), and a downloaded state brings the
    lineage of the peer that served it (`lineage_after_round`). Peers of equal lineage hold the same parameters,
    to that noise, and the same optimizer statistics. A state round does not average those: it once restarted the
    lineage from its group, and a member that had been apart before it stepped apart after it under the others'
    lineage (the audits' recomputations of its microbatches fell from 0.005-0.011 to 0.12-0.19 of a sketch's length
    in the steps after)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.step_executor.shutdown()  # never used: its thread would start with the first step
        self.step_executor = InlineExecutor()

    def step(self, *args, averaging_round: bool = False, averaging_opts: dict | None = None, **kwargs):
        if averaging_round:
            averaging_opts = {**(averaging_opts or {}), **self.one_short_look}
        return super().step(*args, averaging_round=averaging_round, averaging_opts=averaging_opts, **kwargs)

    def schedule_step(self, *args, **kwargs) -> StepControl:
        return super().schedule_step(*args, **{**kwargs, **self.one_short_look})

    @property
    def one_short_look(self) -> dict:
        """A state round's matchmaking options: one look for a group, of at most `STATE_ROUND_LOOK` matchmakings."""
        return {"allow_retries": False, "timeout": STATE_ROUND_LOOK * self.matchmaking_kwargs["min_matchmaking_time"]}

    def get_current_state(self):
        metadata, tensors, infos = super().get_current_state()
        return {**metadata, "lineage": self.lineage}, tensors, infos

    def announced_tensors(self, metadata: dict) -> int:
        """The tensors of a state hivemind's `get_current_state` sends: the optimizer's parameters, the extra
        tensors, then the optimizer statistics its metadata lists. A download cut short (the server's stream reset
        as it closed, see `RobustAllReduceRunner.rpc_aggregate_part`) holds fewer; hivemind's own load let one
        short of parameters through with the lineage already adopted (`StateExchange`), and retried one short of
        statistics by an IndexError."""
        parameters = sum(len(group["params"]) for group in self.optimizer.param_groups)
        return parameters + len(self.extra_tensors) + tensor_entries(metadata.get("optimizer_metadata"))


def tensor_entries(flat_metadata: object) -> int:
    """How many tensors an optimizer state's metadata (hivemind's `dump_optimizer_state`) lists; 0 for garbage."""
    entries = flat_metadata if isinstance(flat_metadata, list) else []
    return sum(isinstance(entry, dict) and entry.get("type") == "tensor" for entry in entries)


class SwarmOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer with a `SwarmProgressTracker`, recording each step's round size, each download and the
    parameters' lineage; its averagers reduce with `aggregation` and, with `admitted`, answer only the run's
    admitted peers."""

    state_averager_class: type[FailFastStateAverager] = FailFastStateAverager
    progress_tracker_class: type[SwarmProgressTracker] = SwarmProgressTracker

    def __init__(
        self,
        *args,
        aggregation: Aggregation = MEAN,
        admitted: CallerCheck | None = None,
        projection: Projection | None = None,
        probation: Probation | None = None,
        **kwargs,
    ) -> None:
        self.last_round_size = 1  # peers whose gradients the last global step averaged, this one included
        self.last_round_in_part = False  # whether some of that round's results were lost here (own values kept)
        self.last_round_ahead: tuple[int, int] | None = None  # (own step, others') of a round of a later step
        self.rounds_together = 0  # global steps whose round averaged with at least one other peer
        self.downloads: list[Download] = []  # every state download this peer tried, in order
        self.aggregation, self.admitted = aggregation, admitted
        self.gradient_round: RoundResult | None = None  # this step's gradient round, as its optimizer step used it
        self.state_round_seen: StepControl | None = None  # the last state round whose group the lineage took in
        self.nobody_to_meet: Callable[[], bool] = never  # the peer's say (SwarmMember.give_up_looking_when)
        if not kwargs.get("use_local_updates"):
            # hivemind 1.1.12 gives `averager_opts` to its state averager alone (its docstring says both averagers):
            # the gradient averager's declared bandwidth, its share of the rounds it reduces, is passed here.
            kwargs["grad_averager_factory"] = partial(
                SwarmGradientAverager, aggregation=aggregation, admitted=admitted, projection=projection,
                probation=probation, bandwidth=(kwargs.get("averager_opts") or {}).get("bandwidth"),
            )  # fmt: skip
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            self.stop_started_parts()
            raise
        if isinstance(self.grad_averager, SwarmGradientAverager):
            self.grad_averager.step_now = lambda: self.local_epoch
        self.serve_state_once_stepped()

    def stop_started_parts(self) -> None:
        """hivemind's constructor failed: stop the parts it had started (its progress tracker first, then the
        averagers), whose threads would otherwise keep the process from exiting once the DHT is gone."""
        for part in ("tracker", "state_averager", "grad_averager"):
            if getattr(self, part, None) is not None:
                getattr(self, part).shutdown()

    def serve_state_once_stepped(self) -> None:
        """A full peer serves its state from its first global (DiLoCo: outer) step on. At step 0 every peer of a run
        holds the parameters of the run's seed, which a newcomer has already: serving them cost each home 138 s at
        20 Mbit/s with the small preset, for nothing (221 s in DiLoCo, whose state holds the inner optimizer's too;
        a newcomer during outer step 0 starts its inner optimizer afresh, as the run's first peers did)."""
        if not self.client_mode:
            self.state_averager.allow_state_sharing = self.local_epoch > 0

    @property
    def lineage(self) -> str:
        return self.state_averager.lineage

    @property
    def local_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers whose steps change this peer's parameters: the run's optimizer (hivemind's)."""
        return [self.state_averager.optimizer]

    @property
    def own_peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    def _make_progress_tracker(self, target_batch_size: int, **kwargs) -> SwarmProgressTracker:
        return self.progress_tracker_class(
            dht=self.dht,
            prefix=self.run_id,
            target_batch_size=target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            start=True,
            **kwargs,
        )

    def _make_state_averager(self, **kwargs) -> FailFastStateAverager:
        return self.state_averager_class(
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            aggregation=self.aggregation,
            admitted=self.admitted,
            **kwargs,
        )

    def _update_global_epoch(self, grad_scaler) -> None:
        self.gradient_round = None  # none began: this peer applied its own gradients
        super()._update_global_epoch(grad_scaler)
        self.last_round_size = len(round_members(self.gradient_round, self.own_peer_id))
        self.last_round_in_part = self.gradient_round is not None and self.gradient_round.apart
        self.last_round_ahead = round_ahead(self.gradient_round, self.own_peer_id)
        if self.last_round_size > 1:
            self.rounds_together += 1
        self.state_averager.lineage = lineage_after_round(self.lineage, self.gradient_round, self.own_peer_id)
        self.serve_state_once_stepped()
        state_round = self.state_averager.last_round
        if state_round is not None and state_round is not self.state_round_seen and state_round.done():
            self.state_round_seen = state_round
            group = finished_group(state_round)
            if len(round_members(group, self.own_peer_id)) > 1:  # a round alone changed nothing
                self.state_averager.lineage = lineage_after_round(self.lineage, group, self.own_peer_id)

    def _maybe_schedule_gradient_averaging(self) -> None:
        """Matchmaking ahead of the step's end, only when there is someone to meet: alone, hivemind would still
        schedule a round, whose matchmaking asks the DHT for leaders as fast as it answers (about one core,
        taken from training, measured) until the step cancels it. The step itself averages only with others."""
        if self.tracker.global_progress.num_peers > 1:
            super()._maybe_schedule_gradient_averaging()

    def _maybe_schedule_state_averaging(self) -> None:
        """The same for state rounds."""
        if self.tracker.global_progress.num_peers > 1:
            super()._maybe_schedule_state_averaging()

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control: StepControl | None) -> None:
        if maybe_step_control is not None and (
            nobody_left(maybe_step_control, self.nobody_to_meet, self.averaging_timeout)
            or result_lost(maybe_step_control)
        ):
            maybe_step_control.cancel()
            maybe_step_control = None  # hivemind applies this peer's own gradients, as after a failed round
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)
        self.gradient_round = finished_group(maybe_step_control)  # read now: a round done later was not used

    def _tag_along_with_zero_weight(self, control: StepControl) -> None:
        """hivemind's tag-along (a round scheduled before a download, or before a step that did not begin its own:
        this peer joins it with weight 0 and waits for it), only with a round whose group has formed, where the
        others count on this member's parts. A round still looking for its group is cancelled, as hivemind's own
        `shutdown` does: nobody counts on it yet; nor a round whose result was lost (`result_lost`). A late home (a
        client, test_wan in CI runs 54 and 56) waited in the step after a download, then tagged along with a round
        before the next download, the whole averaging timeout each time (60 s), while the others averaged without
        it; by then they had finished the run, and it finished alone."""
        if control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP) or result_lost(control):
            control.cancel()
        else:
            super()._tag_along_with_zero_weight(control)

    def load_state_from_peers(self, then_train: bool = True, **kwargs) -> None:
        """Download the swarm's state; `downloads` says how long it took and whether a state arrived (when no peer
        serves one, hivemind still moves a peer one step behind to the swarm's step, with its own parameters).
        `then_train`: this peer trains on after the download (not at the run's end): it joins the group of the
        swarm's next round while it downloads (`join_next_group`)."""
        next_group = self.join_next_group() if then_train else None
        started, epoch, self.state_averager.downloaded = time.perf_counter(), self.local_epoch, None
        super().load_state_from_peers(**kwargs)  # tags along (weight 0) with a round scheduled before, as hivemind does
        if next_group is not None:
            self.scheduled_grads = next_group
        loaded = self.state_averager.downloaded  # hivemind refuses a state older than this peer's
        arrived = loaded is not None and loaded[0].get("epoch", -1) >= epoch
        self.downloads.append(Download(time.perf_counter() - started, arrived))
        self.serve_state_once_stepped()

    def join_next_group(self) -> StepControl | None:
        """Start looking for the group of the swarm's next gradient round, to be in it with the downloaded state.

        A round's group forms early in its step: hivemind pre-schedules it once the step's estimated end is within
        `matchmaking_time` (5 s), which in steps of about 8 s (the NAT testbed) is right after the last round, and
        the leader gathers followers for that time, then waits with them for the samples. A peer that downloaded the
        state first (3.7 s for the tiny preset at 20 Mbit/s) and computed a batch asked after the group had formed,
        joined the next one a step behind, and after that round was out of sync again: on the NAT testbed a late
        home downloaded at every other step to the run's end, and in CI the early home did too, after one missed
        round. Looking before the download puts the peer in the group of the step it downloads.

        Only when its last download took at most `matchmaking_time + next_chunk_timeout` (10 s): its first batch is
        then ready about when the round begins, or a little later, and the others' round waits for a member's parts
        up to hivemind's `sender_timeout` (`next_chunk_timeout`), then goes on without them. A longer download would
        cost the swarm that wait in every round it joined that way; a newcomer's first download does as before.
        And only when the swarm's step is to end before the download and a matchmaking would: otherwise hivemind
        schedules the round after the download as usual (a client that looks for a leader before one has opened its
        matchmaking asks the DHT again and again, without pause).

        The round gathers the swarm's step, which the download brings, not the step this peer is at before it: the
        round sends the microbatches computed after the download, and its reducers check them against this peer's
        commitments around the step it gathered (training/audit/received.py's `judged_step`). Gathered before a
        download from step 9 to 15, the round of step 15's microbatch was judged against those of steps 8 to 10, and
        its reducers convicted the honest sender (bench.scale at 8 peers: 10 honest trainers of 40 in four runs)."""
        if self.grad_averager is None or self.tracker.global_progress.num_peers <= 1 or not self.downloads:
            return None  # DiLoCo has no gradient rounds; alone, nobody to meet; a newcomer's first download
        download = self.downloads[-1].seconds
        if download > self.matchmaking_time + self.next_chunk_timeout:
            return None
        if self.tracker.estimated_next_update_time - get_dht_time() > download + self.matchmaking_time:
            return None
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            return None  # hivemind tags along with it before the download
        swarm_step = max(self.local_epoch, self.tracker.global_epoch)
        return self.grad_averager.schedule_step(timeout=self.averaging_timeout, gather=swarm_step)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.serve_state_once_stepped()

    def outlier_counts(self) -> dict[tuple[str, str], int]:
        """(sender peer id, "dropped" | "clipped") -> pieces this peer's averagers dropped or clipped so far."""
        counts = Counter(self.state_averager.outlier_counts())
        for averager in self.step_averagers:
            counts.update(averager.outlier_counts())
        return dict(counts)

    def tell_standing(self, convicted: Sequence[str] = (), unaudited: Sequence[str] | None = None) -> None:
        """Tell each of this peer's averagers what its audits found (`RobustAveraging.tell_standing`)."""
        for averager in (self.state_averager, *self.step_averagers):
            averager.tell_standing(convicted, unaudited)

    def received_rounds(self) -> list[dict]:
        """What this peer's reducer received in the gradient rounds since the last call (`RobustAveraging.
        received_rounds`; none without a projection)."""
        averager = self.grad_averager
        return averager.received_rounds() if isinstance(averager, RobustAveraging) and averager.projection else []

    def sent_bytes(self) -> dict[str, int]:
        """The bytes this peer's averagers sent to other peers so far, by "allreduce" | "state"."""
        counts = Counter(self.state_averager.sent_bytes())
        for averager in self.step_averagers:
            counts.update(averager.sent_bytes())
        return dict(counts)

    @property
    def step_averagers(self) -> list[RobustAveraging]:
        """The averagers of each global step's rounds, besides the state averager: the gradient averager."""
        return [self.grad_averager]

    def memory_buffers(self) -> SwarmBuffers:
        """The gradient accumulators, the host copies and the run's optimizer, as they are now."""
        offloaded = [p for group in self.state_averager.optimizer.param_groups for p in group["params"]]
        with self.grad_averager.get_tensors() as averaged_gradients:
            host = list(averaged_gradients)
        with self.state_averager.get_tensors() as averaged_state:
            host += [*offloaded, *(p.grad for p in offloaded if p.grad is not None), *averaged_state]
        accumulators = list(self.grad_averager._grad_accumulators())
        return SwarmBuffers(accumulators, host, self.state_averager.optimizer)
