"""Whether other peers can open connections to this machine, found by the peer itself before it joins a run.

A volunteer behind a home router (NAT) cannot accept connections. As a full hivemind peer it announces its private
addresses (192.168.x.y), the others dial them in vain, hivemind prints raw errors, and rounds wait for the whole
averaging timeout (measured on the NAT testbed, tests/support/netns.py: 5% of rounds held every peer). So a peer
that joins (--initial-peers) first asks an initial peer to dial it back, the "ttt.DialBack" check:

- the asking peer starts a throwaway p2pd on the DHT's own listen addresses, connects to an initial peer, and sends
  the addresses it listens on;
- the checker (every full peer and every monitor serves the check) dials back only the IP the connection came from,
  as libp2p's AutoNAT does (never an address the asker merely claims, which could point into the checker's own
  network), at the asker's ports: a TCP connect first, then a libp2p connect from a p2pd of a fresh identity (its
  own p2pd already holds a connection to the asker), which proves the asker's peer id is behind the address;
- reached: the peer listens on the same port and announces exactly the addresses that were reached; not reached: it
  joins in hivemind's client mode and listens nowhere (it sends its parts to reachable peers); no answer (no
  initial peer serves the check, an older ttt): it joins as before, a full peer, and says it could not check.

Not libp2p's AutoNAT, which hivemind's p2pd runs: hivemind 1.1.12 cannot read its verdict from Python, and it never
judges a 10.x address. Not circuit relays either: hivemind 1.1.12's p2pd caps a relayed connection at 128 KiB and
found its relay minutes late on the testbed, useless for averaging. Measured on the testbed (bench/wan_probe.py):
72 checks of 72 right; 0.3-0.7 s when reachable, about 3.5 s when not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from dataclasses import dataclass, field

DIAL_BACK = "ttt.DialBack"  # the stream handler's name
DIAL_TIMEOUT = 3.0  # seconds per address the checker dials back
ASK_TIMEOUT = 10.0  # seconds one initial peer has to answer
# The check's own p2pd processes (the asker's, the checker's prober) live for seconds: no relay, no AutoNAT, no UPnP,
# and a client of libp2p's DHT, or the run's p2pd would keep their (private) addresses and dial them for minutes.
THROWAWAY = {"dht_mode": "client", "use_relay": False, "auto_nat": False, "nat_port_map": False}
MAX_CANDIDATES = 4  # addresses the checker dials back at most (the observed IP, a few ports)
# The checker's prober is a second p2pd beside the peer's own (70 MB private, measured): it is shut down once no
# check has used it for this many seconds, and started again at the next check (a newcomer's check waits ~0.5 s more).
PROBER_IDLE = 30.0

logger = logging.getLogger("hivemind.ttt.reachability")  # to hivemind's log file, with hivemind's own lines


@dataclass
class Reachability:
    """What the dial-back check found."""

    reachable: bool | None  # None: no initial peer answered the check
    reached: list[str] = field(default_factory=list)  # where the checker connected to this peer: /ip4/IP/tcp/PORT
    ports: dict[str, int] = field(default_factory=dict)  # the TCP port the check listened on, per ip4 / ip6
    checker: str = ""  # the address of the initial peer that checked
    checker_averages: bool = True  # whether the checker itself takes part in averaging rounds
    seconds: float = 0.0


def tcp_ports(addresses: list[str]) -> dict[str, int]:
    """{"ip4": port, "ip6": port} of the TCP addresses among ADDRESSES (the first one of each family)."""
    ports: dict[str, int] = {}
    for address in addresses:
        if found := re.match(r"^/(ip4|ip6)/[^/]+/tcp/(\d+)", address):
            ports.setdefault(found.group(1), int(found.group(2)))
    return ports


def dial_back_candidates(observed: str, claimed: list[str]) -> list[tuple[str, int]]:
    """(ip, port) pairs to dial back: the IP the asker's connection came from only, with its observed port and the
    TCP ports the asker claims to listen on."""
    found = re.match(r"^/(?:ip4|ip6)/([^/]+)/tcp/(\d+)", observed)
    if found is None:
        return []
    ports = [int(found.group(2))]
    ports += [int(m.group(1)) for address in claimed if (m := re.search(r"/tcp/(\d+)", address))]
    return [(found.group(1), port) for port in dict.fromkeys(ports)][:MAX_CANDIDATES]


def maddr(ip: str, port: int) -> str:
    return f"/{'ip6' if ':' in ip else 'ip4'}/{ip}/tcp/{port}"


async def tcp_open(ip: str, port: int, timeout: float = DIAL_TIMEOUT) -> bool:
    """Whether a TCP connection to IP:PORT (a host name too) opens within TIMEOUT seconds."""
    return await why_not_accepted(ip, port, timeout) is None


async def why_not_accepted(host: str, port: int, timeout: float) -> str | None:
    """Why a TCP connection to HOST:PORT did not open within TIMEOUT seconds, in a few words; None when it did."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except asyncio.TimeoutError:
        return f"no answer at {host}:{port} within {timeout:.0f} s"
    except ConnectionRefusedError:
        return f"{host}:{port} refused the connection: nothing listens there"
    except OSError as err:
        return f"{host}:{port}: {err.strerror or err}"
    writer.close()
    return None


