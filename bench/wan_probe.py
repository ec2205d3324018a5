"""What a hivemind peer can learn about its own reachability, and what circuit relays do, on the NAT testbed.

Each node is a bare `hivemind.P2P` (its p2pd, no DHT, no trainer) in a testbed host, driven over its stdin with
JSON commands and reporting JSON events on its stdout. Two experiments:

reachability  public hosts pub0 (the "initial peer", which serves the dial-back), pub1, and pub2 (firewalled: a
              public address, new inbound connections dropped); homes home0, and home1 (its router forwards a port
              to it), all joining pub0. For --watch seconds every node records what p2pd says of it: its addresses
              (`identify`, as `P2P.get_visible_maddrs(latest=True)` reads them) and AutoNAT's verdicts from p2pd's
              own log (GOLOG_LOG_LEVEL=autonat=debug), each with the seconds since the node started. Each
              non-initial node asks pub0 to dial it back (the dial-back check, training/swarm/reachability.py),
              --asks times, and each host then runs `check_reachability` in a fresh process, as `ttt train` does
              before its DHT starts.
relay         pub0 (the relay: p2pd offers relay v2 service by default), home0 and home1 with
              `use_auto_relay=True` (--force-private: also `force_reachability="private"`; --static-relay: pub0 as
              the homes' static relay, p2pd -relayDiscovery=0; --second-public: a pub1, so that AutoNAT can find
              pub0 public). Records when home0 gets a /p2p-circuit address, whether home1 can open a connection to
              home0 through it, two bulk transfers over it (--settle seconds apart: did hole punching, DCUtR, on
              with AutoNAT, replace the relayed connection by a direct one?), and p2pd's relay log lines.

    PYTHONPATH=. python -m bench.wan_probe reachability [--runs 3] [--public-net 11.90.0]
    PYTHONPATH=. python -m bench.wan_probe relay [--runs 3] [--public-net 11.90.0] [--force-private]
        [--static-relay] [--second-public] [--relay-flags '{"relayDataLimit": 1073741824}']
    PYTHONPATH=. python -m bench.wan_probe probe INITIAL_PEER HOST_MADDR     (one check_reachability, JSON out)

libp2p counts 10.0.0.0/8 as private: AutoNAT servers refuse to dial back such an address and hole punching waits
for a public address, so on the testbed's default 10.90.0.0/24 neither can work as it would on the Internet. Both
experiments take --public-net: a /24 of globally routable form (11.90.0 here) that only exists inside the
testbed's namespaces (the core routes nothing else), to see libp2p behave as it would on real addresses.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.common import save_results
from bench.wan import earlier_runs
from tests.support.netns import Testbed, can_build
from training.swarm.processes import add_p2pd_flags
from training.swarm.reachability import DIAL_BACK, DialBackServer, ask, check_reachability, connect

ROOT = Path(__file__).resolve().parents[1]
BULK = "ttt.Bulk"
FORWARDED = 4011  # the port home1's router forwards to it (reachability)
GO_LOGS = "error,autonat=debug,autorelay=debug,p2p-holepunch=debug,relay=debug,p2p-circuit=debug"
INTERESTING = ("NAT status", "reachab", "reservation", "hole punch", "holepunch", "relay", "direct connection")
console = Console(width=140)


# ---------------------------------------------------------------- the node (runs inside a testbed host)


def emit(started: float, event: str, **fields) -> None:
    print(json.dumps({"t": round(time.monotonic() - started, 2), "event": event, **fields}), flush=True)


class GoLogTap(logging.Handler):
    """Passes p2pd's own log lines about NAT, relays and hole punching on as events."""

    def __init__(self, started: float) -> None:
        super().__init__(logging.DEBUG)
        self.started = started

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if any(word.lower() in message.lower() for word in INTERESTING):
            emit(self.started, "golog", caller=getattr(record, "caller", ""), msg=message[:300])


async def serve_bulk(info, reader, writer) -> None:
    from hivemind.p2p import P2P

    size = 0
    while True:
        chunk = await P2P.receive_raw_data(reader)
        if not chunk:
            break
        size += len(chunk)
    await P2P.send_raw_data(str(size).encode(), writer)
    writer.close()


