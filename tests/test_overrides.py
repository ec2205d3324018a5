"""Where hivemind forces inheritance, the order of ttt's bases decides what runs first
(docs/design/hivemind-overrides.md): each override that depends on it is shown to depend on it (the wrong order does
the wrong thing) and to hold in every averager class of training/swarm/. And the calls a peer's main process makes
into its averagers' processes by name go through one table whose names resolve; a peer's matchmaking reads the DHT
at its pace."""

import asyncio
import itertools
import time
from typing import AsyncIterator  # noqa: UP035 (hivemind's servicer recognises only typing's alias)

import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import StepControl
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import aiter_with_timeout

from training.swarm import matchmaking
from training.swarm.admission import AdmittedOnly
from training.swarm.allreduce import OWN_PROCESS_CALLS, RobustAveraging
from training.swarm.diloco import DiLoCoStateAverager, PseudoGradientAverager
from training.swarm.optimizer import FailFastStateAverager, StateExchange, SwarmGradientAverager

AVERAGERS = [SwarmGradientAverager, FailFastStateAverager, DiLoCoStateAverager, PseudoGradientAverager]
# (earlier, later, why): in every averager whose bases hold both, `earlier` comes first.
ORDER = [
    (AdmittedOnly, RobustAveraging, "a refused caller's state download is not counted as a state served"),
    (AdmittedOnly, DecentralizedAverager, "`admitted` is set before hivemind forks the averager's process"),
    (RobustAveraging, DecentralizedAverager, "the robust all-reduce and the byte counts replace hivemind's"),
    (TrainingStateAverager, StateExchange, "hivemind's state averager applies only what StateExchange let through"),
    (StateExchange, DecentralizedAverager, "StateExchange sees every downloaded state and every state round"),
]


@pytest.mark.parametrize("averager", AVERAGERS, ids=lambda averager: averager.__name__)
@pytest.mark.parametrize("earlier, later, why", ORDER, ids=[why for *_, why in ORDER])
def test_every_averager_has_the_bases_in_the_order_its_overrides_need(averager, earlier, later, why):
    order = averager.__mro__
    if earlier in order and later in order:
        assert order.index(earlier) < order.index(later), f"{averager.__name__}: {why}"


class Refusing:
    """An authenticated run's check that admits nobody."""

    async def check(self, caller, request: str, dht) -> None:
        raise PermissionError(f"{caller} is not admitted to run 'demo': no token")


class ServesAState(DecentralizedAverager):
    """hivemind's averager, reduced to a state download of one message (nothing else is used here)."""

    async def rpc_download_state(self, request, context):
        yield averaging_pb2.DownloadData(metadata=b"the state")


def bare(averager_class: type) -> DecentralizedAverager:
    """An averager of that class without its process or DHT: only what the methods under test read."""
    averager = averager_class.__new__(averager_class)
    averager._parent_pid = None  # hivemind's __del__ then leaves the (never started) process alone
    return averager


def first_answer_and_bytes_counted(averager_class: type) -> tuple[str, int]:
    """What an unadmitted caller's state download gets first, and the state bytes the averager counted for it."""
    averager = bare(averager_class)
    averager.admitted, averager.dht, averager.sent = Refusing(), None, {"state": 0}
    context = type("Context", (), {"remote_id": "12D3KooWIntruder"})()

    async def first() -> str:
        answers = averager.rpc_download_state(averaging_pb2.DownloadRequest(), context)
        message = await answers.__anext__()
        await answers.aclose()
        return type(message).__name__

    return asyncio.run(first()), averager.sent["state"]


def test_a_refused_state_download_is_not_counted_as_a_state_served_and_the_order_is_why():
    class Counted(AdmittedOnly, RobustAveraging, ServesAState):
        pass

    class CountedFirst(RobustAveraging, AdmittedOnly, ServesAState):
        pass

    assert first_answer_and_bytes_counted(Counted) == ("RPCError", 0)
    answer, counted = first_answer_and_bytes_counted(CountedFirst)
    assert answer == "RPCError" and counted > 0  # the other order counts the refusal as a state served


class DownloadsNaN(DecentralizedAverager):
    """hivemind's averager, reduced to a download that brings a state with a NaN in it."""

    def load_state_from_peers(self, **kwargs):
        return {"epoch": 3}, [torch.tensor([1.0, float("nan")])]


class Applies:
    """Stands for hivemind's state averager: it applies whatever the averagers below it return."""

    applied = None

    def load_state_from_peers(self, **kwargs):
        self.applied = super().load_state_from_peers(**kwargs)
        return self.applied


