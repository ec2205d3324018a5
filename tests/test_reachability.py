"""How a peer decides whether it joins as a client, without a network: what the dial-back check dials, which addresses
a reachable peer listens on and announces, and what the volunteer reads. tests/test_wan.py runs the check on real NAT
routers."""

from __future__ import annotations

import asyncio
import io
import multiprocessing
import socket
import threading
import time

import pytest
from rich.console import Console

from tests.support.commands import run_ttt
from training.config import PeerSettings
from training.swarm import reachability
from training.swarm.dht import (
    BEHIND_NAT,
    JoinError,
    apply_reachability,
    choose_reachability,
    listen_on,
    reachable_addresses,
    receive_request,
    refuse_silent_initial_peers,
)
from training.swarm.reachability import (
    MAX_CANDIDATES,
    DialBackServer,
    Reachability,
    dial_back_candidates,
    tcp_ports,
)

FIRST_PEER = "/ip4/10.90.0.10/tcp/4000/p2p/12D3KooWNWFQAyzccLkf3NVVRQYgYfrkEPSWfgNmCYHNw5h4u28W"
JOINING = PeerSettings(initial_peers=[FIRST_PEER])


def decide(settings: PeerSettings, found: Reachability) -> tuple[PeerSettings, str]:
    out = io.StringIO()
    return apply_reachability(settings, found, Console(file=out, width=300)), out.getvalue()


def test_the_checker_dials_only_the_observed_ip_at_the_claimed_ports():
    claimed = ["/ip4/192.168.1.2/tcp/4011", "/ip4/127.0.0.1/tcp/4011", "/ip6/::1/tcp/4012", "/ip4/8.8.8.8/tcp/53"]
    candidates = dial_back_candidates("/ip4/10.90.0.100/tcp/50123", claimed)
    assert candidates == [("10.90.0.100", 50123), ("10.90.0.100", 4011), ("10.90.0.100", 4012), ("10.90.0.100", 53)]
    many = [f"/ip4/10.0.0.1/tcp/{port}" for port in range(1000, 1100)]
    assert len(dial_back_candidates("/ip4/10.90.0.100/tcp/5", many)) == MAX_CANDIDATES
    assert dial_back_candidates("/p2p-circuit", claimed) == []


def test_a_reachable_peer_listens_where_it_was_reached_and_announces_only_that():
    found = Reachability(True, ["/ip4/10.90.0.11/tcp/4321"], tcp_ports(["/ip4/127.0.0.1/tcp/4321"]), "/ip4/10.90.0.10")
    settings, said = decide(JOINING, found)
    assert not settings.client_mode
    assert settings.host_maddrs == ["/ip4/0.0.0.0/tcp/4321"] and settings.announce_maddrs == found.reached
    assert said.startswith("reachable: /ip4/10.90.0.10 connected back to /ip4/10.90.0.11/tcp/4321")
    forwarded = PeerSettings(host_maddrs=["/ip4/0.0.0.0/tcp/4011"], announce_maddrs=["/ip4/1.2.3.4/tcp/4011"])
    assert decide(forwarded, found)[0] == forwarded  # a volunteer's own announce addresses stay as given
    assert listen_on(["/ip4/0.0.0.0/tcp/0", "/ip6/::/tcp/0", "/ip4/0.0.0.0/tcp/7"], {"ip4": 5}) == [
        "/ip4/0.0.0.0/tcp/5",
        "/ip6/::/tcp/0",
        "/ip4/0.0.0.0/tcp/7",
    ]


def test_an_unreachable_peer_joins_as_a_client_and_says_so_in_plain_words():
    settings, said = decide(JOINING, Reachability(False, checker="/ip4/10.90.0.10"))
    assert settings.client_mode and said == BEHIND_NAT + "\n"
    _, said = decide(JOINING, Reachability(False, checker="/ip4/10.90.0.10", checker_averages=False))
    assert "warning: /ip4/10.90.0.10, which checked, takes no part in averaging" in said
    settings, said = decide(JOINING, Reachability(None))
    assert not settings.client_mode and said.startswith("warning: could not check")
    assert "--reachability client" in said


def test_the_first_peer_and_the_explicit_choices_ask_nobody():
    quiet = Console(file=io.StringIO())
    assert choose_reachability(PeerSettings(), quiet) == PeerSettings()  # the first peer: nobody to ask
    assert choose_reachability(PeerSettings(reachability="client"), quiet).client_mode
    public = PeerSettings(initial_peers=JOINING.initial_peers, reachability="public")
    assert choose_reachability(public, quiet) == public


def test_the_old_client_mode_flag_is_reachability_client_with_a_notice():
    result = run_ttt("train", "--client-mode", "--run-id", "x", "--preset", "nope", check=False)
    assert "note: --client-mode is now --reachability client; the old form works for now" in result.stderr
    assert result.returncode == 2 and "'nope' is not one of" in result.stderr  # parsed on, as --reachability client


