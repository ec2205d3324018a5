"""hivemind's averagers, answering only the admitted peers: those of an authenticated run (training/auth/), and
not those this peer's audits convicted (training/audit/).

hivemind's authentication wraps only the DHT's RPCs; averaging messages carry no token. The averager's RPC handlers
receive a `P2PContext` whose `remote_id` libp2p has authenticated: `AdmittedOnly` checks that peer id (against the
run's published credentials, `AdmittedPeers.check`; against the convictions, `AuditStanding.check`) before it
answers.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress
from typing import AsyncIterator, Protocol  # noqa: UP035 (hivemind's servicer recognises only typing's alias)

from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.proto.p2pd_pb2 import RPCError

READ_REFUSED_FOR = 10.0  # seconds a refused caller's request stream is read to its end before the refusal is sent
HANG_UP_WAIT = 5.0  # seconds the refusal's stream stays open for the caller to read it and hang up


async def refuse(error: PermissionError, stream: AsyncIterator | None = None) -> AsyncIterator[RPCError]:
    """hivemind's error message for `error`, sent so that it reaches the caller: yield this from a handler.

    A handler that raises makes hivemind send the error and close the stream at once (p2p_daemon.py, _handle_stream).
    The p2p daemon then closes its libp2p stream, which interrupts its own read of the caller's side, and it resets the
    stream (go-libp2p-daemon's doStreamPipe); a reset makes the caller's daemon drop what it had received and not yet
    passed on: the refusal. hivemind's client then reads an empty answer or a reset connection (while the caller
    still streamed parts, about once in 20 calls; otherwise rarely: one of 54,000 calls here, one of 110 in a CI run).
    So the refusal goes out as a message (hivemind sends an RPCError yielded by a handler with its error marker, and
    the caller raises it as P2PHandlerError), after what the caller streams is read to its end (or for
    READ_REFUSED_FOR seconds): then the stream stays open until the caller, having read it, hangs up (hivemind's
    client does at once), or for HANG_UP_WAIT seconds. A request of one message (to join a group, download the
    state) is read before the handler runs: `stream` None.
    """
    if stream is not None:
        with suppress(asyncio.TimeoutError):
            await asyncio.wait_for(drop_all(stream), READ_REFUSED_FOR)
    yield RPCError(message=str(error))
    await asyncio.sleep(HANG_UP_WAIT)  # hivemind cancels this when the caller hangs up


async def drop_all(stream: AsyncIterator) -> None:
    async for _ in stream:
        pass


class CallerCheck(Protocol):
    """A check an averager makes of every caller: raises PermissionError to refuse it."""

    async def check(self, caller: PeerID, request: str, dht) -> None: ...


class AllChecks:
    """Several checks of a caller (an authenticated run's credentials, the audits' convictions): all must pass."""

    def __init__(self, *checks: CallerCheck | None) -> None:
        self.checks = [check for check in checks if check is not None]

    async def check(self, caller: PeerID, request: str, dht) -> None:
        for check in self.checks:
            await check.check(caller, request, dht)


class AdmittedOnly:
    """A hivemind averager that answers joining, all-reduce parts and state downloads only for admitted peers.

    Mixed into every averager of training/swarm/; `admitted` None: no checks (a monitor of an open run).
    """

    def __init__(self, *args, admitted: CallerCheck | None = None, **kwargs) -> None:
        self.admitted = admitted  # set before hivemind forks the averager's process in __init__
        super().__init__(*args, **kwargs)

    async def refusal(self, context: P2PContext, request: str) -> PermissionError | None:
        """Why the caller is refused (`admitted.check`), or None: admitted, or no checks."""
        if self.admitted is None:
            return None
        try:
            await self.admitted.check(context.remote_id, request, self.dht)
        except PermissionError as error:
            return error
        return None

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        refused = await self.refusal(context, "join_group")
        responses = refuse(refused) if refused is not None else super().rpc_join_group(request, context)
        async for response in responses:
            yield response

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        refused = await self.refusal(context, "aggregate_part")
        responses = refuse(refused, stream) if refused is not None else super().rpc_aggregate_part(stream, context)
        async for response in responses:
            yield response

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        refused = await self.refusal(context, "download_state")
        responses = refuse(refused) if refused is not None else super().rpc_download_state(request, context)
        async for response in responses:
            yield response
