"""hivemind's averagers, answering only the admitted peers of an authenticated run (training/auth/).

hivemind's authentication wraps only the DHT's RPCs; averaging messages carry no token. The averager's RPC handlers
receive a `P2PContext` whose `remote_id` libp2p has authenticated: `AdmittedOnly` checks that peer id against the
run's published credentials (`AdmittedPeers.check`) before it answers.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress
from typing import AsyncIterator  # noqa: UP035 (hivemind's servicer recognises only typing's alias)

from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from training.auth.guard import AdmittedPeers

READ_REFUSED_FOR = 10.0  # seconds a refused caller's request stream is read to its end before the refusal is sent


async def read_to_end(stream: AsyncIterator) -> None:
    """Read and drop what a caller streams, up to its end (or for READ_REFUSED_FOR seconds), before refusing it.

    hivemind closes the stream as soon as a handler fails, right after it sent the error (p2p_daemon.py,
    _handle_stream). If the caller's parts are still arriving then, this peer's p2p daemon finds them unread or
    writes them to the closed socket, and resets the stream (go-libp2p-daemon's doStreamPipe); a reset makes the
    caller's side drop what it received but had not read yet: the refusal. hivemind's client then reads an empty
    answer, or a reset connection. Once the caller's end of stream is read, nothing more of its comes, and the
    refusal arrives. (A request of one message, to join a group or download the state, is read to its end before
    the handler runs: only a streamed request needs this.) A caller still streaming after READ_REFUSED_FOR is cut
    off, and may see a reset instead.
    """

    async def drop_all() -> None:
        async for _ in stream:
            pass

    with suppress(asyncio.TimeoutError):
        await asyncio.wait_for(drop_all(), READ_REFUSED_FOR)


class AdmittedOnly:
    """A hivemind averager that answers joining, all-reduce parts and state downloads only for admitted peers.

    Mixed into every averager of training/swarm/; `admitted` None: an open run, no checks.
    """

    def __init__(self, *args, admitted: AdmittedPeers | None = None, **kwargs) -> None:
        self.admitted = admitted  # set before hivemind forks the averager's process in __init__
        super().__init__(*args, **kwargs)

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if self.admitted is not None:
            await self.admitted.check(context.remote_id, "join_group", self.dht)
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if self.admitted is not None:
            try:
                await self.admitted.check(context.remote_id, "aggregate_part", self.dht)
            except Exception:
                await read_to_end(stream)  # or the refusal may never reach the caller: see read_to_end
                raise
        async for response in super().rpc_aggregate_part(stream, context):
            yield response

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if self.admitted is not None:
            await self.admitted.check(context.remote_id, "download_state", self.dht)
        async for response in super().rpc_download_state(request, context):
            yield response