def test_initial_peers_that_nobody_answers_are_refused_in_seconds_not_after_the_bootstrap_timeouts():
    peer_id = FIRST_PEER.split("/p2p/")[1]
    with socket.socket() as closed:  # a port that was free a moment ago: connections to it are refused
        closed.bind(("127.0.0.1", 0))
        dead = f"/ip4/127.0.0.1/tcp/{closed.getsockname()[1]}/p2p/{peer_id}"
    began = time.monotonic()
    refused = r"cannot reach any of --initial-peers \(127.0.0.1:\d+ refused the connection: nothing listens there\)"
    with pytest.raises(JoinError, match=refused):
        refuse_silent_initial_peers([dead], timeout=2.0)
    assert time.monotonic() - began < 2.0  # a refused connection is an answer at once; a dropped one waits TIMEOUT
    with socket.create_server(("127.0.0.1", 0)) as listening:  # one live peer among dead ones is enough
        alive = f"/ip4/127.0.0.1/tcp/{listening.getsockname()[1]}/p2p/{peer_id}"
        refuse_silent_initial_peers([dead, alive], timeout=2.0)
    refuse_silent_initial_peers([f"/ip4/127.0.0.1/udp/9/quic/p2p/{peer_id}"])  # another transport: hivemind tries it


def test_an_address_where_something_else_listens_is_one_line_from_ttt_status():
    peer_id = FIRST_PEER.split("/p2p/")[1]
    with socket.create_server(("127.0.0.1", 0)) as listening:  # answers TCP, speaks no libp2p: p2pd cannot bootstrap
        address = f"/ip4/127.0.0.1/tcp/{listening.getsockname()[1]}/p2p/{peer_id}"
        result = run_ttt("status", address, check=False, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    failed = "Daemon failed to start: failed to connect to bootstrap peers"
    assert result.stderr.strip().splitlines() == [  # tried twice: a busy peer or a slow link can fail the first time
        f"could not connect to the initial peers ({failed}); trying again",
        f"Error: cannot join the swarm at {address} ({failed}); check the address and that the peer there is running",
    ]


def test_the_addresses_printed_for_others_leave_out_loopback_unless_there_is_nothing_else():
    visible = ["/ip4/127.0.0.1/tcp/4011/p2p/X", "/ip4/10.90.0.10/tcp/4011/p2p/X", "/ip6/::1/tcp/4012/p2p/X"]
    assert reachable_addresses(visible) == ["/ip4/10.90.0.10/tcp/4011/p2p/X"]
    assert reachable_addresses(visible[:1]) == visible[:1]  # a run on one machine (--host-maddrs /ip4/127.0.0.1/...)


class Prober:
    """Stands in for the checker's p2pd: records its shutdown."""

    down = False

    async def shutdown(self) -> None:
        self.down = True


async def prober_after(seconds: float, checking: int) -> tuple[Prober, DialBackServer]:
    server = DialBackServer(averages=True)
    server.prober, server.checking, server.last_check = Prober(), checking, time.monotonic()
    prober = server.prober
    retiring = asyncio.create_task(server.retire_when_idle())
    await asyncio.sleep(seconds)
    retiring.cancel()
    return prober, server


def test_the_checkers_second_p2pd_ends_once_idle_but_never_during_a_check(monkeypatch):
    monkeypatch.setattr(reachability, "PROBER_IDLE", 0.05)
    prober, server = asyncio.run(prober_after(0.3, checking=0))
    assert prober.down and server.prober is None  # the next check starts a new one
    prober, server = asyncio.run(prober_after(0.3, checking=1))
    assert not prober.down and server.prober is prober


def sender_gone() -> None:
    """What unpickling a connection does once its sender's process has exited (multiprocessing's resource_sharer)."""
    raise EOFError


class ConnectionOfAnExitedSender:
    def __reduce__(self):
        return sender_gone, ()


def test_a_request_whose_sender_exited_while_it_was_read_is_an_error_hiveminds_loop_reads_past():
    """The DHT's process read a request carrying a connection whose sender had exited, and died with a traceback on
    the peer's console (clean-clone run 97): hivemind's loop catches ConnectionError, not EOFError. The next request
    reads as usual; a pipe closed at its other end still ends the process (EOFError)."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    writer.send(("get", (ConnectionOfAnExitedSender(),), {}))
    writer.send(("get", ("key",), {}))
    with pytest.raises(ConnectionError, match="its sender has likely exited"):
        receive_request(reader)
    assert receive_request(reader) == ("get", ("key",), {})
    writer.close()
    with pytest.raises(EOFError):
        receive_request(reader)


@pytest.mark.parametrize("attempt", range(3))  # the DHT of hivemind alone died in 5 of 8 such runs
def test_requests_to_the_dht_from_several_threads_arrive_whole(attempt):
    """Four threads storing records of ~30 KB (each sent in two writes) while reading: with hivemind's own `DHT` the
    writes interleave, or the process reads half a message from its non-blocking pipe, and dies (BlockingIOError,
    then EOFError or UnpicklingError); `WholeRequestsDHT` reads each whole."""
    from hivemind.utils import get_dht_time

    from training.swarm.dht import start_local_dht

    dht = start_local_dht()
    value = list(range(6000))

    def store_and_read(thread: int) -> None:
        for _ in range(50):
            dht.store(f"key{thread}", value, get_dht_time() + 60, return_future=True)
            dht.get(f"key{thread}", return_future=True)

    try:
        threads = [threading.Thread(target=store_and_read, args=(thread,), daemon=True) for thread in range(4)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        assert not any(thread.is_alive() for thread in threads)  # a dead DHT process blocks the senders for good
        assert dht.get("key0", latest=True, return_future=True).result(timeout=30).value == value
        assert dht.is_alive()
    finally:
        if dht.is_alive():
            dht.shutdown()
