"""The NAT testbed itself (tests/support/netns.py): who can open a connection to whom, the link rate, and that
nothing is left behind. Needs root, nftables and iproute2 (`make nat-testbed`); elsewhere each test fails and says
what is missing."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.commands import FAULTHANDLER, TTT
from tests.support.netns import PREFIX, Testbed, can_build, our_namespaces, remove_leftovers
from tests.support.swarm_runs import HELPER_LEAVES, PARTIAL_ROUND, RAW_HIVEMIND, WanSwarm, free_port
from training.swarm.dht import BEHIND_NAT

# The README's command, with what this 2-core machine needs (no network option: each peer finds its reachability).
PLAIN = ["--threads", "1", "--loader-workers", "0"]
NAT_STEPS = 9  # the late home joins at step 2 and downloads: 5-6 steps of rounds of all three after that


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
        assert net.lost_dials()["home0"] >= 1 and f"home0 -> {home1.address}:9000" in net.lost_dial_targets()
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


def swarm_on(net: Testbed, dataset: Path, folder: Path, run_id: str, max_steps: int, *run: str) -> WanSwarm:
    settings = ["--dataset", str(dataset), "--run-id", run_id, "--max-steps", str(max_steps), *run, *PLAIN]
    return WanSwarm(net, folder, settings)


@pytest.mark.e2e
def test_home_peers_find_they_are_behind_nat_and_average_through_the_public_peer(sample_dataset, tmp_path):
    """A public peer starts the run; two home peers behind NAT join it at different times with the plain command,
    on 20 Mbit/s links. Before ttt checked reachability, 5% of such rounds held all three peers."""
    with Testbed(public=1, homes=2, uplink="20mbit", downlink="20mbit") as net:
        # A run whose global step (~12 s here) leaves a newcomer on a 20 Mbit/s link the time to download the state
        # (about 4 s) and compute a batch on this shared 2-core machine. With 128 samples (steps of ~8 s) the late
        # home peer took part in 2-3 rounds of all three per run; with the default 64 it fell behind and caught up by
        # downloads, on loopback as much as behind NAT.
        swarm = swarm_on(net, sample_dataset, tmp_path, "nat-run", NAT_STEPS, "--target-batch-size", "256")
        swarm.start("pub0")
        swarm.start("home0")
        swarm.wait_for_step("pub0", 2, timeout=180)
        swarm.start("home1")
        logs = swarm.finish(timeout=480)
        lost_dials, lost_to = net.lost_dials(), net.lost_dial_targets()
    assert sum(lost_dials.values()) == 0, lost_to  # nobody dialed a private address
    for name, log in logs.items():
        assert log.returncode == 0, log.text
        assert not RAW_HIVEMIND.search(log.text), f"{name} printed hivemind's own lines:\n{log.text}"
        assert (BEHIND_NAT in log.text) == name.startswith("home"), log.text
        assert "192.168." not in log.text, log.text  # nobody announces, or is told of, a home's private address
    # home0, behind NAT from the start, averages through the public peer from its first round on, and home1, joining
    # late, is in the rounds of all three from its first one on. A peer that misses a round downloads the state and is
    # in the very next round: it joins that round's group while it downloads. Before it did, a peer that missed one
    # round was out of step at every other step to the run's end (home1 in 2 of 4 runs; home0 once in CI); since,
    # each home missed one round at most on a quiet machine (docs/network.md#measured). Beside a busy core (CI runs 54
    # and 56, 3 of 6 runs here) home1 fell behind right after its first round: a download, the round the others held
    # without it, then one or two downloads more. It may, once, but it ends the run in a round of all three. In
    # those CI runs it then waited a minute or two for rounds that would not come, and finished alone. A round that
    # left it apart (the others' round of a step ahead, its first batch or a slow one having ended after theirs; or
    # results lost on its link), as its line says, is repaired by a download at the next step, the run's last one
    # included: in clean-clone run 210 home1's last line was such a repair, right after a line that said `round 3`
    # (lines did not say why then).
    home0 = [size for _, size, _ in logs["home0"].rounds]
    assert home0 and sum(size < 2 for size in home0) <= 1, logs["home0"].text
    home1 = [size for _, size, _ in logs["home1"].rounds]
    together = home1[home1.index(3) :] if 3 in home1 else []
    missed = [step for step, size in enumerate(together) if size != 3]
    repaired_at_the_end = together[-2:] == [3, 0] and logs["home1"].rounds[-2][0] in logs["home1"].steps_apart
    assert len(together) >= 4 and (together[-1] == 3 or repaired_at_the_end), logs["home1"].text
    if missed:  # one stretch of steps
        assert missed == list(range(missed[0], missed[-1] + 1)), logs["home1"].text
    assert 3 in [size for _, size, _ in logs["pub0"].rounds], logs["pub0"].text


@pytest.mark.e2e
def test_a_home_whose_gradients_take_longer_to_send_than_a_result_is_waited_for_still_gets_the_results(
    sample_dataset, tmp_path
):
    """A home behind NAT (a client: it reads its results only once its parts are sent) on a 2 Mbit/s link sends ~1.9
    MB of gradients a round: ~8 s, longer than the 4 s a member waits for a reducer's next result (twice the
    matchmaking time). hivemind counted those 4 s from the round's start: the home got none of its results in any
    round (its own gradients applied) while its progress line said `round 2`; seen with the small preset at 20
    Mbit/s. Now a client waits for its results until the round's timeout: 4 s for each from the end of its parts
    (they are in the p2p daemon's and the kernel's buffers then, not yet at the reducer) still lost all of one round's
    results in one CI run, and the last 5% of one round's in a run after it."""
    with Testbed(public=1, homes=1, uplink="2mbit", downlink="2mbit") as net:
        swarm = swarm_on(net, sample_dataset, tmp_path, "slow-run", 2, "--matchmaking-time", "2")
        swarm.start("pub0", "--wait-for-peers", "2")
        swarm.start("home0", "--wait-for-peers", "2")
        logs = swarm.finish(timeout=300)
    for name, log in logs.items():
        assert log.returncode == 0, log.text
        assert [size for _, size, _ in log.rounds] == [2, 2], log.text
        partial = PARTIAL_ROUND.findall((tmp_path / name / "hivemind.log").read_text())
        assert partial == [], (name, partial)


