"""The all-reduce plumbing of robust averaging: hivemind's round, reducing with training/swarm/aggregation.py.

In hivemind's all-reduce every peer of a group owns a part of the tensors: each sender sends it its piece of
that part, it reduces them and sends the result back. hivemind reduces with a running weighted sum, so one
peer that sends huge or NaN gradients ruins everyone's model. Here the reducer keeps the pieces of a part
until all senders have sent theirs, then reduces them with `reduce_pieces` (poisoned pieces dropped; the mean
or CenteredClip).

The averager process counts, per sender, the pieces it dropped or clipped; the peer reads the counts after each
global step (`RobustAveraging.outlier_counts`) and publishes them, so a monitor can show who sends outliers.
It also counts the bytes it sends to other peers (`RobustAveraging.sent_bytes`): its pieces, the results it
returns as a reducer, and the states it serves to newcomers.

Same result for everyone. hivemind returns each sender the difference between the result and the sender's own
piece, compressed, which each sender adds to its piece: peers end up with results that differ by the compression
noise. An averager with `same_result` instead returns the (compressed) result itself, and a reducer takes for its
own piece the same compressed result, so every member of the group holds the very same bits (DiLoCo's outer step
needs that: training/swarm/diloco.py).

The hivemind internals restated here are listed, with why, in training/swarm/__init__.py.
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from contextlib import closing, suppress
from functools import partial
from typing import Any, AsyncIterator, Protocol  # noqa: UP035 (hivemind's servicer recognises only typing's alias)

import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.averager import logger as averager_logger
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer
from hivemind.compression import CompressionBase, CompressionInfo, deserialize_torch_tensor, serialize_torch_tensor
from hivemind.compression.adaptive import AdaptiveCompressionBase
from hivemind.p2p import P2P, P2PContext, P2PHandlerError, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import amap_in_executor, as_aiter, azip, enter_asynchronously

from training.swarm import matchmaking
from training.swarm.aggregation import MEAN, Aggregation, reduce_pieces
from training.swarm.received import ROUNDS_KEPT, Projection, SpanSums, span_of
from training.swarm.shares import reducer_shares

LINGER = 60.0  # seconds a stream stays open after its last message for the other side to hang up (a reducer's results
# when the round has no timeout of its own; a state download)


class Probation(Protocol):
    """Whom a peer's reducers hold to one median peer (training/audit/standing.py): those not proven; and whom they
    count for nothing: those nobody can audit now."""

    def proven(self, peer_id: PeerID) -> bool: ...

    def counted(self, peer_id: PeerID) -> bool: ...


def senders_standing(
    probation: Probation | None, senders: Sequence[PeerID], own: PeerID
) -> tuple[list[bool] | None, list[bool] | None]:
    """Per sender, but the reducer's `own` peer: whether it is held on probation, and whether it counts for nothing
    (None, None: nobody is, in a run without audits)."""
    if probation is None:
        return None, None
    held = [peer != own and not probation.proven(peer) for peer in senders]
    return held, [peer != own and not probation.counted(peer) for peer in senders]


class RobustPartReducer(TensorPartReducer):
    """hivemind's reducer, keeping a part's pieces until every sender has sent its own, then `reduce_pieces`."""

    def __init__(
        self,
        part_shapes: Sequence[torch.Size],
        num_senders: int,
        aggregation: Aggregation,
        sums: SpanSums | None = None,
        probation: list[bool] | None = None,
        uncounted: list[bool] | None = None,
    ) -> None:
        self.aggregation, self.sums = aggregation, sums  # `sums`: what it received, projected (swarm/received.py)
        self.probation = probation  # per sender: whether it is held to one median peer (None: nobody is)
        self.uncounted = uncounted  # per sender: whether its piece counts for nothing (None: every piece counts)
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
            if self.sums is not None and weight > 0:
                self.sums.add(sender_index, part_index, tensor_part)
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        return await current_part_future

    def check_current_part_finished(self) -> None:
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            try:
                reduction = reduce_pieces(self.pieces, self.counted_weights(), self.aggregation, self.probation)
            except AllreduceException as error:
                self.current_part_future.set_exception(error)
            else:
                self.outliers.update({(sender, "dropped"): 1 for sender in reduction.dropped})
                self.outliers.update({(sender, "clipped"): 1 for sender in reduction.clipped})
                self.current_part_future.set_result(reduction.average)
            self.reset_accumulators()

    def counted_weights(self) -> list[float]:
        """The senders' weights, 0 for those it counts for nothing (their weights stay for the reducer's checks)."""
        uncounted = self.uncounted or [False] * self.num_senders
        return [0.0 if left_out else weight for weight, left_out in zip(self.weights, uncounted, strict=True)]

    def finalize(self) -> None:
        self.pieces = []
        super().finalize()


def compression_type(compression: CompressionBase, info: CompressionInfo) -> int:
    """The basic compression (a runtime_pb2.CompressionType) that `compression` sends a tensor of `info` with."""
    while isinstance(compression, AdaptiveCompressionBase):
        compression = compression.choose_compression(info)
    return compression.compression_type


class RobustAllReduceRunner(AllReduceRunner):
    """hivemind's all-reduce with a `RobustPartReducer`, adding the bytes it sends to `sent["allreduce"]`; with
    `same_result`, it returns every sender the compressed result itself (see the module's docstring); with a
    `projection`, its reducer sums what each sender sent it (`span_sums`, training/swarm/received.py); with
    `probation`, its reducer holds the senders not proven (but itself) to one median peer."""

    def __init__(
        self,
        *,
        aggregation: Aggregation,
        sent: Counter[str],
        same_result: bool = False,
        projection: Projection | None = None,
        probation: Probation | None = None,
        linger: float = LINGER,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        shapes = self.tensor_part_reducer.part_shapes
        self.tensor_part_reducer.finished.set()  # hivemind's summing reducer, never used: nothing to finalize
        self.span_sums = None if projection is None else self.make_span_sums(projection)
        held, uncounted = senders_standing(probation, self.sender_peer_ids, self.peer_id)
        self.tensor_part_reducer = RobustPartReducer(
            shapes, len(self.sender_peer_ids), aggregation, self.span_sums, held, uncounted
        )
        self.sent, self.same_result, self.linger = sent, same_result, linger
        self.serialized_results: dict[int, asyncio.Future] = {}  # part index -> its result, serialized once
        # A reducer that fails leaves its parts as they were: with results rather than differences, the own values.
        self.tensor_part_container.return_deltas = not same_result
        self.failures: list[str] = []  # what went wrong with other peers in this round (hivemind logs it at debug)

    def make_span_sums(self, projection: Projection) -> SpanSums:
        """This reducer's sums of what each sender sends it, over its span of the flat vector."""
        sizes = [[part.numel() for part, _ in parts] for parts in self.tensor_part_container._input_parts_by_peer]
        span, part_starts = span_of(sizes, self.ordered_peer_ids.index(self.peer_id))
        return SpanSums(projection, span, part_starts)

    def received_sums(self) -> dict[str, tuple[float, list[float]]]:
        """Sender peer id -> (its weight, its sums by region) for each sender of samples whose every part this
        reducer took (not this peer's own)."""
        reducer = self.tensor_part_reducer
        return {
            self.sender_peer_ids[sender].to_base58(): (reducer.weights[sender], sums.tolist())
            for sender, sums in self.span_sums.sums.items()
            if reducer.num_parts_received[sender] == reducer.num_parts and self.sender_peer_ids[sender] != self.peer_id
        }

    async def _communicate_with_peer(self, peer_id) -> None:
        """hivemind's, except that another peer's results are recorded as they arrive (`_send_and_receive`), and that
        with `same_result` this peer's own parts become the same compressed result that it returns to the others."""
        peer_index = self.ordered_peer_ids.index(peer_id)
        if peer_id != self.peer_id:
            return await self._send_and_receive(peer_id, peer_index)
        if not self.same_result:
            return await super()._communicate_with_peer(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        container = self.tensor_part_container
        for part_index, (tensor_part, info) in enumerate(container._input_parts_by_peer[peer_index]):
            result = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, tensor_part, weight=self.weight
            )
            serialized = await self.serialized_result(part_index, result, compression_type(container.compression, info))
            container.register_processed_part(peer_index, part_index, deserialize_torch_tensor(serialized))

    async def _send_and_receive(self, peer_id, peer_index: int) -> None:
        """hivemind's exchange with another peer's reducer: this peer's parts go out, that part's results come back
        (`_call_reducer`); what failed goes into `failures`."""
        container = self.tensor_part_container
        expected, received = container.num_parts_by_peer[peer_index], 0

        def deserialize(message: averaging_pb2.AveragingData) -> torch.Tensor:
            if message.code != averaging_pb2.AVERAGED_PART:
                raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(message.code)}")
            return deserialize_torch_tensor(message.tensor_part)

        try:
            results = self._call_reducer(peer_id, peer_index)
            async for result in amap_in_executor(deserialize, results, max_prefetch=container.prefetch):
                container.register_processed_part(peer_index, received, result)
                received += 1
            if received != expected:
                raise AllreduceException(f"peer {peer_id} sent {received} parts, but we expected {expected}")
        except BaseException as error:
            if isinstance(error, asyncio.TimeoutError):
                reason = f"nothing for {self.reducer_timeout:g} s"
            else:
                reason = f"{type(error).__name__}: {error}"
            if isinstance(error, Exception):
                self.failures.append(f"no results from {peer_id.to_base58()[-8:]} ({reason})")
            container.register_failed_reducer(peer_index)
            raise

    async def _call_reducer(self, peer_id, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        """The reducer's results for this peer's parts: hivemind's client side of a streaming call
        (`P2P._iterate_protobuf_stream_handler`), except that it hangs up once it holds every result: the reducer
        keeps the stream open until then (`rpc_aggregate_part`).

        A full peer waits at most `reducer_timeout` for each result; a client only for the round's own timeout
        (`allreduce_timeout`, the --averaging-timeout). A client's results all come from reachable peers over links
        whose pace it cannot know, and only once its parts are in, which left this process when the p2p daemon took
        them, not when they arrived (the daemon's and the kernel's buffers hold a megabyte or more: seconds on a
        slow uplink). hivemind's timeout ran from the round's start: on the NAT testbed at 20 Mbit/s, a home's 26 MB
        of small-preset gradients took longer than the 10 s, so every home gave up on its results (0% received, its
        own gradients applied) in every round of a run whose progress lines said "round 3". Waiting 4 s for each
        result from the end of the parts still lost a 2 Mbit/s home's results (test_wan: all of one round's in a CI
        run, the last 5% of one round's in a run after it). A reducer that hangs costs a client its round's timeout,
        a full peer `reducer_timeout`.

        Everyone reads while it sends, so that a reducer's early answer ends the exchange: a reducer that no longer
        runs the round (this peer came late to it, as a peer that downloaded the state tags along with its group's
        round) takes the first part and, once its next group forms, answers "bad group" and reads no more. A client
        that read only once its parts were sent never read it: its parts stalled in the full buffers, and it waited
        the round's timeout (2 minutes in a CI run of test_wan, by when the others had finished the run). And each
        part must leave within `reducer_timeout`: a reducer drops a sender whose next part takes `sender_timeout`
        (half that), so a stalled send means a reducer that takes nothing more."""
        handle_name = self._servicer_type._get_handle_name(self._prefix, "rpc_aggregate_part")
        _, reader, writer = await self._p2p.call_binary_stream_handler(peer_id, handle_name)

        async def send_parts() -> None:
            try:
                async for message in self._generate_input_for_peer(peer_index):
                    await asyncio.wait_for(P2P.send_protobuf(message, writer), self.reducer_timeout)
                await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
            except Exception:
                # The results stop too: this exchange fails at once rather than wait for them. Not `close`, which
                # waits for the buffered parts to leave, and a reducer that takes no more never takes them.
                writer.transport.abort()
                raise

        sending = asyncio.create_task(send_parts())
        with closing(writer):  # hanging up
            try:
                wait = None if self.should_delay_results(self.peer_id) else self.reducer_timeout  # a client: see above
                for _ in range(self.tensor_part_container.num_parts_by_peer[peer_index]):
                    try:
                        result, error = await asyncio.wait_for(
                            P2P.receive_protobuf(averaging_pb2.AveragingData, reader), wait
                        )
                    except asyncio.IncompleteReadError:  # the stream ended
                        break
                    if error is not None:
                        raise P2PHandlerError(f"{peer_id} failed to reduce: {error.message}")
                    yield result
                if sending.done() and not sending.cancelled():
                    sending.result()  # what went wrong sending, if anything did
            finally:
                sending.cancel()

    def serialized_result(self, part_index: int, result: torch.Tensor, compression: int) -> asyncio.Future:
        """A part's result, serialized once for all its senders: the very same bytes reach everyone."""
        if part_index not in self.serialized_results:
            serialize = partial(serialize_torch_tensor, result, compression)
            self.serialized_results[part_index] = asyncio.get_event_loop().run_in_executor(None, serialize)
        return self.serialized_results[part_index]

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's, counted (a member of weight 0: `weightless_parts`)."""
        weightless = self.same_result and self.weight == 0
        parts = self.weightless_parts(peer_index) if weightless else super()._generate_input_for_peer(peer_index)
        async for message in parts:
            self.sent["allreduce"] += message.ByteSize()
            yield message

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's reducer side of an exchange, except that once every result went out, the stream stays open
        until the sender hangs up (it does once it holds them all, `_call_reducer`), or for `linger` seconds.

        hivemind closes the stream as soon as the handler returns (`P2P._handle_stream`). The p2p daemon then closes
        its libp2p stream for reading and writing (go-libp2p-daemon's `doStreamPipe`, go-yamux v4): closing the read
        side wakes its own reader of the stream with a reset error, on which it resets the stream, and when that
        comes before the close of the write side, a reset goes out instead of an end. The sender's daemon then drops
        the results it holds and has not yet passed on (go-yamux reads nothing more after a reset): the tail of a
        round's results, lost. Seen on 2 loaded cores (28 of 31 results arrived, and the members of a DiLoCo round
        held different bits) and on the NAT testbed with bandwidth shares (a home received 95.4% of a round: the
        last four results of one reducer, in 3 of 12 runs). A stream that ends short of its results (the sender
        was dropped, or told "bad group") ends at once: its sender fails that exchange either way."""
        results = 0
        async for message in super().rpc_aggregate_part(stream, context):
            results += message.code == averaging_pb2.AVERAGED_PART
            yield message
        if results == self.tensor_part_reducer.num_parts:
            await asyncio.sleep(self.linger)  # hivemind cancels this when the sender hangs up

    async def weightless_parts(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's parts for a reducer (`_generate_input_for_peer`) from a member of weight 0 in a `same_result`
        round (a keeper's zeros, a peer tagging along): each part without its values, which count for nothing in the
        reduction (`reduce_pieces`), and whose result is the result itself. A part keeps its compression (the one its
        result comes back in), and nothing is compressed: hivemind's `iterate_input_parts_for` would compress every
        part, a whole gradient's worth of CPU each round, and it marks the parts consumed as that does."""
        container = self.tensor_part_container
        container._inputs_consumed_by_peer[peer_index] = True
        for part_index, (_, info) in enumerate(container._input_parts_by_peer[peer_index]):
            message = averaging_pb2.AveragingData(weight=self.weight)
            message.tensor_part.compression = compression_type(container.compression, info)
            if part_index == 0:
                message.code, message.group_id = averaging_pb2.PART_FOR_AVERAGING, self.group_id
            yield message

    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's, returning the result itself with `same_result` (else the difference), and counting it."""
        part_index = 0
        try:
            loop = asyncio.get_event_loop()
            async for tensor_part, weight, part_compression in amap_in_executor(
                lambda msg: (received_piece(msg), msg.weight, msg.tensor_part.compression),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                try:
                    result = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight
                    )
                    part_index += 1
                except BannedException:
                    break  # the sender was banned: its parts are no longer needed
                if self.same_result:
                    serialized = await self.serialized_result(part_index - 1, result, part_compression)
                else:
                    serialized = await loop.run_in_executor(
                        None, serialize_torch_tensor, result - tensor_part, part_compression
                    )
                message = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
                self.sent["allreduce"] += message.ByteSize()
                yield message
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    async def _ban_sender(self, peer_id) -> None:
        """hivemind's, recording why; never a sender whose parts are all in (it hung up, holding its results)."""
        reducer = self.tensor_part_reducer
        if reducer.num_parts_received[self.sender_peer_ids.index(peer_id)] == reducer.num_parts:
            return
        if peer_id not in self.banned_senders:
            # Called while handling what went wrong with the sender, if anything did: a missing sender has no error.
            error = sys.exc_info()[1]
            reason = f"{type(error).__name__}: {error}" if error else "sent nothing in time"
            self.failures.append(f"parts of {peer_id.to_base58()[-8:]} left out ({reason})")
        await super()._ban_sender(peer_id)

    def outliers_by_sender(self) -> Counter[tuple[str, str]]:
        """(sender peer id, "dropped" | "clipped") -> its pieces this peer dropped or clipped in this round."""
        outliers = self.tensor_part_reducer.outliers
        return Counter({(self.sender_peer_ids[i].to_base58(), kind): n for (i, kind), n in outliers.items()})


def received_piece(message: averaging_pb2.AveragingData) -> torch.Tensor | None:
    """A sender's piece; None from a sender of weight 0 that sent no values (`weightless_parts`)."""
    if message.weight == 0 and not message.tensor_part.buffer:
        return None
    return deserialize_torch_tensor(message.tensor_part)


class RoundResult(dict):
    """What a finished round's group gathered (hivemind's result of a round: peer id -> what each member sent), with
    the group's id, which names this round and no other, and whether the round's result reached this member only in
    part (`apart`: a reducer's parts missing here, where it kept its own values; its tensors are then its own).

    The optimizer chains both into the parameters' lineage (training/swarm/optimizer.py), and the audits recompute a
    peer's gradient only at parameters of the same lineage. Two members apart held one lineage and different
    parameters, and their auditors convicted each other (an honest churn run, CI run 64). And one group of peers makes
    many rounds: a home that missed its step's group found the next step's and averaged its gradient there, a round
    behind the others, and held their lineage at that step with parameters not theirs (the lineage then named the
    members alone)."""

    def __init__(self, gathered: dict, group_id: bytes, apart: bool) -> None:
        super().__init__(gathered)
        self.group_id, self.apart = group_id, apart


class RobustAveraging:
    """A mixin for hivemind averagers: their all-reduce rounds reduce with `aggregation`, and they count outliers
    and the bytes they send; with `same_result`, every member of a round ends with the same bits.

    The counts live in the averager's own process; `outlier_counts()` and `sent_bytes()` ask it over hivemind's pipe.
    """

    same_result = False
    # With same_result: whether a round whose members may not all hold the result fails (a sender left out, or a
    # reducer's results missing here). DiLoCo's outer round does: its members then wait for each other's next one.
    # A gradient round goes on as a plain hivemind round does: the members that got every result hold the same bits,
    # and one that missed some keeps its own gradient there, apart for that step (failing the round instead failed
    # every round a killed or refused peer was grouped into, for everyone, and made a home whose results were cut
    # on a loaded machine download the state twice in six steps).
    all_or_nothing = True

    def __init__(
        self,
        *args,
        aggregation: Aggregation = MEAN,
        projection: Projection | None = None,
        probation: Probation | None = None,
        **kwargs,
    ) -> None:
        self.aggregation, self.probation = aggregation, probation
        # With a projection: each round's sums of what the senders sent this reducer, until the main process asks.
        self.projection, self.received = projection, deque(maxlen=ROUNDS_KEPT)
        self.outliers: Counter[tuple[str, str]] = Counter()
        self.sent: Counter[str] = Counter()  # "allreduce" | "state" -> bytes sent to other peers
        self.rounds_apart: set[bytes] = set()  # ids of this process's running groups whose result came here in part
        super().__init__(*args, **kwargs)

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs) -> dict:
        """hivemind's round with its group, each reducer's part by `reducer_shares` (training/swarm/shares.py), not by
        hivemind's linear program (nor its `min_vector_size`, which only that program reads); its result is a
        `RoundResult`."""
        try:
            bandwidths, mode_ids, user_data = zip(*map(self.serializer.loads, group_info.gathered), strict=True)
            gathered = dict(zip(group_info.peer_ids, map(self.serializer.loads, user_data), strict=True))
            shares = reducer_shares(bandwidths, tuple(map(AveragingMode, mode_ids)))
            async with enter_asynchronously(self.get_tensors()) as local_tensors:
                await self._run_allreduce_inplace_(local_tensors, group_info, peer_fractions=shares, **kwargs)
        except BaseException as error:
            if isinstance(error, Exception):
                averager_logger.exception(error)
            raise MatchmakingException(f"Unable to run All-Reduce: {error}") from error
        finally:
            apart = group_info.group_id in self.rounds_apart
            self.rounds_apart.discard(group_info.group_id)
        return RoundResult(gathered, group_info.group_id, apart)

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs
    ) -> None:
        """hivemind's `_run_allreduce_inplace_` with a `RobustAllReduceRunner`, counting its outliers."""
        group_id = group_info.group_id if group_id is None else group_id
        runner = RobustAllReduceRunner(
            aggregation=self.aggregation,
            sent=self.sent,
            same_result=self.same_result,
            projection=self.projection,
            probation=self.probation,
            linger=self._allreduce_timeout or LINGER,  # a sender waits for its results at most the round's timeout
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
                    if self.same_result:
                        tensor.copy_(update)
                    else:
                        tensor.add_(update, alpha=self._averaging_alpha)
                    self.last_updated = get_dht_time()
                    self._state_updated.set()
            else:
                async for _ in runner:
                    raise ValueError("aux peers should not receive averaged tensors")
        finally:
            self.outliers.update(runner.outliers_by_sender())
            if runner.span_sums is not None:
                self.keep_received(group_info, runner)
        if runner.tensor_part_container.failed_size:
            self.rounds_apart.add(group_id)
        apart = runner.tensor_part_container.failed_size or runner.banned_senders
        if self.same_result and self.all_or_nothing and apart:
            # hivemind lets a round end with a reducer's parts missing (its own values kept) or without a sender:
            # then the members do not all hold the same result, which same_result promises.
            raise AllreduceException(
                f"{'; '.join(runner.failures) or 'a part failed'}: the round's members hold different results"
            )

    def keep_received(self, group_info: GroupInfo, runner: RobustAllReduceRunner) -> None:
        """Keep the round's sums of what each sender sent, with the global step this peer and each sender gathered (a
        sender is judged around its own: a peer that looks for its group before a download gathers the step the download
        brings, `SwarmOptimizer.join_next_group`). Every round with senders is kept: one that gathered another step than
        the others is judged too (training/audit/received.py's `judged_step`)."""
        steps = {
            peer_id.to_base58(): self.gathered_step(data)
            for peer_id, data in zip(group_info.peer_ids, group_info.gathered, strict=True)
        }
        own, senders = steps[self.peer_id.to_base58()], runner.received_sums()
        if own is not None and senders:
            gathered = {peer_id: steps.get(peer_id) for peer_id in senders}
            self.received.append(
                {"step": own, "regions": runner.span_sums.regions(), "senders": senders, "gathered": gathered}
            )

    def gathered_step(self, data: bytes) -> int | None:
        """The global step a member gathered for its round (`SwarmGradientAverager.schedule_step`); None: none."""
        with suppress(Exception):  # another member's data: anything
            step = self.serializer.loads(self.serializer.loads(data)[2])
            return step if isinstance(step, int) else None
        return None

    def received_rounds(self) -> list[dict]:
        """The rounds' sums kept since the last call (`keep_received`): each a dict of the step, the regions this
        reducer checks, sender peer id -> (weight, sums by region), and sender peer id -> the step it gathered (from
        any process)."""
        return self.ask_own_process(RobustAveraging.report_received)

    async def report_received(self, future: MPFuture) -> None:
        future.set_result(list(self.received))
        self.received.clear()

    def outlier_counts(self) -> dict[tuple[str, str], int]:
        """Since this averager started: (sender peer id, "dropped" | "clipped") -> pieces (from any process)."""
        return self.ask_own_process(RobustAveraging.report_outliers)

    async def report_outliers(self, future: MPFuture) -> None:
        future.set_result(dict(self.outliers))

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        async for message in super().rpc_download_state(request, context):
            self.sent["state"] += message.ByteSize()
            yield message

    def sent_bytes(self) -> dict[str, int]:
        """Since this averager started: "allreduce" | "state" -> bytes it sent to other peers (from any process)."""
        return self.ask_own_process(RobustAveraging.report_sent_bytes)

    async def report_sent_bytes(self, future: MPFuture) -> None:
        future.set_result(dict(self.sent))

    def tell_standing(self, convicted: Sequence[str] = (), unaudited: Sequence[str] | None = None) -> None:
        """What the main process's audits found, told to this averager's standing (from any process): `convicted`,
        refused from now on in its requests, groups and rounds; `unaudited` (when given), the peers nobody can audit
        now, whose pieces its reducer counts for nothing, in place of those it was told last."""
        left_out = None if unaudited is None else list(unaudited)
        self.ask_own_process(RobustAveraging.update_standing, convicted=list(convicted), unaudited=left_out)

    async def update_standing(self, future: MPFuture, convicted: list[str], unaudited: list[str] | None) -> None:
        if matchmaking.avoided is not None:  # this process's standing (training/audit/standing.py)
            matchmaking.avoided.convict(convicted)
            if unaudited is not None:
                matchmaking.avoided.leave_out(unaudited)
        future.set_result(None)

    def ask_own_process(self, method: Callable[..., Awaitable[None]], **arguments: Any) -> Any:
        """The result of `method` (one of OWN_PROCESS_CALLS), run in this averager's own process: hivemind's averager
        runs there, and runs what its pipe asks for by the method's name (averaging/averager.py:317-322)."""
        if method not in OWN_PROCESS_CALLS:
            raise ValueError(f"{method.__qualname__} is not one of the calls an averager's process answers")
        future = MPFuture()
        self._outer_pipe.send((method.__name__, [], dict(future=future, **arguments)))
        return future.result()


# What a peer's main process asks of its averagers' processes, by name: these functions, whose names hivemind's pipe
# carries (a method renamed here is renamed in the message too; tests/test_robust.py checks the names resolve).
OWN_PROCESS_CALLS = (
    RobustAveraging.report_outliers, RobustAveraging.report_sent_bytes, RobustAveraging.report_received,
    RobustAveraging.update_standing,
)  # fmt: skip
