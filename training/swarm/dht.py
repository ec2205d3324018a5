"""Joining a run's DHT: the addresses a peer starts from, the node itself, and the pings that keep it in the others'
routing tables."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextlib import nullcontext

from hivemind.utils.multiaddr import Multiaddr
from rich.console import Console

from pipeline.core.errors import UserError
from training.auth.guard import RunAccess
from training.config import MonitorSettings, PeerSettings


class JoinError(UserError):
    pass


def parse_initial_peers(addresses: list[str]) -> list[str]:
    for address in addresses:
        try:
            Multiaddr(address)
        except Exception as err:  # multiaddr raises several error types for malformed addresses
            raise JoinError(
                f"--initial-peers {address!r} is not a multiaddress ({err}); copy one the first peer printed"
            ) from None
    return addresses


def start_dht(settings: PeerSettings | MonitorSettings, validators: list, console: Console, access: RunAccess | None):
    """The peer's DHT node, joined to --initial-peers; prints the addresses others can join with."""
    import hivemind

    initial_peers = parse_initial_peers(settings.initial_peers)
    try:
        with access.identity_file() if access else nullcontext(settings.identity_path) as identity_path:
            dht = hivemind.DHT(
                start=True,
                initial_peers=initial_peers,
                host_maddrs=settings.host_maddrs,
                announce_maddrs=settings.announce_maddrs or None,
                client_mode=settings.client_mode,
                identity_path=identity_path,
                record_validators=validators,
                authorizer=access.authorizer if access else None,
            )
    except Exception as err:  # hivemind surfaces p2pd failures as several exception types
        if initial_peers:
            admission = (
                "that those peers run with the same --authority-key"
                if access
                else "whether the run needs authentication (--authority-key with --token or --auth-server)"
            )
            raise JoinError(
                f"cannot reach any of --initial-peers ({err}); check the addresses, that those peers are running, "
                f"and {admission}"
            ) from None
        raise JoinError(f"cannot start the DHT on {settings.host_maddrs}: {err}") from None
    if settings.client_mode:
        console.print(f"joined as a client-mode peer {dht.peer_id} (others cannot dial it)")
    else:
        console.print("other peers can join with --initial-peers and one of:")
        for address in dht.get_visible_maddrs():
            print(address, flush=True)  # each on a line of its own, for scripts
    return dht


async def ping_peers(peer_ids: Sequence[str], dht, node) -> None:
    """Inside the DHT's process: ping these peers, which adds them to this node's routing table and this node to
    theirs (`DHT.run_coroutine`)."""
    from hivemind.p2p import PeerID

    await asyncio.gather(*(node.protocol.call_ping(PeerID.from_base58(peer_id)) for peer_id in peer_ids))
