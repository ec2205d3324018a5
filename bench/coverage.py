"""Every row once per epoch across a swarm: what share of the rows peers read when, together, they have read one
dataset's worth, with each peer in its own order (as ttt did) and with the swarm's leases (pipeline/core/blocks.py,
training/swarm/leases.py). What leases cost a reader: bench/stream.py.

    PYTHONPATH=. python -m bench.coverage [--rows 102400] [--rate 500] [--lease 8] [--nat]

Coverage: 4 reader processes, each with a hivemind DHT node of its own and a CodeStream, consuming --rate rows per
second (a trainer's pace) and logging every key it was handed. They start 2 s apart; the last one joins at 40% of
the epoch; one is SIGKILLed at 50% (no goodbye: its lease runs out); one's clock is 5 s ahead (its lease times).
When the keys logged add up to the dataset's rows, the bench counts the distinct ones and the rows read twice, and
the DHT requests the leases cost per row group. --lease: the leases' life in seconds (a run's is 120 s, against an
epoch of days; at the default size the epoch lasts a minute, so the lease is scaled down with it).

The peers are on 127.0.0.1, or with --nat on the NAT testbed of tests/support/netns.py (root): two on public hosts,
the first peer and the late one; two in homes behind NAT routers (DHT client mode: nobody can reach them), with
20 Mbit/s links, among them the one killed and the one whose clock is ahead.

Results in bench/results/coverage.json, by network and settings; the table in docs/streaming.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from bench.common import CODE, save_results
from tests.support.datasets import write_paper_scale
from tests.support.netns import Testbed, can_build

console = Console(width=160)
PEERS = 4
HOSTS = {"p0": "pub0", "p1": "home0", "p2": "home1", "late": "pub1"}  # with --nat: p1 is killed, p2's clock is off
CLOCK_AHEAD = 5.0  # seconds: one peer's clock (its leases' times)


def run_peer(args: argparse.Namespace) -> None:
    """One reader: a DHT node (joined to --initial-peers), a stream in --mode, keys to --keys at --rate rows/s."""
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator

    from pipeline.core.blocks import block_units
    from pipeline.core.stream import CodeStream, index_dataset
    from training.swarm import leases

    if args.clock_ahead:
        ahead = args.clock_ahead
        leases.get_dht_time = lambda: hivemind.utils.get_dht_time() + ahead  # this peer's clock is off
    signer = RSASignatureValidator()
    dht = hivemind.DHT(
        start=True,
        initial_peers=args.initial_peers,
        host_maddrs=[f"/ip4/{args.address}/tcp/0"],
        client_mode=args.client_mode,
        record_validators=[signer],
    )
    print(dht.get_visible_maddrs()[0] if not args.client_mode else "", flush=True)
    index = index_dataset(args.dataset)
    book = None
    if args.mode == "leases":
        book = leases.LeaseBook(dht, "coverage", signer.local_public_key, lease=args.lease)
        source = leases.LeaseSource(book, [unit.rows for unit in index.units], seed=0)
        stream = CodeStream(args.dataset, batch_size=64, seed=0, blocks=source, index=index)
    else:
        stream = CodeStream(args.dataset, batch_size=64, peer=str(dht.peer_id), index=index)
    requests, finished = Path(args.keys).with_suffix(".requests"), 0
    with open(args.keys, "a") as out:
        for batch in stream:
            out.write("".join(f"{key}\n" for key in batch["key"]))
            out.flush()
            if book is not None and len(source.finished) != finished:  # its DHT requests, and the row groups of
                finished = len(source.finished)  # the blocks it finished, each time it finishes one
                requests.write_text(json.dumps([book.requests, finished * block_units(len(index.units))]))
            time.sleep(len(batch["key"]) / args.rate)


def start_peer(args: argparse.Namespace, mode: str, name: str, folder: Path, joining: str | None, clock: float):
    """Peer NAME of the bench (its process, and its DHT address), on 127.0.0.1 or on its host of `args.net`."""
    host = args.net.hosts[HOSTS[name]] if args.net else None
    argv = [sys.executable, "-m", "bench.coverage", "--peer", "--mode", mode, "--dataset", args.dataset,
            "--keys", str(folder / f"{name}.keys"), "--rate", str(args.rate), "--lease", str(args.lease),
            "--clock-ahead", str(clock), "--address", host.address if host else "127.0.0.1",
            *(["--client-mode"] if host and host.behind_nat else []),
            *(["--initial-peers", joining] if joining else [])]  # fmt: skip
    output = {"stdout": subprocess.PIPE, "stderr": subprocess.DEVNULL, "text": True}
    if host:
        process = args.net.popen(host.name, argv, env={**os.environ, **CODE}, **output)
    else:
        process = subprocess.Popen(argv, start_new_session=True, **output)
    return process, process.stdout.readline().strip()


def logged(folder: Path) -> list[str]:
    return [key for path in sorted(folder.glob("*.keys")) for key in path.read_text().split()]


def coverage(args: argparse.Namespace, mode: str, folder: Path) -> dict:
    """Four peers of MODE as the module docstring says, until they logged the dataset's rows between them."""
    folder.mkdir(parents=True)
    peers, address = {}, None
    for k in range(PEERS - 1):
        peers[f"p{k}"], found = start_peer(args, mode, f"p{k}", folder, address, CLOCK_AHEAD if k == 2 else 0.0)
        address = address or found
        time.sleep(2)
    killed = late = False
    while len(read := logged(folder)) < args.rows:
        if not late and len(read) >= 0.4 * args.rows:
            peers["late"], _ = start_peer(args, mode, "late", folder, address, 0.0)
            late = True
        if not killed and len(read) >= 0.5 * args.rows:
            os.killpg(peers["p1"].pid, signal.SIGKILL)
            killed = True
        time.sleep(0.2)
    for process in peers.values():
        with_suppressed_kill(process)
    read = read[: args.rows]
    distinct = len(set(read))
    found = {"distinct_share": round(distinct / args.rows, 4), "read_twice_share": round(1 - distinct / args.rows, 4)}
    counts = [json.loads(path.read_text()) for path in folder.glob("*.requests")]
    if counts:  # DHT requests (takes, confirmations, renewals, done marks) per row group finished
        found["dht_requests_per_unit"] = round(sum(c[0] for c in counts) / max(1, sum(c[1] for c in counts)), 2)
    return found