class DialBackServer:
    """The checker's side, inside the DHT's process: dial the asker back at its observed IP."""

    def __init__(self, averages: bool) -> None:
        self.averages = averages
        self.prober = None  # a p2pd of a fresh identity that listens nowhere, started by a check, ended when idle
        self.starting = asyncio.Lock()
        self.checking = 0  # checks that use the prober now
        self.last_check = 0.0  # time.monotonic() when the last check ended
        self.retiring: asyncio.Task | None = None  # the prober's shutdown once idle (held: asyncio keeps weak refs)

    async def handle(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One check: the asker's addresses in, the addresses at which it was reached out."""
        from hivemind.p2p import P2P

        try:
            request = json.loads(await P2P.receive_raw_data(reader))
            candidates = dial_back_candidates(str(info.addr), [str(a) for a in request.get("addrs", [])][:16])
            opened = await asyncio.gather(*(tcp_open(ip, port) for ip, port in candidates))
            open_ports = [maddr(ip, port) for (ip, port), ok in zip(candidates, opened, strict=True) if ok]
            reached = await self.verify(info.peer_id, open_ports)
            answer = {"reached": reached, "observed": str(info.addr), "averages": self.averages}
            await P2P.send_raw_data(json.dumps(answer).encode(), writer)
            logger.info(f"dial-back check for {info.peer_id} at {info.addr}: reached {reached or 'nothing'}")
        except Exception as err:  # noqa: BLE001 (a broken asker must not disturb the DHT's process)
            logger.info(f"dial-back check for {info.peer_id} failed: {err!r}")
        finally:
            writer.close()

    async def verify(self, peer_id, addresses: list[str]) -> list[str]:
        """The ADDRESSES at which a libp2p connect from a fresh identity reaches PEER_ID itself."""
        from hivemind.p2p import P2P
        from hivemind.utils.multiaddr import Multiaddr

        if not addresses:
            return []
        async with self.starting:
            if self.prober is None:
                self.prober = await P2P.create(**THROWAWAY, host_maddrs=[], no_listen=True)
                self.retiring = asyncio.create_task(self.retire_when_idle())
            prober, self.checking = self.prober, self.checking + 1
        reached = []
        try:
            for address in addresses:
                with contextlib.suppress(Exception):  # a failed dial is an answer: not reached there
                    await connect(prober, peer_id, [Multiaddr(address)], DIAL_TIMEOUT)
                    reached.append(address)
                with contextlib.suppress(Exception):
                    await prober._client.disconnect(peer_id)
        finally:
            self.checking, self.last_check = self.checking - 1, time.monotonic()
        return reached

    async def retire_when_idle(self) -> None:
        """Shut the prober down once no check has used it for PROBER_IDLE seconds."""
        while True:
            await asyncio.sleep(max(self.last_check + PROBER_IDLE - time.monotonic(), min(PROBER_IDLE, 1.0)))
            async with self.starting:
                if self.checking == 0 and time.monotonic() - self.last_check >= PROBER_IDLE:
                    prober, self.prober = self.prober, None
                    break
        await prober.shutdown()
        logger.info(f"dial-back prober idle for {PROBER_IDLE:.0f} s: shut down")


async def connect(p2p, peer_id, addresses: list, timeout: float) -> None:
    """A libp2p connection from P2P to PEER_ID at these multiaddresses, through its p2p daemon's client (hivemind's
    `P2P` has no public connect); raises when none is reached within TIMEOUT seconds."""
    await asyncio.wait_for(p2p._client.connect(peer_id, addresses), timeout)


async def serve_dial_back(_dht, node, averages: bool) -> None:
    """Inside the DHT's process (`DHT.run_coroutine`): answer the dial-back checks of peers that join."""
    await node.p2p.add_binary_stream_handler(DIAL_BACK, DialBackServer(averages).handle)


async def ask(p2p, initial_peer: str, own: list[str]) -> dict:
    """INITIAL_PEER's answer to this peer's dial-back check."""
    from hivemind.p2p import P2P, PeerID
    from hivemind.utils.multiaddr import Multiaddr

    checker = PeerID.from_base58(Multiaddr(initial_peer).value_for_protocol("p2p"))
    _, reader, writer = await p2p.call_binary_stream_handler(checker, DIAL_BACK)
    try:
        await P2P.send_raw_data(json.dumps({"addrs": own}).encode(), writer)
        return json.loads(await P2P.receive_raw_data(reader))
    finally:
        writer.close()


async def check_reachability(initial_peers: list[str], host_maddrs: list[str], announce: list[str]) -> Reachability:
    """Start a throwaway p2pd on HOST_MADDRS (announcing ANNOUNCE, if given), joined to INITIAL_PEERS, and ask them in
    turn to dial it back; the first answer decides."""
    from hivemind.p2p import P2P

    began = time.monotonic()
    p2p = await P2P.create(
        initial_peers=initial_peers,
        host_maddrs=host_maddrs,
        announce_maddrs=announce or None,
        **THROWAWAY,
    )
    try:
        own = [str(address) for address in await p2p.get_visible_maddrs()]
        for initial_peer in initial_peers:
            try:
                answer = await asyncio.wait_for(ask(p2p, initial_peer, own), ASK_TIMEOUT)
            except Exception as err:  # noqa: BLE001 (an older peer has no such handler: ask the next one)
                logger.info(f"dial-back check by {initial_peer} failed: {err!r}")
                continue
            return Reachability(
                reachable=bool(answer["reached"]),
                reached=answer["reached"],
                ports=tcp_ports(own),
                checker=initial_peer.split("/p2p/")[0],
                checker_averages=bool(answer.get("averages", True)),
                seconds=time.monotonic() - began,
            )
        return Reachability(None, ports=tcp_ports(own), seconds=time.monotonic() - began)
    finally:
        await p2p.shutdown()