async def send_bulk(p2p, peer_id, megabytes: int) -> dict:
    """MEGABYTES to PEER_ID's bulk handler; the seconds it took and the connection's address."""
    from hivemind.p2p import P2P

    began = time.monotonic()
    info, reader, writer = await p2p.call_binary_stream_handler(peer_id, BULK)
    for _ in range(megabytes):
        await P2P.send_raw_data(b"x" * 2**20, writer)
    await P2P.send_raw_data(b"", writer)
    received = int(await P2P.receive_raw_data(reader))
    seconds = time.monotonic() - began
    writer.close()
    return {"via": str(info.addr), "bytes": received, "seconds": round(seconds, 2),
            "mbit_s": round(received * 8 / seconds / 1e6, 1)}  # fmt: skip


async def ask_dial_back(p2p, initial_peer: str) -> dict:
    """The dial-back check as a running node asks it (training/swarm/reachability.py)."""
    began = time.monotonic()
    own = [str(a) for a in await p2p.get_visible_maddrs(latest=True)]
    answer = await ask(p2p, initial_peer, own)
    return {**answer, "reachable": bool(answer["reached"]), "seconds": round(time.monotonic() - began, 2)}


def probe_main(initial: str, host_maddrs: list[str]) -> None:
    """The check as `ttt train` runs it before its DHT starts (a throwaway p2pd), timed in a fresh process."""
    started = time.monotonic()
    found = asyncio.run(check_reachability([initial], host_maddrs, []))
    emit(started, "probe", **dataclasses.asdict(found))


def varint(number: int) -> bytes:
    out = b""
    while True:
        low, number = number & 0x7F, number >> 7
        if not number:
            return out + bytes([low])
        out += bytes([low | 0x80])


def go_multiaddr(address: str):
    """ADDRESS as p2pd can read it. hivemind's multiaddr encodes a /p2p/ component as a CIDv1 (0x01 0x72 ...), which
    p2pd's go-multiaddr rejects ("length greater than remaining number of bytes in buffer"); so a relay's circuit
    address (/ip4/../tcp/../p2p/RELAY/p2p-circuit) cannot be handed to `connect` as hivemind writes it. Here the
    peer id goes in as its raw multihash, as libp2p writes it."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    out = b""
    for chunk in re.split(r"(/p2p/[^/]+)", address):
        if chunk.startswith("/p2p/"):
            multihash = PeerID.from_base58(chunk[len("/p2p/") :]).to_bytes()
            out += varint(421) + varint(len(multihash)) + multihash
        elif chunk:
            out += Multiaddr(chunk).to_bytes()
    return Multiaddr(out)


async def run_command(p2p, started: float, command: dict) -> None:
    from hivemind.p2p import PeerID

    kind = command["cmd"]
    try:
        if kind == "dial_back":
            emit(started, "dial_back", **await ask_dial_back(p2p, command["server"]))
        elif kind == "connect":
            began, peer = time.monotonic(), PeerID.from_base58(command["peer"])
            addrs = [go_multiaddr(a) for a in command["addrs"]]
            await connect(p2p, peer, addrs, command.get("timeout", 20))
            emit(started, "connected", seconds=round(time.monotonic() - began, 2))
        elif kind == "bulk":
            emit(started, "bulk", **await send_bulk(p2p, PeerID.from_base58(command["peer"]), command["mb"]))
    except Exception as err:  # noqa: BLE001 (every failure is a result here)
        emit(started, f"{kind}_failed", error=f"{type(err).__name__}: {str(err)[:300]}")


async def watch(p2p, started: float) -> None:
    """Report the node's addresses and its connections whenever they change."""
    addrs, peers = None, None
    while True:
        try:
            now = sorted(str(a) for a in await p2p.get_visible_maddrs(latest=True))
        except ValueError:  # no addresses at all (yet)
            now = []
        if now != addrs:
            addrs = now
            emit(started, "addrs", addrs=now)
        connected = sorted(f"{info.peer_id} {a}" for info in await p2p.list_peers() for a in info.addrs)
        if connected != peers:
            peers = connected
            emit(started, "peers", peers=connected)
        await asyncio.sleep(0.5)


