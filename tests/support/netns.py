"""A small Internet on one machine: public hosts and home networks behind NAT routers, in Linux network namespaces.

    with Testbed(public=1, homes=2, uplink="20mbit", downlink="20mbit") as net:
        server = net.popen("pub0", ["python", "-m", "http.server", "8000"])
        net.run("home0", ["curl", f"http://{net.hosts['pub0'].address}:8000/"], timeout=10)

The topology, all of it inside namespaces whose names start with this run's prefix (the machine's own network
is never touched; with the default `public_net`, nothing outside 10.90.0.0/24 and 192.168.0.0/16 is used):

    core      a namespace holding the bridge `br0` (10.90.0.1): the "Internet", every host's default route. It
              routes nothing further: a packet for an address that is not on the bridge (a private 192.168.x.y,
              say) is dropped silently, as the Internet drops it, so a dial to such an address times out
              instead of failing at once. It counts such dials per sender (`lost_dials`).
    pubI      a public host, 10.90.0.(10+I) on the bridge.
    rtrJ      home J's router: 10.90.0.(100+J) on the bridge, 192.168.(J+1).1 inside; nftables masquerades what
              leaves and drops (and counts: `dropped_inbound`) every new connection that comes in, as a home
              router without port forwards does.
    homeJ     the host behind it, 192.168.(J+1).2, default route via its router.

`public_net` replaces 10.90.0 (libp2p counts 10.0.0.0/8 as private, so its AutoNAT and hole punching never act on
the default net; a globally routable /24 makes them act as on the Internet, and stays inside the namespaces).
`forward_port(home, port)` opens a port forward on a home's router; `block_inbound(host)` firewalls a public host;
`wire_bytes()` says what crossed each host's Internet link. With `uplink`/`downlink`, every host's link is shaped
with `tc tbf` (this kernel has no netem, so no delay or loss): the uplink on the host's own interface, the
downlink on the other end of its cable. Each `popen` runs in a session of its own; leaving the `with` kills what
is still running there and deletes every namespace (and with them every veth and the bridge). Namespaces left by
a crashed run (its process id is in their name) are removed by the next `Testbed` or by `remove_leftovers()`.
`can_build()` says why this machine cannot build one (None if it can).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

PREFIX = "tttwan"  # every namespace of every run: PREFIX-<pid>-<token>-<role>
PUBLIC_NET = "10.90.0"
BRIDGE = "br0"

ROUTER_RULES = """
table ip nat {
    chain postrouting { type nat hook postrouting priority srcnat; oifname "wan0" masquerade; }
}
table inet home {
    chain forward {
        type filter hook forward priority filter; policy accept;
        ct state established,related accept
        iifname "wan0" counter drop
    }
    chain input {
        type filter hook input priority filter; policy accept;
        ct state established,related accept
        iifname "wan0" counter drop
    }
}
"""
# A public host's own firewall (block_inbound): the router's input chain.
PUBLIC_FIREWALL = ROUTER_RULES[ROUTER_RULES.index("table inet home") :]
# What the core drops silently: private and loopback destinations, as the Internet does. (Routes, not an nft
# forward chain: with br_netfilter loaded, bridged packets pass the forward hook too and would be dropped.)
UNROUTABLE = ("192.168.0.0/16", "172.16.0.0/12", "10.0.0.0/8", "127.0.0.0/8", "default")
# The core counts, per sender, the connections hosts try to open to such addresses (TCP SYNs, retries included).
# It also keeps where they went (sender . destination . port): a failed test can say whose address leaked.
CORE_RULES = """table inet core {
  set lost { type ipv4_addr . ipv4_addr . inet_service; flags dynamic; }
  chain dials { type filter hook prerouting priority filter; policy accept; }
}"""
LOST_DIAL = 'ip saddr {sender} ip daddr != {net}.0/24 ip daddr {{ 192.168.0.0/16, 172.16.0.0/12, 10.0.0.0/8 }} \
tcp flags & (syn | ack) == syn add @lost {{ ip saddr . ip daddr . tcp dport }} counter comment "{name}"'


class TestbedError(RuntimeError):
    """A command that builds or removes the testbed failed."""


def sh(*argv: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run one setup command; a failure raises TestbedError with what the command said."""
    result = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise TestbedError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def in_ns(netns: str, *argv: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return sh("ip", "netns", "exec", netns, *argv, stdin=stdin)


@dataclass
class Host:
    """A machine of the testbed: where its commands run and how the others see it."""

    name: str  # pub0, home1...
    netns: str
    address: str  # its own address
    public_address: str  # the address the bridge sees its packets from: its router's for a home host
    behind_nat: bool
    router: str | None = None  # a home host's router's namespace
    interface: str = "eth0"


@dataclass
class Testbed:
    """A topology of `public` public hosts and `homes` NATed homes, built on entering and removed on leaving."""

    __test__ = False  # not a pytest test class, whatever its name

    public: int = 1
    homes: int = 2
    public_net: str = PUBLIC_NET  # the bridge's /24; libp2p counts 10.0.0.0/8 as private
    uplink: str | None = None  # a tc rate such as "20mbit"
    downlink: str | None = None
    home_rate: str | None = None  # the homes' links both ways, where they differ from the public hosts' (None: same)
    public_rates: tuple[str, ...] = ()  # pub0's, pub1's... links both ways, where they differ from uplink/downlink
    burst: str = "32kbit"
    hosts: dict[str, Host] = field(default_factory=dict)
    namespaces: list[str] = field(default_factory=list)
    processes: list[subprocess.Popen] = field(default_factory=list)
    prefix: str = ""

    def __enter__(self) -> Testbed:
        remove_leftovers()
        self.prefix = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def namespace(self, role: str) -> str:
        name = f"{self.prefix}-{role}"
        sh("ip", "netns", "add", name)
        self.namespaces.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
        return name

    def cable(self, a: str, a_if: str, b: str, b_if: str) -> None:
        """A veth pair between namespaces A and B, both ends up."""
        sh("ip", "link", "add", a_if, "netns", a, "type", "veth", "peer", "name", b_if, "netns", b)
        sh("ip", "-n", a, "link", "set", a_if, "up")
        sh("ip", "-n", b, "link", "set", b_if, "up")

    def shape(self, netns: str, interface: str, rate: str | None) -> None:
        if rate:
            tbf = ["rate", rate, "burst", self.burst, "latency", "400ms"]
            sh("ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", interface, "root", "tbf", *tbf)

    def build(self) -> None:
        core = self.namespace("core")
        sh("ip", "-n", core, "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "-n", core, "link", "set", BRIDGE, "up")
        sh("ip", "-n", core, "addr", "add", f"{self.public_net}.1/24", "dev", BRIDGE)
        in_ns(core, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for prefix in UNROUTABLE:
            sh("ip", "-n", core, "route", "add", "blackhole", prefix)
        in_ns(core, "nft", "-f", "-", stdin=CORE_RULES)
        for i in range(self.public):
            self.add_public_host(core, i)
        for j in range(self.homes):
            self.add_home(core, j)

    def plug_into_bridge(self, core: str, netns: str, interface: str, port: str, address: str, name: str) -> None:
        """Cable INTERFACE of NETNS to the bridge (as PORT), give it ADDRESS, route everything else via the core
        (which counts the connections NAME tries to open to private addresses)."""
        self.cable(netns, interface, core, port)
        rule = LOST_DIAL.format(sender=address, net=self.public_net, name=name)
        in_ns(core, "nft", "-f", "-", stdin=f"add rule inet core dials {rule}")
        sh("ip", "-n", core, "link", "set", port, "master", BRIDGE)
        sh("ip", "-n", netns, "addr", "add", f"{address}/24", "dev", interface)
        sh("ip", "-n", netns, "route", "add", "default", "via", f"{self.public_net}.1")

    def add_public_host(self, core: str, i: int) -> None:
        name, address = f"pub{i}", f"{self.public_net}.{10 + i}"
        netns = self.namespace(name)
        self.plug_into_bridge(core, netns, "eth0", f"p{i}", address, name)
        own = self.public_rates[i] if i < len(self.public_rates) else None
        self.shape(netns, "eth0", own or self.uplink)
        self.shape(core, f"p{i}", own or self.downlink)
        self.hosts[name] = Host(name, netns, address, address, behind_nat=False)

    def add_home(self, core: str, j: int) -> None:
        name, public, lan = f"home{j}", f"{self.public_net}.{100 + j}", f"192.168.{j + 1}"
        router, host = self.namespace(f"rtr{j}"), self.namespace(name)
        self.plug_into_bridge(core, router, "wan0", f"h{j}", public, name)
        self.cable(router, "lan0", host, "eth0")
        sh("ip", "-n", router, "addr", "add", f"{lan}.1/24", "dev", "lan0")
        sh("ip", "-n", host, "addr", "add", f"{lan}.2/24", "dev", "eth0")
        sh("ip", "-n", host, "route", "add", "default", "via", f"{lan}.1")
        in_ns(router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        in_ns(router, "nft", "-f", "-", stdin=ROUTER_RULES)
        self.shape(host, "eth0", self.home_rate or self.uplink)
        self.shape(router, "lan0", self.home_rate or self.downlink)
        self.hosts[name] = Host(name, host, f"{lan}.2", public, behind_nat=True, router=router)

    def popen(self, host: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ARGV on HOST (in a session of its own, so that `kill` reaches its children too)."""
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.hosts[host].netns, *argv], start_new_session=True, **kwargs
        )
        self.processes.append(process)
        return process

    def run(self, host: str, argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess:
        """Run ARGV on HOST to its end (at most TIMEOUT seconds); its output as text."""
        argv = ["ip", "netns", "exec", self.hosts[host].netns, *argv]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)

    def forward_port(self, home: str, port: int) -> None:
        """A port forward on HOME's router: new TCP connections to its public address at PORT reach the host."""
        host = self.hosts[home]
        rules = f"""
        table ip nat {{
            chain prerouting {{
                type nat hook prerouting priority dstnat;
                iifname "wan0" tcp dport {port} dnat to {host.address}:{port}
            }}
        }}
        insert rule inet home forward ct status dnat accept
        """
        in_ns(host.router, "nft", "-f", "-", stdin=rules)

    def block_inbound(self, host: str) -> None:
        """A firewall on a public HOST itself: its address is public, but new inbound connections are dropped."""
        rules = PUBLIC_FIREWALL.replace("wan0", self.hosts[host].interface)
        in_ns(self.hosts[host].netns, "nft", "-f", "-", stdin=rules)

    def dropped_inbound(self, home: str) -> int:
        """Packets HOME's router dropped because they tried to open a connection from outside."""
        rules = in_ns(self.hosts[home].router, "nft", "list", "table", "inet", "home").stdout
        return sum(int(n) for n in re.findall(r"counter packets (\d+)", rules))

    def wire_bytes(self) -> dict[str, dict[str, int]]:
        """Per host: the bytes it sent and received on the Internet side (a home's: its router's public side), relayed
        traffic and TCP/IP overhead included."""
        counts = {}
        for name, host in self.hosts.items():
            netns, interface = (host.router, "wan0") if host.behind_nat else (host.netns, host.interface)
            stats = json.loads(sh("ip", "-n", netns, "-s", "-j", "link", "show", "dev", interface).stdout)[0]
            counts[name] = {"sent": stats["stats64"]["tx"]["bytes"], "received": stats["stats64"]["rx"]["bytes"]}
        return counts

    def lost_dials(self) -> dict[str, int]:
        """Per host: the connections it tried to open to private addresses, which the core dropped (TCP SYNs)."""
        rules = in_ns(self.namespaces[0], "nft", "list", "chain", "inet", "core", "dials").stdout
        return {name: int(n) for n, name in re.findall(r"counter packets (\d+) bytes \d+ comment \"(\w+)\"", rules)}

    def lost_dial_targets(self) -> list[str]:
        """Where the lost dials went, one "SENDER -> IP:PORT" per destination (a home's sender is its router)."""
        elements = in_ns(self.namespaces[0], "nft", "list", "set", "inet", "core", "lost").stdout
        names = {host.public_address: name for name, host in self.hosts.items()}
        found = re.findall(r"([\d.]+) \. ([\d.]+) \. (\d+)", elements)
        return sorted(f"{names.get(sender, sender)} -> {ip}:{port}" for sender, ip, port in found)

    def close(self) -> None:
        """Stop what runs in the testbed, then delete its namespaces (their veths and bridge go with them)."""
        for process in self.processes:
            stop_group(process.pid)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        for netns in reversed(self.namespaces):
            delete_namespace(netns)
        self.namespaces.clear()


def stop_group(pid: int, grace: float = 3.0) -> None:
    """SIGTERM to the process group PID leads, SIGKILL to what is left of it after GRACE seconds."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            os.killpg(pid, 0)  # raises ProcessLookupError once the group is gone
            time.sleep(0.1)
        os.killpg(pid, signal.SIGKILL)


def delete_namespace(netns: str) -> None:
    """Kill what still runs inside NETNS (only our own runs' processes live there), then delete it."""
    for pid in sh("ip", "netns", "pids", netns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    sh("ip", "netns", "delete", netns, check=False)


def our_namespaces() -> list[str]:
    """Every namespace any Testbed made that still exists."""
    listed = sh("ip", "netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in listed if line.startswith(f"{PREFIX}-")]


def remove_leftovers() -> list[str]:
    """Delete the namespaces of Testbeds whose process is gone (a crashed or killed run); returns their names."""
    removed = []
    for netns in our_namespaces():
        owner = re.match(rf"{PREFIX}-(\d+)-", netns)
        if owner is None:
            continue
        try:
            os.kill(int(owner.group(1)), 0)
            continue  # a live run's (this process's own too)
        except ProcessLookupError:
            delete_namespace(netns)
        removed.append(netns)
    return removed


@functools.cache
def can_build() -> str | None:
    """None if this machine can build a Testbed; otherwise why not, in words a skipped test can print."""
    if os.geteuid() != 0:
        return f"network namespaces need root (this process runs as uid {os.geteuid()})"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (package {package})"
    probe = f"{PREFIX}-{os.getpid()}-probe{secrets.token_hex(2)}"
    try:
        sh("ip", "netns", "add", probe)
        sh("ip", "link", "add", "wan0", "netns", probe, "type", "veth", "peer", "name", "lan0", "netns", probe)
        in_ns(probe, "nft", "-f", "-", stdin=ROUTER_RULES)
        tbf = ["tbf", "rate", "1mbit", "burst", "32kbit", "latency", "1s"]
        in_ns(probe, "tc", "qdisc", "add", "dev", "wan0", "root", *tbf)
    except (TestbedError, subprocess.TimeoutExpired) as err:
        return f"this kernel or sandbox cannot build the testbed: {err}"
    finally:
        sh("ip", "netns", "delete", probe, check=False)
    return None