def test_a_non_finite_state_is_refused_before_it_is_applied_and_the_order_is_why():
    class Refuses(Applies, StateExchange, DownloadsNaN):  # as FailFastStateAverager: the applier above
        pass

    class AppliesFirst(StateExchange, Applies, DownloadsNaN):
        pass

    refused, applied = bare(Refuses), bare(AppliesFirst)
    refused.local_epoch = applied.local_epoch = 0
    refused.load_state_from_peers()
    applied.load_state_from_peers()
    assert refused.applied is None  # refused before hivemind's state averager saw it
    assert applied.applied is not None and not torch.isfinite(applied.applied[1][0]).all()


class DownloadsPart(DecentralizedAverager):
    """hivemind's averager, reduced to a download of a state with two parameters and two optimizer statistics, of
    which only the first `arrived` tensors came (a stream cut short)."""

    arrived = 4

    def load_state_from_peers(self, **kwargs):
        statistics = [{"type": "tensor", "index": 0}, {"type": "value", "value": 0.9}, {"type": "tensor", "index": 1}]
        metadata = {"epoch": 3, "lineage": "the server's", "optimizer_metadata": statistics}
        return metadata, [torch.ones(2)] * self.arrived


@pytest.mark.parametrize("arrived", [4, 3, 1])
def test_a_state_short_of_the_tensors_its_metadata_lists_is_refused_and_the_lineage_stays(arrived):
    """A download cut short (a reset stream) holds fewer tensors than its metadata lists. hivemind's state averager
    let one short of parameters through after `StateExchange` had adopted its lineage (the peer then claimed the
    server's lineage with its own parameters, and audits recompute at a lineage's parameters), and retried one short
    of statistics on an IndexError. It is refused before hivemind sees it, and the lineage stays the peer's own."""

    class Loads(Applies, StateExchange, DownloadsPart):  # as FailFastStateAverager: the applier above
        announced_tensors = FailFastStateAverager.announced_tensors

    averager = bare(Loads)
    averager.arrived, averager.local_epoch, averager.lineage = arrived, 0, "the peer's own"
    averager.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2)) for _ in range(2)], lr=0.1)
    averager.extra_tensors = ()
    averager.load_state_from_peers()
    whole = arrived == 4
    assert (averager.applied is not None) == whole
    assert averager.lineage == ("the server's" if whole else "the peer's own")


class ServesALargeState(DecentralizedAverager):
    """hivemind's averager, reduced to a state download of 64 messages of 64 KB (4 MB: more than the daemons
    buffer), the first with the metadata, as hivemind streams a state's tensors."""

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        for index in range(64):
            part = runtime_pb2.Tensor(buffer=bytes([index]) * 2**16, dtype="float32" if index % 8 == 0 else "")
            yield averaging_pb2.DownloadData(tensor_part=part, metadata=b"the state" if index == 0 else b"")


async def a_download_watched(servicer: type) -> tuple[list[int], list[str], float]:
    """A state download between two real p2p daemons, the server an averager of that class, the downloader
    reading as hivemind's `_load_state_from_peers` does, through the class's stub: the first byte of each tensor
    part it got, how the server's handler ended ("hung up": the downloader closed the stream, which cancels it;
    "returned": the server ended it), and the seconds the download took."""
    loopback = ["/ip4/127.0.0.1/tcp/0"]
    server = await P2P.create(host_maddrs=loopback)
    downloader = await P2P.create(host_maddrs=loopback, initial_peers=await server.get_visible_maddrs())
    ends: list[str] = []
    averager = bare(servicer)

    async def watched(request, context):
        try:
            async for message in averager.rpc_download_state(request, context):
                yield message
        except asyncio.CancelledError:
            ends.append("hung up")
            raise
        ends.append("returned")

    try:
        name = servicer._get_handle_name(None, "rpc_download_state")
        await server.add_protobuf_handler(name, watched, averaging_pb2.DownloadRequest, stream_output=True)
        started = time.monotonic()
        stream = await servicer.get_stub(downloader, server.peer_id).rpc_download_state(averaging_pb2.DownloadRequest())
        parts = [message.tensor_part.buffer[0] async for message in aiter_with_timeout(stream, timeout=20)]
        took = time.monotonic() - started
        await asyncio.sleep(1)  # the handler's end, when the downloader hung up
        return parts, ends, took
    finally:
        for p2p in downloader, server:
            await p2p.shutdown()


def test_a_state_download_ends_by_the_downloader_hanging_up_once_it_holds_the_whole_state(monkeypatch):
    """hivemind's server closed a state download's stream as soon as its handler had handed the last message to the
    p2p daemon, which can reset the stream rather than end it, and a reset drops what the downloader's daemon still
    holds: the state's tail (refused then by its count, above). The server now ends the state with an empty
    message and keeps the stream open; the downloader hangs up on it, well before the server would stop waiting."""
    monkeypatch.setattr("training.swarm.optimizer.LINGER", 30.0)

    class Served(StateExchange, ServesALargeState):
        pass

    parts, ends, took = asyncio.run(a_download_watched(Served))
    assert parts == list(range(64)) and ends == ["hung up"] and took < 15, (ends, took)
    assert asyncio.run(a_download_watched(ServesALargeState))[1] == ["returned"]  # hivemind's own


