"""Joining a run's DHT: the addresses a peer starts from, the node itself, and the pings that keep it in the others'
routing tables."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from functools import partial
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any, TypeVar

from hivemind.dht import DHT
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr
from rich.console import Console

from pipeline.core.errors import UserError
from training.auth.guard import RunAccess
from training.config import MonitorSettings, PeerSettings
from training.metrics import read_spec_values, reader_validators
from training.swarm.reachability import Reachability, check_reachability, serve_dial_back, why_not_accepted

Settings = TypeVar("Settings", PeerSettings, MonitorSettings)  # a peer's or a monitor's: both join a swarm

ANSWER_TIMEOUT = 5.0  # seconds an initial peer has to accept a TCP connection before it counts as not running
# A node that could not finish joining initial peers (which accepted TCP: the pre-flight below) tries once more: a
# slow link or a busy peer can take longer than p2pd's bootstrap, or hivemind's ping (3 s), allows.
BOOTSTRAP_TRIES = 2
BOOTSTRAP_FAILED = ("failed to connect to bootstrap peers", "none of the initial_peers responded to a ping")

BEHIND_NAT = (
    "behind NAT: nobody can connect to this machine, so it joins as a client (it averages through reachable peers)"
)


class JoinError(UserError):
    pass


def dht_time() -> float:
    """The DHT's clock (hivemind's `get_dht_time`), in which records expire and join holds end."""
    return get_dht_time()


def peer_id_of(address: str) -> str:
    """The peer id at the end of a multiaddress (/ip4/.../tcp/.../p2p/ID)."""
    return Multiaddr(address)["p2p"]


def parse_initial_peers(addresses: list[str]) -> list[str]:
    for address in addresses:
        try:
            Multiaddr(address)
        except Exception as err:  # multiaddr raises several error types for malformed addresses
            raise JoinError(
                f"--initial-peers {address!r} is not a multiaddress ({err}); copy one the first peer printed"
            ) from None
    return addresses


def tcp_endpoint(address: str) -> tuple[str, int] | None:
    """The host and TCP port of a multiaddress such as /ip4/10.0.0.1/tcp/4011/p2p/12D3Koo...; None for another
    transport (QUIC, a relay circuit), which the pre-flight below cannot try."""
    parts = address.strip("/").split("/")
    if len(parts) < 4 or parts[0] not in ("ip4", "ip6", "dns", "dns4", "dns6") or parts[2] != "tcp":
        return None
    return parts[1], int(parts[3])


def refuse_silent_initial_peers(addresses: list[str], timeout: float = ANSWER_TIMEOUT) -> None:
    """A one-line error within TIMEOUT seconds when none of --initial-peers accepts a connection (nothing runs there,
    a typo in the port, a firewall), saying what each did: refused at once, or no answer. `ttt train` and `ttt
    monitor` ask first, before the dataset, the model and hivemind's bootstrap, which would only then fail with the
    same error."""
    endpoints = [tcp_endpoint(address) for address in parse_initial_peers(addresses)]
    if not endpoints or None in endpoints:
        return  # an address of another transport: let hivemind try it

    async def why_not_each() -> list[str | None]:
        return await asyncio.gather(*(why_not_accepted(host, port, timeout) for host, port in endpoints))

    reasons = asyncio.run(why_not_each())
    if all(reasons):
        raise JoinError(
            f"cannot reach any of --initial-peers ({'; '.join(reasons)}); check the addresses and that those peers "
            "are running"
        )


def reachable_addresses(addresses: list[str]) -> list[str]:
    """The addresses to join with that other machines can dial: loopback ones only when there are no others (a run
    on one machine)."""
    elsewhere = [address for address in addresses if not address.startswith(("/ip4/127.", "/ip6/::1/"))]
    return elsewhere or addresses


def start_local_dht() -> WholeRequestsDHT:
    """A DHT node of its own, joined to nobody (a measurement's, in one process)."""
    return WholeRequestsDHT(start=True)


def daemon_reason(err: Exception) -> str:
    """Why hivemind's p2pd failed, without the timestamp of the daemon's log line it quotes."""
    return re.sub(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ", "", str(err))


def start_node(create: Callable[[], Any], say: Callable[[str], object], tries: int = BOOTSTRAP_TRIES) -> Any:
    """The DHT node CREATE starts; a failed bootstrap is tried again, TRIES times in all, each failure said with SAY."""
    for attempt in range(1, tries + 1):
        try:
            return create()
        except Exception as err:  # hivemind surfaces p2pd failures as several exception types
            if attempt == tries or not any(reason in str(err) for reason in BOOTSTRAP_FAILED):
                raise
            say(f"could not connect to the initial peers ({daemon_reason(err)}); trying again")
    raise AssertionError("unreachable")


@contextmanager
def dht_client(address: str) -> Iterator:
    """A DHT client of its own in the swarm at `address`, for reading its records (started here, shut down after)."""
    create = partial(
        WholeRequestsDHT,
        initial_peers=parse_initial_peers([address]),
        client_mode=True,
        record_validators=reader_validators(),
        start=True,
    )
    try:
        dht = start_node(create, partial(print, file=sys.stderr))  # stdout is the command's result
    except Exception as err:  # as in start_dht: p2pd's failures come as several exception types
        raise JoinError(
            f"cannot join the swarm at {address} ({daemon_reason(err)}); check the address and that the peer there is "
            "running"
        ) from None
    try:
        yield dht
    finally:
        dht.shutdown()


def read_run_specs(address: str) -> list[dict]:
    """The run specs the swarm at `address` holds, as published (training/spec.py's `specs_from_records`)."""
    with dht_client(address) as dht:
        return read_spec_values(dht)


class WholeRequestsDHT(DHT):
    """hivemind's `DHT`, whose requests reach its process whole.

    A request is a message down a pipe (`_outer_pipe.send`, dht/dht.py:179, :213, :258), read by the DHT's process
    (`_inner_pipe.recv`, dht/dht.py:128). multiprocessing writes a message over 16 KiB in two writes (its length, then
    its bytes), and the audits' records (training/audit/) pass that size. Two things broke such messages, and killed
    the DHT's process (BlockingIOError, then EOFError or UnpicklingError), so that the peer lost its DHT:

    - the process reads from a pipe that uvloop's reader made non-blocking (dht/dht.py:94: libuv sets O_NONBLOCK on
      the file it polls), so a read that came while the second write was on its way took half a message and failed;
      hivemind logs that and reads on, the rest of the message then reads as garbage. Here each read blocks until
      its message is whole, a moment after its first bytes (tests/test_reachability.py: the DHT died in 5 of 8 runs
      of that test with the lock alone);
    - hivemind sends without a lock, so two threads' writes could interleave. Here every request goes under one
      multiprocessing lock, taken by the peer's threads and by the averagers' processes forked after it (hivemind
      locks its `MPFuture` results the same way, utils/mpfuture.py:83).

    A third killed it as the peer left (clean-clone run 97, on a public peer's console): a request that carries a
    connection is unpickled by fetching that connection from its sender's process (multiprocessing's
    `resource_sharer`), and a sender that exits meanwhile makes that fetch raise EOFError, which hivemind's loop
    (dht/dht.py:129) does not catch: the process printed its traceback. Here a request that cannot be unpickled is a
    ConnectionError, which hivemind's loop logs (to the peer's hivemind log) before it reads on
    (`receive_request`).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        pipe, lock = self._outer_pipe, multiprocessing.Lock()
        send = pipe.send

        def send_whole(message) -> None:
            with lock:
                send(message)

        pipe.send = send_whole

    def run(self) -> None:
        pipe = self._inner_pipe

        def receive_whole():
            os.set_blocking(pipe.fileno(), True)
            try:
                return receive_request(pipe)
            finally:
                os.set_blocking(pipe.fileno(), False)  # as uvloop's reader keeps it

        pipe.recv = receive_whole
        super().run()


def receive_request(pipe: Connection) -> Any:
    """The next message down `pipe`, as `pipe.recv()` gives it; one read whole that cannot be unpickled (a connection
    in it whose sender has exited) raises ConnectionError. A pipe closed at its other end raises EOFError as before."""
    message = pipe.recv_bytes()
    try:
        return ForkingPickler.loads(message)
    except EOFError as error:  # hivemind's loop catches OSError (ConnectionError among them), not this
        raise ConnectionError("a request could not be read (EOFError): its sender has likely exited") from error


def start_dht(settings: PeerSettings | MonitorSettings, validators: list, console: Console, access: RunAccess | None):
    """The peer's DHT node, joined to --initial-peers; prints the addresses others can join with."""
    initial_peers = parse_initial_peers(settings.initial_peers)
    try:
        with access.identity_file() if access else nullcontext(settings.identity_path) as identity_path:
            create = partial(
                WholeRequestsDHT,
                start=True,
                initial_peers=initial_peers,
                # a client listens nowhere: it has no address others could reach, so it announces none
                host_maddrs=[] if settings.client_mode else settings.host_maddrs,
                no_listen=settings.client_mode,
                announce_maddrs=settings.announce_maddrs or None,
                client_mode=settings.client_mode,
                identity_path=identity_path,
                record_validators=validators,
                authorizer=access.authorizer if access else None,
            )
            dht = start_node(create, lambda line: console.print(f"[yellow]{line}[/]"))
    except Exception as err:  # hivemind surfaces p2pd failures as several exception types
        if initial_peers:
            admission = (
                "that those peers run with the same --authority-key"
                if access
                else "whether the run needs authentication (--authority-key with --token or --auth-server)"
            )
            raise JoinError(
                f"cannot reach any of --initial-peers ({daemon_reason(err)}); check the addresses, that those peers "
                f"are running, and {admission}"
            ) from None
        raise JoinError(f"cannot start the DHT on {settings.host_maddrs}: {daemon_reason(err)}") from None
    if settings.client_mode:
        console.print(f"joined as a client-mode peer {dht.peer_id} (others cannot dial it)")
    else:
        averages = settings.assist_averaging if isinstance(settings, MonitorSettings) else True
        dht.run_coroutine(partial(serve_dial_back, averages=averages))  # joining peers can check their reachability
        console.print("other peers can join with --initial-peers and one of:")
        for address in reachable_addresses([str(address) for address in dht.get_visible_maddrs()]):
            print(address, flush=True)  # each on a line of its own, for scripts
    return dht


def listen_on(host_maddrs: list[str], ports: dict[str, int]) -> list[str]:
    """HOST_MADDRS with each "any port" (tcp/0) replaced by the port the reachability check listened on, so that the
    DHT listens where others reached it."""
    fixed = []
    for address in host_maddrs:
        family = address.split("/")[1] if address.count("/") > 1 else ""
        if family in ports:
            address = re.sub(r"/tcp/0(?=/|$)", f"/tcp/{ports[family]}", address)
        fixed.append(address)
    return fixed


def choose_reachability(settings: Settings, console: Console) -> Settings:
    """--reachability auto: a peer that joins a run asks an initial peer whether it can connect back
    (training/swarm/reachability.py). Reachable: a full peer announcing only where it was reached; not reachable: a
    client; no answer: a full peer, with a warning. public and client decide without asking."""
    if settings.reachability == "client":
        return dataclasses.replace(settings, client_mode=True)
    if settings.reachability == "public" or not settings.initial_peers:
        return settings
    initial_peers = parse_initial_peers(settings.initial_peers)
    try:
        found = asyncio.run(check_reachability(initial_peers, settings.host_maddrs, settings.announce_maddrs))
    except Exception:  # noqa: BLE001 (no initial peer can be reached: the DHT's start, next, says so in one line)
        return settings
    return apply_reachability(settings, found, console)


def apply_reachability(settings: Settings, found: Reachability, console: Console) -> Settings:
    """SETTINGS for what the dial-back check FOUND, said in one plain line (and a warning where it matters)."""
    if found.reachable is None:
        console.print(
            "warning: could not check whether other peers can connect to this machine (no initial peer answered "
            "the check); it joins as a full peer: if its rounds fail, restart it with --reachability client"
        )
        return settings
    if not found.reachable:
        console.print(BEHIND_NAT)
        if not found.checker_averages:
            console.print(
                f"warning: {found.checker}, which checked, takes no part in averaging: a client averages only if "
                "some reachable peer does (a public trainer, or `ttt monitor --assist-averaging` on a public address)"
            )
        return dataclasses.replace(settings, client_mode=True)
    console.print(
        f"reachable: {found.checker} connected back to {', '.join(found.reached)} in {found.seconds:.1f} s, so it "
        "joins as a full peer"
    )
    if settings.announce_maddrs:  # the volunteer's own (a port forward): kept as given
        return settings
    host_maddrs = listen_on(settings.host_maddrs, found.ports)
    return dataclasses.replace(settings, host_maddrs=host_maddrs, announce_maddrs=found.reached)


def ping(dht, peer_ids: Sequence[str], wait: bool = True) -> list[str] | None:
    """Ping these peers, which puts them into this node's routing table and this node into theirs; those that answered
    (running, and reachable from here), or with `wait` False nothing: the pings go on in the DHT's process."""
    answered = dht.run_coroutine(partial(ping_peers, list(peer_ids)), return_future=not wait)
    return answered if wait else None


async def ping_peers(peer_ids: Sequence[str], dht, node) -> list[str]:
    """Inside the DHT's process (`DHT.run_coroutine`): ping these peers, which adds them to this node's routing table
    and this node to theirs; returns those that answered (running, and reachable from here)."""
    from hivemind.p2p import PeerID

    answers = await asyncio.gather(*(node.protocol.call_ping(PeerID.from_base58(peer_id)) for peer_id in peer_ids))
    return [peer_id for peer_id, answer in zip(peer_ids, answers, strict=True) if answer is not None]