def with_suppressed_kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=102_400, help="the dataset's rows (row groups of 1,024)")
    parser.add_argument("--rate", type=float, default=500.0, help="rows per second each peer consumes")
    parser.add_argument("--lease", type=float, default=8.0, help="seconds a lease lives unless renewed")
    parser.add_argument("--nat", action="store_true", help="on the NAT testbed (root): 2 public peers, 2 behind NAT")
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["own", "leases"], help=argparse.SUPPRESS)
    parser.add_argument("--dataset", help=argparse.SUPPRESS)
    parser.add_argument("--keys", help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--clock-ahead", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--address", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--client-mode", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        return run_peer(args)
    if args.nat and (why := can_build()) is not None:
        sys.exit(f"cannot build the NAT testbed: {why}")
    folder = Path(tempfile.mkdtemp(prefix="ttt-coverage-"))
    args.dataset = str(folder / "dataset")
    write_paper_scale(Path(args.dataset), args.rows, grid=8, compression_level=1)
    started = time.perf_counter()
    network = f"{'nat testbed' if args.nat else '127.0.0.1'}, {args.rows:,} rows, lease {args.lease:g} s"
    found = {"settings": {"rows": args.rows, "rate": args.rate, "lease": args.lease}}
    for mode in ("own", "leases"):
        with Testbed(public=2, homes=2, home_rate="20mbit") if args.nat else contextlib.nullcontext() as args.net:
            found[mode] = coverage(args, mode, folder / mode)
        console.print(f"{network}, {mode}: {json.dumps(found[mode])}")
    save_results("coverage", {network: found}, started, console, keep_other_parts=True)


if __name__ == "__main__":
    main()
