"""The NAT testbed itself (tests/support/netns.py): who can open a connection to whom, the link rate, and that
nothing is left behind. Needs root, nftables and iproute2 (`make nat-testbed`); elsewhere each test fails and says
what is missing."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.support.netns import PREFIX, Testbed, can_build, our_namespaces, remove_leftovers


@pytest.fixture(autouse=True)
def testbed_possible() -> None:
    """Never a silent skip: a machine that cannot build the testbed fails these tests and says what it lacks."""
    if (why := can_build()) is not None:
        pytest.fail(
            f"the NAT testbed cannot be built here: {why}; run the tests as root with nftables and iproute2 "
            "installed (`make nat-testbed` installs them)",
            pytrace=False,
        )


SERVE = """
import socket, sys
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("0.0.0.0", 9000))
server.listen()
print("listening", flush=True)
while True:
    conn, peer = server.accept()
    try:
        conn.sendall(peer[0].encode().ljust(64) + b"x" * int(sys.argv[1]))
    except OSError:
        pass
    conn.close()
"""
FETCH = """
import socket, sys, time
began = time.monotonic()
try:
    conn = socket.create_connection((sys.argv[1], 9000), timeout=float(sys.argv[2]))
except ConnectionRefusedError:
    print("refused", round(time.monotonic() - began, 2))
except OSError:
    print("timeout", round(time.monotonic() - began, 2))
else:
    data = b""
    while chunk := conn.recv(1 << 16):
        data += chunk
    print("ok", round(time.monotonic() - began, 2), data[:64].decode().strip(), len(data) - 64)
"""


def serve(net: Testbed, host: str, size: int = 0) -> None:
    server = net.popen(host, [sys.executable, "-c", SERVE, str(size)], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "listening"


def fetch(net: Testbed, host: str, address: str, timeout: float = 2.0) -> list[str]:
    return net.run(host, [sys.executable, "-c", FETCH, address, str(timeout)], timeout=timeout + 30).stdout.split()


def test_homes_reach_out_and_nobody_reaches_in():
    with Testbed(public=1, homes=2) as net:
        pub, home0, home1 = net.hosts["pub0"], net.hosts["home0"], net.hosts["home1"]
        for host in ("pub0", "home1"):
            serve(net, host)
        # out through the router: the public host sees the router's address
        assert fetch(net, "home0", pub.address)[::2] == ["ok", home0.public_address]
        # in: the router drops new connections silently (a timeout, not a refusal), and counts them
        assert fetch(net, "pub0", home1.public_address)[0] == "timeout"
        assert net.dropped_inbound("home1") >= 1
        # a home's private address is unroutable on the Internet: dropped silently, and counted as a lost dial
        assert fetch(net, "home0", home1.address)[0] == "timeout"
        assert net.lost_dials()["home0"] >= 1
        # a port forward opens the way in, and the host sees the caller's public address
        net.forward_port("home1", 9000)
        assert fetch(net, "pub0", home1.public_address)[::2] == ["ok", pub.address]


def test_a_firewalled_public_host_refuses_nothing_and_accepts_nothing():
    with Testbed(public=2, homes=0) as net:
        serve(net, "pub1")
        assert fetch(net, "pub0", net.hosts["pub1"].address)[0] == "ok"
        net.block_inbound("pub1")
        assert fetch(net, "pub0", net.hosts["pub1"].address)[0] == "timeout"


def test_links_are_shaped():
    size = 4_000_000
    with Testbed(public=1, homes=1, uplink="8mbit", downlink="8mbit") as net:
        serve(net, "pub0", size)
        answer = fetch(net, "home0", net.hosts["pub0"].address, timeout=30)
        assert answer[0] == "ok" and int(answer[3]) == size
        mbit_per_second = size * 8 / float(answer[1]) / 1e6
        assert 4 < mbit_per_second < 8.5, answer
        assert net.wire_bytes()["home0"]["received"] > size


def test_nothing_is_left_behind_even_after_a_crash():
    with Testbed(public=1, homes=1) as net:
        names, server = list(net.namespaces), net.popen("pub0", ["sleep", "600"])
    assert server.poll() is not None
    assert not set(names) & set(our_namespaces())
    # a crashed run's namespace (its process id is gone) goes with the next Testbed, or remove_leftovers()
    dead = subprocess.Popen(["true"])
    dead.wait()
    crashed = f"{PREFIX}-{dead.pid}-dead00-core"
    subprocess.run(["ip", "netns", "add", crashed], check=True)
    time.sleep(0.1)
    assert crashed in remove_leftovers()
    assert crashed not in our_namespaces()