async def node_main(options: dict, serve: bool) -> None:
    from hivemind.p2p import P2P

    add_p2pd_flags(options.pop("p2pd_flags", {}))
    started = time.monotonic()
    logger = logging.getLogger("hivemind.p2p.p2p_daemon")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(GoLogTap(started))
    p2p = await P2P.create(**options)
    emit(started, "started", peer_id=str(p2p.peer_id), addrs=[str(a) for a in await p2p.get_visible_maddrs()])
    await p2p.add_binary_stream_handler(BULK, serve_bulk)
    if serve:
        await p2p.add_binary_stream_handler(DIAL_BACK, DialBackServer(averages=True).handle)
    watcher = asyncio.create_task(watch(p2p, started))
    lines = asyncio.Queue()
    loop = asyncio.get_running_loop()
    threading.Thread(
        target=lambda: [loop.call_soon_threadsafe(lines.put_nowait, x) for x in sys.stdin], daemon=True
    ).start()
    while (line := await lines.get()).strip() != '{"cmd": "quit"}':
        asyncio.create_task(run_command(p2p, started, json.loads(line)))
    watcher.cancel()
    await p2p.shutdown()


# ---------------------------------------------------------------- the orchestrator


class Node:
    """A node process on a testbed host: commands in, timestamped events out."""

    def __init__(self, net: Testbed, host: str, options: dict, serve: bool = False, logs: Path | None = None) -> None:
        argv = [sys.executable, "-m", "bench.wan_probe", "node", json.dumps(options)] + (["--serve"] if serve else [])
        env = {**os.environ, "PYTHONPATH": str(ROOT), "GOLOG_LOG_LEVEL": GO_LOGS}
        stderr = (logs / f"{host}.err").open("w") if logs else subprocess.DEVNULL
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": stderr}
        self.process = net.popen(host, argv, text=True, env=env, cwd=ROOT, **pipes)
        self.events: list[dict] = []
        self.fresh: queue.Queue = queue.Queue()
        threading.Thread(target=self.read, daemon=True).start()
        self.info = self.wait("started", 30)

    def read(self) -> None:
        for line in self.process.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                event = json.loads(line)
                self.events.append(event)
                self.fresh.put(event)

    def send(self, **command) -> None:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def wait(self, prefix: str, timeout: float, test=lambda event: True) -> dict | None:
        """The first event (from now on) whose name starts with PREFIX and that passes TEST; None on timeout."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(queue.Empty):
                event = self.fresh.get(timeout=left)
                if event["event"].startswith(prefix) and test(event):
                    return event
        return None

    def first(self, name: str, test=lambda event: True) -> dict | None:
        return next((e for e in self.events if e["event"] == name and test(e)), None)

    def address_on(self, prefix: str) -> str:
        return next(a for a in self.info["addrs"] if a.startswith(f"/ip4/{prefix}"))

    def quit(self) -> None:
        with contextlib.suppress(OSError):
            self.send(cmd="quit")


def nat_verdicts(node: Node) -> list[tuple[float, str]]:
    return [(e["t"], e["msg"]) for e in node.events if e["event"] == "golog" and "NAT status" in e["msg"]]


REACHABILITY_HOSTS = {  # testbed host -> what it is
    "pub1": "public",
    "pub2": "public address, firewalled",
    "home0": "behind NAT",
    "home1": f"behind NAT, port {FORWARDED} forwarded",
}


def reachability_run(args: argparse.Namespace) -> dict:
    """One run of the reachability experiment: AutoNAT's verdicts and the dial-back's answers per node."""
    base = {"host_maddrs": ["/ip4/0.0.0.0/tcp/0"]}
    with Testbed(public=3, homes=2, public_net=args.public_net, uplink=args.rate, downlink=args.rate) as net:
        net.block_inbound("pub2")
        net.forward_port("home1", FORWARDED)
        server = Node(net, "pub0", base, serve=True, logs=args.run_logs)
        initial, server_id = server.address_on(args.public_net), server.info["peer_id"]
        nodes = {}
        for name in REACHABILITY_HOSTS:
            own = {"host_maddrs": [f"/ip4/0.0.0.0/tcp/{FORWARDED}"]} if name == "home1" else base
            nodes[name] = Node(net, name, {**own, "initial_peers": [initial]}, logs=args.run_logs)
        answers: dict[str, list[dict]] = {name: [] for name in nodes}
        fresh: dict[str, dict] = {}
        for node in nodes.values():  # asked once the bootstrap connection is up, as a trainer would
            node.wait("peers", 20, lambda e: any(p.startswith(server_id) for p in e["peers"]))
        for _ in range(args.asks):
            for name, node in nodes.items():
                node.send(cmd="dial_back", server=initial)
                answers[name].append(node.wait("dial_back", 30) or {"event": "timeout"})
        for name in nodes:  # a fresh process as a trainer would start: throwaway p2pd, ask, gone
            host_maddrs = f"/ip4/0.0.0.0/tcp/{FORWARDED + 1 if name == 'home1' else 0}"
            if name == "home1":
                net.forward_port("home1", FORWARDED + 1)
            argv = [sys.executable, "-m", "bench.wan_probe", "probe", initial, host_maddrs]
            began = time.monotonic()
            out = net.run(name, argv, timeout=60).stdout.strip().splitlines()
            answer = json.loads(out[-1]) if out else {"event": "probe_failed"}
            fresh[name] = {**answer, "process_seconds": round(time.monotonic() - began, 2)}
        time.sleep(max(0.0, args.watch - max(e["t"] for n in nodes.values() for e in n.events)))
        for node in [server, *nodes.values()]:
            node.quit()
        time.sleep(1)
    results = {}
    for name, node in nodes.items():
        verdicts = nat_verdicts(node)
        results[name] = {
            "is": REACHABILITY_HOSTS[name],
            "autonat": verdicts,
            "first_verdict_seconds": verdicts[0][0] if verdicts else None,
            "addrs_seen": sorted({a for e in node.events if e["event"] == "addrs" for a in e["addrs"]}),
            "dial_back": answers[name],
            "fresh_probe": fresh.get(name),
        }
    return results


def relay_run(args: argparse.Namespace) -> dict:
    """One run of the relay experiment: circuit addresses, a connection through them, its throughput, DCUtR."""
    home = {"host_maddrs": ["/ip4/0.0.0.0/tcp/0"], "use_auto_relay": True}
    if args.force_private:
        home["force_reachability"] = "private"
    if args.static_relay:  # no discovery: the relay is a static one (p2pd then wants it named, see below)
        home["p2pd_flags"] = {"relayDiscovery": 0}
    out: dict = {}
    public = 2 if args.second_public else 1
    with Testbed(public=public, homes=2, public_net=args.public_net, uplink=args.rate, downlink=args.rate) as net:
        relay_options = {"host_maddrs": ["/ip4/0.0.0.0/tcp/0"], "p2pd_flags": json.loads(args.relay_flags)}
        relay = Node(net, "pub0", relay_options, logs=args.run_logs)
        initial = relay.address_on(args.public_net)
        if args.second_public:  # a public peer whose AutoNAT service can tell the relay that it is public
            others = [Node(net, "pub1", {"host_maddrs": ["/ip4/0.0.0.0/tcp/0"], "initial_peers": [initial]})]
            out["relay_public_seconds"] = (
                relay.wait("golog", 30, lambda e: "NAT status is public" in e["msg"]) or {}
            ).get("t")
            time.sleep(2)
        if args.static_relay:
            home["trusted_relays"] = [initial]
        homes = {
            name: Node(net, name, {**home, "initial_peers": [initial]}, logs=args.run_logs)
            for name in ("home0", "home1")
        }
        circuit = homes["home0"].wait("addrs", args.watch, lambda e: any("p2p-circuit" in a for a in e["addrs"]))
        out["circuit_addr_seconds"] = circuit["t"] if circuit else None
        out["home0_addrs"] = circuit["addrs"] if circuit else homes["home0"].events[-1:]
        target = homes["home0"].info["peer_id"]
        addrs = [a for a in (circuit or {}).get("addrs", []) if "p2p-circuit" in a]
        if not addrs:  # no reservation: try the relay's circuit address all the same
            addrs = [f"{initial}/p2p-circuit"]
        homes["home1"].send(cmd="connect", peer=target, addrs=[a.split("/p2p/" + target)[0] for a in addrs])
        out["connect"] = homes["home1"].wait("connect", 30)
        if out["connect"] and out["connect"]["event"] == "connected":
            homes["home1"].send(cmd="bulk", peer=target, mb=args.megabytes)
            out["bulk_first"] = homes["home1"].wait("bulk", 120)
            time.sleep(args.settle)
            homes["home1"].send(cmd="bulk", peer=target, mb=args.megabytes)
            out["bulk_later"] = homes["home1"].wait("bulk", 120)
        out["home1_connections"] = [e for e in homes["home1"].events if e["event"] == "peers"][-1:]
        out["golog"] = {n: [e["msg"][:160] for e in h.events if e["event"] == "golog"][:12] for n, h in homes.items()}
        for node in [relay, *homes.values(), *(others if args.second_public else [])]:
            node.quit()
        time.sleep(1)
    return out


def show_reachability(runs: list[dict]) -> None:
    table = Table(title=f"reachability: {len(runs)} run(s)")
    columns = ("run", "node", "is", "AutoNAT verdicts (s: msg)", "dial-back (reachable, s)", "fresh probe", "addresses")
    for column in columns:
        table.add_column(column, overflow="fold")
    for k, run in enumerate(runs):
        for name, r in run.items():
            verdicts = "; ".join(f"{t:.0f}: {m}" for t, m in r["autonat"]) or "none"
            asks = ", ".join(f"{a.get('reachable')} {a.get('seconds')}" for a in r["dial_back"])
            probe = r.get("fresh_probe") or {}
            fresh = f"{probe.get('reachable')} {probe.get('seconds', 0):.2f} s"
            table.add_row(str(k + 1), name, r["is"], verdicts, asks, fresh, " ".join(r["addrs_seen"])[:200])
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", choices=["reachability", "relay", "node"])
    parser.add_argument("options", nargs="?", default="{}", help="(node) P2P.create options, JSON")
    parser.add_argument("--serve", action="store_true", help="(node) serve the dial-back")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--public-net", default="10.90.0", help="the bridge's /24 (see above)")
    parser.add_argument("--rate", default="20mbit", help="every link's rate")
    parser.add_argument("--watch", type=float, default=60, help="seconds to watch what p2pd reports")
    parser.add_argument("--asks", type=int, default=2, help="(reachability) dial-back requests per node")
    parser.add_argument("--force-private", action="store_true", help="(relay) homes force AutoNAT to private")
    parser.add_argument("--static-relay", action="store_true", help="(relay) p2pd -relayDiscovery=0 on homes")
    parser.add_argument(
        "--relay-flags", default="{}", help='(relay) p2pd flags of the relay, JSON: {"relayDataLimit": 1e9}'
    )
    parser.add_argument("--second-public", action="store_true", help="(relay) a second public peer (pub1)")
    parser.add_argument("--megabytes", type=int, default=8, help="(relay) size of each bulk transfer")
    parser.add_argument("--logs", default=None, help="folder for the nodes' stderr [default: a temporary one]")
    parser.add_argument("--settle", type=float, default=20, help="(relay) seconds between the two transfers")
    if sys.argv[1:2] == ["probe"]:  # probe INITIAL HOST_MADDR: probe_reachability in a fresh process
        probe_main(sys.argv[2], [sys.argv[3]])
        return
    args = parser.parse_args()
    if args.experiment == "node":
        asyncio.run(node_main(json.loads(args.options), args.serve))
        return
    if (why := can_build()) is not None:
        sys.exit(f"cannot build the NAT testbed: {why}")
    started = time.perf_counter()
    run = reachability_run if args.experiment == "reachability" else relay_run
    logs, runs = Path(args.logs or tempfile.mkdtemp(prefix="ttt-wan-probe-")), []
    for k in range(args.runs):
        args.run_logs = logs / f"run{k + 1}"
        args.run_logs.mkdir(parents=True, exist_ok=True)
        runs.append(run(args))
    console.print(f"p2pd logs in {logs}")
    if args.experiment == "reachability":
        show_reachability(runs)
    else:
        console.print_json(data=runs)
    name = f"{args.experiment} {args.public_net}" + (" force-private" if args.force_private else "")
    name += (
        (" static-relay" if args.static_relay else "")
        + (" +pub1" if args.second_public else "")
        + (f" relay {args.relay_flags}" if args.relay_flags != "{}" else "")
    )
    settings = {k: v for k, v in vars(args).items() if k not in ("run_logs", "options")}
    runs = earlier_runs(name) + runs  # a scenario's runs add up over invocations
    save_results("wan", {name: {"settings": settings, "runs": runs}}, started, console, keep_other_parts=True)


if __name__ == "__main__":
    main()
