"""Every row once per epoch across a swarm: what share of the rows peers read when, together, they have read one
dataset's worth, with each peer in its own order (as ttt did) and with the swarm's leases (pipeline/core/blocks.py,
training/swarm/leases.py); and what the leases cost a reader.

    PYTHONPATH=. python -m bench.coverage [--rows 102400] [--rate 500] [--lease 8]

Coverage: 4 reader processes on 127.0.0.1, each with a hivemind DHT node of its own and a CodeStream, consuming
--rate rows per second (a trainer's pace) and logging every key it was handed. They start 2 s apart; the last one
joins at 40% of the epoch; one is SIGKILLed at 50% (no goodbye: its lease runs out); one's clock is 5 s ahead (its
lease times). When the keys logged add up to the dataset's rows, the bench counts the distinct ones and the rows
read twice. --lease: the leases' life in seconds (a run's is 120 s, against an epoch of days; here the epoch lasts
a minute, so the lease is scaled down with it).

Throughput: one reader in this process, the same dataset, as fast as it goes, in its own order against leased
blocks (a DHT node of its own): the ratio.

Results in bench/results/coverage.json; the table in docs/streaming.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from bench.common import save_results
from tests.support.datasets import write_paper_scale

console = Console(width=160)
PEERS = 4
CLOCK_AHEAD = 5.0  # seconds: one peer's clock (its leases' times)


def run_peer(args: argparse.Namespace) -> None:
    """One reader: a DHT node (joined to --initial-peers), a stream in --mode, keys to --keys at --rate rows/s."""
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator

    from pipeline.core.stream import CodeStream, index_dataset
    from training.swarm import leases

    if args.clock_ahead:
        ahead = args.clock_ahead
        leases.get_dht_time = lambda: hivemind.utils.get_dht_time() + ahead  # this peer's clock is off
    signer = RSASignatureValidator()
    dht = hivemind.DHT(
        start=True, initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=[signer]
    )
    print(dht.get_visible_maddrs()[0], flush=True)
    index = index_dataset(args.dataset)
    if args.mode == "leases":
        book = leases.LeaseBook(dht, "coverage", signer.local_public_key, lease=args.lease)
        source = leases.LeaseSource(book, [unit.rows for unit in index.units], seed=0)
        stream = CodeStream(args.dataset, batch_size=64, seed=0, blocks=source, index=index)
    else:
        stream = CodeStream(args.dataset, batch_size=64, peer=str(dht.peer_id), index=index)
    with open(args.keys, "a") as out:
        for batch in stream:
            out.write("".join(f"{key}\n" for key in batch["key"]))
            out.flush()
            time.sleep(len(batch["key"]) / args.rate)


def start_peer(args: argparse.Namespace, mode: str, name: str, folder: Path, joining: str | None, clock: float):
    argv = [sys.executable, "-m", "bench.coverage", "--peer", "--mode", mode, "--dataset", args.dataset,
            "--keys", str(folder / f"{name}.keys"), "--rate", str(args.rate), "--lease", str(args.lease),
            "--clock-ahead", str(clock), *(["--initial-peers", joining] if joining else [])]  # fmt: skip
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True
    )
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
    return {"distinct_share": round(distinct / args.rows, 4), "read_twice_share": round(1 - distinct / args.rows, 4)}


def with_suppressed_kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def throughput(args: argparse.Namespace) -> dict:
    """Rows per second of one reader over the dataset, in its own order and from leased blocks."""
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator

    from pipeline.core.stream import CodeStream, index_dataset
    from training.swarm.leases import LeaseBook, LeaseSource

    index = index_dataset(args.dataset)
    signer = RSASignatureValidator()
    dht = hivemind.DHT(start=True, record_validators=[signer])
    try:
        rates = {}
        for mode in ("own", "leases"):
            blocks = None
            if mode == "leases":
                book = LeaseBook(dht, f"throughput-{time.time()}", signer.local_public_key)
                blocks = LeaseSource(book, [unit.rows for unit in index.units], seed=0, epochs=1)
            stream = CodeStream(args.dataset, batch_size=64, seed=0, epochs=1, blocks=blocks, index=index)
            started, rows = time.perf_counter(), 0
            for batch in stream:
                rows += len(batch["key"])
            rates[mode] = rows / (time.perf_counter() - started)
    finally:
        dht.shutdown()
    ratio = round(rates["leases"] / rates["own"], 3)
    return {"rows_per_second": {mode: round(rate) for mode, rate in rates.items()}, "ratio": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=102_400, help="the dataset's rows (row groups of 1,024)")
    parser.add_argument("--rate", type=float, default=500.0, help="rows per second each peer consumes")
    parser.add_argument("--lease", type=float, default=8.0, help="seconds a lease lives unless renewed")
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["own", "leases"], help=argparse.SUPPRESS)
    parser.add_argument("--dataset", help=argparse.SUPPRESS)
    parser.add_argument("--keys", help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--clock-ahead", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        return run_peer(args)
    folder = Path(tempfile.mkdtemp(prefix="ttt-coverage-"))
    args.dataset = str(folder / "dataset")
    write_paper_scale(Path(args.dataset), args.rows, grid=8, compression_level=1)
    started, results = time.perf_counter(), {"settings": {"rows": args.rows, "rate": args.rate, "lease": args.lease}}
    for mode in ("own", "leases"):
        results[mode] = coverage(args, mode, folder / mode)
        console.print(f"{mode}: {json.dumps(results[mode])}")
    results["throughput"] = throughput(args)
    console.print(f"throughput: {json.dumps(results['throughput'])}")
    save_results("coverage", results, started, console)


if __name__ == "__main__":
    main()