@pytest.mark.e2e
def test_reachable_peers_announce_only_where_they_were_reached(sample_dataset, tmp_path):
    """A second public peer, and a home peer whose router forwards its port, are reachable: each joins as a full peer
    and prints only the address at which the first peer connected back (not 127.0.0.1, not 192.168.x.y)."""
    with Testbed(public=2, homes=1) as net:
        net.forward_port("home0", 4011)
        swarm = swarm_on(net, sample_dataset, tmp_path, "reach-run", 1000)
        swarm.start("pub0")
        swarm.start("pub1")
        swarm.start("home0", "--host-maddrs", "/ip4/0.0.0.0/tcp/4011")
        for name, reached in (("pub1", net.hosts["pub1"].address), ("home0", net.hosts["home0"].public_address)):
            swarm.wait_for(name, r"^model: ", timeout=120)
            text = swarm.logs[name].text
            assert re.search(rf"^reachable: .* connected back to /ip4/{re.escape(reached)}/tcp/\d+ ", text, re.M), text
            addresses = re.findall(r"^/ip4/\S+$", text, re.M)
            assert len(addresses) == 1 and addresses[0].startswith(f"/ip4/{reached}/tcp/"), text
        assert "/ip4/" + net.hosts["home0"].public_address + "/tcp/4011/" in swarm.logs["home0"].text


@pytest.mark.e2e
def test_homes_all_behind_nat_average_through_the_helper_and_download_its_state(sample_dataset, tmp_path):
    """Every trainer behind NAT, and a public helper (`ttt monitor --assist-averaging`) that keeps the run's state: the
    homes average through it, and a home that joins late downloads the state from it. Before the helper kept a state,
    nobody could serve one in such a run (client-mode peers cannot be dialled): the newcomer started from its own
    parameters, and every home that missed a round stayed apart."""
    with Testbed(public=1, homes=2, uplink="20mbit", downlink="20mbit") as net:
        swarm = swarm_on(net, sample_dataset, tmp_path, "helper-run", NAT_STEPS, "--target-batch-size", "128")
        helper = ["--run-id", "helper-run", "--assist-averaging", "--target-batch-size", "128", "--checkpoint-every"]
        helper += ["6", "--port", str(free_port()), "--checkpoint-dir", str(tmp_path / "helper")]
        swarm.launch("helper", [TTT, "monitor", *helper], host="pub0", env=FAULTHANDLER)  # a hang says where
        swarm.start("home0")
        swarm.wait_for_step("home0", 2, timeout=180)
        swarm.start("home1")
        assert swarm.wait_for_exit(["home0", "home1"], timeout=480), swarm.logs["home1"].text
        swarm.kill("helper", signal.SIGINT)
        logs = swarm.finish(timeout=HELPER_LEAVES)
        lost_dials, lost_to = net.lost_dials(), net.lost_dial_targets()
    assert sum(lost_dials.values()) == 0, lost_to
    for name in ("home0", "home1"):
        assert logs[name].returncode == 0, logs[name].text
        assert BEHIND_NAT in logs[name].text and not RAW_HIVEMIND.search(logs[name].text), logs[name].text
    # At step 0 nobody serves a state (every peer holds the run's seed); the newcomer downloads the helper's.
    assert "the run is at global step 0: this peer starts from the run's seed" in logs["home0"].text
    assert logs["home1"].synchronised is not None and logs["home1"].synchronised[0] >= 2, logs["home1"].text
    # The helper is in every round that succeeds (client-mode peers cannot reduce): a full round holds three.
    sizes = [size for _, size, _ in logs["home0"].rounds]
    assert 3 in sizes, logs["home0"].text
    together = sizes[sizes.index(3) : -1]
    assert sum(size == 3 for size in together) >= len(together) / 2, sizes
    assert "Traceback" not in logs["helper"].text and "checkpoint of the swarm at global step" in logs["helper"].text