def test_a_diloco_state_lists_the_inner_optimizers_statistics_after_the_outer_ones():
    averager = bare(DiLoCoStateAverager)
    averager.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    averager.extra_tensors = (torch.zeros(1),)
    tensor = {"type": "tensor", "index": 0}
    metadata = {"optimizer_metadata": [tensor], "inner_optimizer": [tensor, {"type": "value", "value": 1}, tensor]}
    assert averager.announced_tensors(metadata) == 1 + 1 + 1 + 2
    assert averager.announced_tensors({"optimizer_metadata": "garbage"}) == 2  # lists nothing: any tensor too many


def test_every_call_into_an_averagers_process_goes_through_the_table_and_its_names_resolve():
    for method in OWN_PROCESS_CALLS:
        assert getattr(RobustAveraging, method.__name__) is method
    averager = bare(type("Robust", (RobustAveraging, DecentralizedAverager), {}))
    with pytest.raises(ValueError, match="is not one of the calls an averager's process answers"):
        averager.ask_own_process(RobustAveraging.outlier_counts)


class CountingDHT:
    """Answers every read at once, with nothing (nobody leads a group yet), and notes when each read came."""

    peer_id = None

    def __init__(self) -> None:
        self.reads: list[float] = []

    def get(self, key, latest, return_future):
        self.reads.append(time.monotonic())
        answered = asyncio.get_running_loop().create_future()
        answered.set_result(None)
        return answered


async def reads_in(get_averagers, seconds: float) -> tuple[list[float], list[float]]:
    """When two averagers' group keys read their leaders in SECONDS, each asking again at once, as hivemind's
    matchmaking does while nobody leads."""
    dhts = CountingDHT(), CountingDHT()
    managers = [GroupKeyManager(dht, "run_grad_averager", "", None) for dht in dhts]
    end = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < end:
        for manager in managers:
            await get_averagers(manager, manager.current_key, only_active=True)
    return dhts[0].reads, dhts[1].reads


def test_a_peer_looking_for_a_group_reads_its_leaders_at_most_four_times_a_second(monkeypatch):
    # No refusal of convicted leaders, whatever an earlier test of this process joined a swarm with: its first read
    # of the audit records (two DHT reads at once) counted as leader reads (7 in a second, clean-clone runs 43, 47).
    monkeypatch.setattr(matchmaking, "avoided", None)
    assert min(map(len, asyncio.run(reads_in(matchmaking.upstream_get_averagers, 0.2)))) > 100  # as fast as it can
    for reads in asyncio.run(reads_in(matchmaking.paced_get_averagers, 1.0)):  # each averager at its own pace
        gaps = [later - earlier for earlier, later in itertools.pairwise(reads)]
        assert len(reads) >= 3 and min(gaps) >= matchmaking.LEADER_READ - 0.002, gaps
    monkeypatch.setattr(GroupKeyManager, "get_averagers", matchmaking.upstream_get_averagers)
    monkeypatch.setattr(StepControl, "cancel", matchmaking.upstream_cancel)
    matchmaking.override_matchmaking()  # what every peer's optimizer does before it makes its averagers
    assert GroupKeyManager.get_averagers is matchmaking.paced_get_averagers


class CancelTold:
    """An averager's end of a step's cancel: notes whether the step read as cancelled when the averager was told."""

    def __init__(self, step: StepControl) -> None:
        self.step, self.step_cancelled = step, []

    def set_result(self, _) -> None:
        self.step_cancelled.append(self.step.cancelled())

    def cancel(self) -> None:  # the trigger's
        pass

    def done(self) -> bool:  # the trigger's, once cancelled
        return True


def test_a_cancelled_steps_averager_is_told_only_once_the_step_reads_as_cancelled(monkeypatch):
    """An averager told of a cancel reads the step's state at once, and goes on looking for a group until the round's
    timeout unless it reads as cancelled (hivemind's order: told first, marked after)."""
    monkeypatch.setattr(StepControl, "cancel", matchmaking.upstream_cancel)  # hivemind's; the override is undone after
    MPFuture()  # hivemind's futures start their process's backend with a plain one (a StepControl first breaks it)
    for override in (False, True):
        if override:
            matchmaking.override_matchmaking()
        now = get_dht_time()
        step = StepControl(scheduled_time=now, deadline=now + 60, allow_retries=False, weight=1.0, data_for_gather=b"")
        told = CancelTold(step)
        step.attach(told, told)
        assert step.cancel() and step.cancelled()
        assert told.step_cancelled == [override]
