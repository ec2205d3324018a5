"""What a run's DHT records weigh, as a peer publishes them, and what reading them costs a run of N peers
(docs/scale.md): the metrics records every peer reads all the time, and the audits' records.

The metrics: a peer's record as training/peer/report.py publishes it (the default run settings, a named dataset),
weighed as below. Every peer reads the whole key every `read_period(N)` seconds (training/swarm/joins.py: 0.5 s up to
8 peers, then as long as keeps the copies a peer's reads download within READ_BUDGET); the table shows what that
costs each peer and the key's holders per second, beside the same reads with hivemind's default beam.

Builds a commitment record and an audit record as training/audit/ does (32-number sketches of random values, rows
spread over a large dataset, each microbatch naming one block), for a global step of --step-samples samples in
microbatches of --microbatch rows, and weighs them with hivemind's serializer and signature validator: the value, and
the whole entry (key, subkey, signed value). Every auditing peer reads the failed verdicts at every global step (an
honest swarm's auditors publish none), and the commitments only at a step it audits (training/audit/auditor.py,
`step_done`: one step in 1 / --audit-rate, or to re-check a failed verdict). The table projects what those reads
hold and what the keys' replicas serve per step at N peers, in an honest swarm and in one where every auditor accuses.

The passed verdicts the monitor reads, and each full peer's two averager processes for probation: at their first
read, then at the next refresh (every 10 s) after one of their reducers held a sender on probation
(training/audit/standing.py). With churn, that is a round whose group holds a newcomer not yet proven. The last table
projects it: volunteers who stay --stay-minutes each (N / stay newcomers a minute), each on probation for the
expected 1 / --audit-rate global steps of --step-seconds until some auditor's pick lands on it, and a reducer whose
group of G holds one of those with probability 1 - (1 - on probation / N)^(G - 1), in one group of everyone and in
groups of --group-size; beside reading every 10 s (before).

A read asks for the latest records (`latest=True`): it visits the nodes nearest the key, and each that holds the key
answers with every record under it; with hivemind's caching, which ttt's peers keep, every node that read the key
holds it. So a read downloads each record once per node it visits. The first table measures that on --dht-nodes real
DHT nodes on this machine, each storing one record and reading the key the same way: as ttt reads
(training/metrics.py's `read_latest`: a beam of READ_BEAM nodes) and with hivemind's default beam (its bucket size,
20). The projections count the copies measured for ttt's reads.

Prints the tables and writes every figure to bench/results/records.json.

    .venv/bin/python -m bench.records [--step-samples 4096] [--microbatch 16] [--audit-rate 0.1] [--peers 32,100,1000]
        [--stay-minutes 120] [--step-seconds 12] [--group-size 16] [--dht-nodes 16]
"""

from __future__ import annotations

import argparse
import random
import time

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer
from rich.console import Console
from rich.table import Table

from bench.common import save_results
from pipeline.core.blocks import BLOCK_UNITS
from tests.support.dht_copies import copies_received, hivemind_read
from training.audit.records import (
    COMMITMENTS_KEPT,
    VERDICTS_KEPT,
    AuditRecord,
    Commitment,
    CommitmentRecord,
    MicrobatchCommitment,
    Verdict,
    accusations_key,
    audits_key,
    commitments_key,
)
from training.audit.sketch import SKETCH_SIZE
from training.audit.standing import REFRESH as VERDICTS_REFRESH
from training.config import PROTOCOL, PeerSettings, RunSettings, agreed_values, ttt_version
from training.metrics import READ_BEAM, PeerMetrics, metrics_key, read_latest
from training.swarm.joins import METRICS_ENTRY_BYTES, read_period
from training.swarm.optimizer import LINEAGE_STEPS

RUN_ID = "a-run-of-strangers"
PEER_ID = "12D3KooWQ8ZjPZ7a9K1uHFVdzqL5kB3s9fXTtJpRW7s2yYbGN6Cx"  # a libp2p id's length
HIVEMIND_BEAM = 20  # nodes a latest read visits by hivemind's default: its bucket size, every one a holder (caching)
DATASET_ROWS = (100_000, 4096)  # row groups, rows per group: rows named with numbers of a web-scale dataset's size


def sketch(coins: random.Random) -> list[float]:
    return [coins.gauss(0.0, 1.0) for _ in range(SKETCH_SIZE)]


def commitment_record(coins: random.Random, microbatches: int, rows: int) -> CommitmentRecord:
    """A peer's last COMMITMENTS_KEPT steps, each of `microbatches` microbatches of `rows` rows."""
    groups, per_group = DATASET_ROWS
    steps = [
        Commitment(
            step=10_000 + s,
            lineage="0123456789abcdef",
            microbatches=[
                MicrobatchCommitment(
                    rows=[[coins.randrange(groups), coins.randrange(per_group)] for _ in range(rows)],
                    blocks=[[0, coins.randrange(groups // BLOCK_UNITS)]],
                    sketch=sketch(coins),
                )
                for _ in range(microbatches)
            ],
        )
        for s in range(COMMITMENTS_KEPT)
    ]
    return CommitmentRecord(peer_id=PEER_ID, steps=steps)


def audit_record(coins: random.Random, passed: bool) -> AuditRecord:
    """An auditor's record once it holds VERDICTS_KEPT verdicts, all passed (an honest swarm's), or all failed (each
    with both sketches, its evidence)."""
    evidence = {} if passed else {"claimed": sketch(coins), "recomputed": sketch(coins)}
    verdicts = [
        Verdict(
            step=10_000 + v,
            accused="0123456789abcdef",
            accused_peer_id=PEER_ID,
            microbatch=coins.randrange(256),
            lineage="0123456789abcdef",
            distance=0.016 if passed else 1.4,
            passed=passed,
            **evidence,
        )
        for v in range(VERDICTS_KEPT)
    ]
    return AuditRecord(auditor=PEER_ID, verdicts=verdicts)


def metrics_record() -> PeerMetrics:
    """A peer's record in the middle of a run, with the default run settings and a dataset of a web-scale size."""
    identities = {"dataset": "(401,234,567 rows, sha256 3f6c1a9b20de)", "tokenizer": "(UTF-8 bytes)"}
    return PeerMetrics(
        step=12_345, samples_per_second=41.7, samples_accumulated=512, total_samples=5_123_456, loss=5.4321,
        mini_steps=32, display_name="a-volunteer's-laptop", parameters_hash="9" * 64, serves_state=True,
        rounds_together=12_000, round_size=16, username="volunteer-0042", peer_id=PEER_ID, lineage="ab12cd34ef56ab78",
        recent_lineages=[(12_345 - back, f"{back:x}b12cd34ef56ab78") for back in range(LINEAGE_STEPS)],
        dropped=1, clipped=2, run_settings=agreed_values(RunSettings(), identities), protocol=PROTOCOL,
        version=ttt_version(), sent_bytes=123_456_789_012, data_epoch=3, epoch_blocks=98_000,
        outliers={PEER_ID[:-2] + f"{i:02d}": 10 + i for i in range(3)},
    )  # fmt: skip


def copies_per_read(console: Console, nodes: int) -> dict:
    """The copies of each record a read receives as ttt reads (`read_latest`: a beam of READ_BEAM) and with
    hivemind's default beam, measured."""
    results = {"dht_nodes": nodes, "read_beam": READ_BEAM, "ttt_read": copies_received(nodes, read_latest),
               "hivemind_default_beam": copies_received(nodes, hivemind_read)}  # fmt: skip
    console.print(
        f"one latest read of a key that each of {nodes} DHT nodes on this machine stored a record under receives "
        f"{results['ttt_read']:.1f} copies of each record as ttt reads (a beam of {READ_BEAM} nodes), "
        f"{results['hivemind_default_beam']:.1f} with hivemind's default beam (every node that read the key caches "
        f"it, and a read visits up to {HIVEMIND_BEAM}): {results['hivemind_default_beam'] / results['ttt_read']:.1f}x "
        f"more bytes and record checks. Projected below: {results['ttt_read']:.1f} copies from {nodes} peers up"
    )
    return results


def metrics_reads(console: Console, signer: RSASignatureValidator, peers: list[int], copies: float) -> dict:
    """What reading the run's metrics key costs a peer per second, with COPIES of each record per read (beside
    hivemind's default beam at the same period), and what each node holding the key and all of them serve."""
    value, entry = entry_bytes(signer, metrics_key(RUN_ID), metrics_record())
    results = {"metrics_record_value_bytes": value, "metrics_record_entry_bytes": entry, "per_run_size": {}}
    table = Table(title=f"the metrics records: {entry:,} B each (METRICS_ENTRY_BYTES: {METRICS_ENTRY_BYTES:,} B)")
    for column in ("peers", "read period", "a peer reads", "(hivemind's beam)", "each holder serves", "in all"):
        table.add_column(column, justify="right")
    for n in peers:
        period = read_period(n)
        one_copy = n * entry / period  # every record once
        read, default_beam = copies * one_copy, min(n - 1, HIVEMIND_BEAM) * one_copy
        results["per_run_size"][n] = {
            "read_period_s": period, "read_bytes_per_s": round(read),
            "read_bytes_per_s_hivemind_beam": round(default_beam),
            "served_bytes_per_s_per_holder": round(n * one_copy), "served_bytes_per_s": round(n * read),
        }  # fmt: skip
        table.add_row(
            f"{n:,}", f"{period:.2f} s", f"{read / 1e3:,.0f} KB/s", f"{default_beam / 1e3:,.0f} KB/s",
            f"{n * one_copy / 1e6:,.1f} MB/s", f"{n * read / 1e6:,.1f} MB/s",
        )  # fmt: skip
    console.print(table)
    return results


def probation_reads(console: Console, entry: int, peers: list[int], args: argparse.Namespace, copies: float) -> dict:
    """What a full peer's averagers read of the passed verdicts (one record of `entry` bytes per auditor) per second,
    with churn, in one group of everyone and in groups of `args.group_size`, beside every refresh (before)."""
    probation_minutes = args.step_seconds / args.audit_rate / 60
    results = {"probation_minutes": probation_minutes, "per_run_size": {}}
    title = (
        f"the passed verdicts, a full peer's 2 averagers: volunteers staying {args.stay_minutes:g} min, newcomers on "
        f"probation {probation_minutes:.1f} min"
    )
    table = Table(title=title)
    for column in ("peers", "on probation at once", "one read", "every 10 s (before)", "one group",
                   f"groups of {args.group_size}"):  # fmt: skip
        table.add_column(column, justify="right")
    for n in peers:
        on_probation = n / args.stay_minutes * probation_minutes
        every_refresh = 2 * copies * n * entry / VERDICTS_REFRESH
        newcomer_share = min(1.0, on_probation / n)
        one_group, groups = (
            every_refresh * (1 - (1 - newcomer_share) ** (size - 1)) for size in (n, min(n, args.group_size))
        )
        results["per_run_size"][n] = {
            "on_probation": on_probation, "read_bytes": copies * n * entry, "bytes_per_s_before": round(every_refresh),
            "bytes_per_s_one_group": round(one_group), "bytes_per_s_groups": round(groups),
        }  # fmt: skip
        table.add_row(
            f"{n:,}", f"{on_probation:.1f}", f"{copies * n * entry / 1e6:,.2f} MB", f"{every_refresh / 1e6:,.2f} MB/s",
            f"{one_group / 1e6:,.2f} MB/s", f"{groups / 1e6:,.2f} MB/s",
        )  # fmt: skip
    console.print(table)
    return results


def entry_bytes(signer: RSASignatureValidator, key: str, record) -> tuple[int, int]:
    """(value, whole entry) bytes of a record stored under this peer's subkey, signed as every peer signs it."""
    value = MSGPackSerializer.dumps(record.dict(exclude_none=True))  # as training/audit/records.py publishes
    stored = DHTRecord(
        key=MSGPackSerializer.dumps(key), subkey=MSGPackSerializer.dumps(signer.local_public_key), value=value,
        expiration_time=get_dht_time() + 600,
    )  # fmt: skip
    return len(value), len(stored.key) + len(stored.subkey) + len(signer.sign_value(stored))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-samples", type=int, default=4096, help="samples of one global step, swarm-wide")
    parser.add_argument("--microbatch", type=int, default=16, help="rows of one committed microbatch")
    parser.add_argument("--audit-rate", type=float, default=PeerSettings.audit_rate, help="as `ttt train` takes it")
    parser.add_argument("--peers", default="32,100,1000", help="the run sizes to project to")
    parser.add_argument("--stay-minutes", type=float, default=120, help="how long a volunteer stays, on average")
    parser.add_argument("--step-seconds", type=float, default=12, help="a global step's time")
    parser.add_argument("--group-size", type=int, default=16, help="the bounded groups to project to")
    parser.add_argument("--dht-nodes", type=int, default=16, help="DHT nodes to measure a read's copies on")
    args = parser.parse_args()
    started, console, coins, signer = time.perf_counter(), Console(), random.Random(0), RSASignatureValidator()
    peers = [int(p) for p in args.peers.split(",")]
    copies = copies_per_read(console, args.dht_nodes)
    received = copies["ttt_read"]  # copies of each record a read of ttt downloads
    metrics = metrics_reads(console, signer, peers, received)
    audit_value, audit = entry_bytes(signer, audits_key(RUN_ID), audit_record(coins, passed=True))
    failed_value, failed = entry_bytes(signer, accusations_key(RUN_ID), audit_record(coins, passed=False))
    results = {
        "step_samples": args.step_samples,
        "microbatch": args.microbatch,
        "audit_rate": args.audit_rate,
        "audit_record_value_bytes": audit_value,
        "audit_record_entry_bytes": audit,
        "failed_audit_record_value_bytes": failed_value,
        "failed_audit_record_entry_bytes": failed,
        "per_run_size": {},
        "copies_per_read": copies,
        "metrics": metrics,
    }
    title = (
        f"the audits' records: global steps of {args.step_samples} samples, microbatches of {args.microbatch}, "
        f"--audit-rate {args.audit_rate:g}"
    )
    table = Table(title=title)
    for column in ("peers", "microbatches per peer per step", "commitment entry", "the commitments (an audit step)",
                   "one peer reads per step, on average", "served per step, in all",
                   "the failed verdicts, if every auditor accuses"):  # fmt: skip
        table.add_column(column, justify="right")
    for n in peers:
        # The step's samples spread over the peers: each commits its share of the microbatches (one at least).
        share = max(1, round(args.step_samples / args.microbatch / n))
        _, commitment = entry_bytes(signer, commitments_key(RUN_ID), commitment_record(coins, share, args.microbatch))
        commitments = received * n * commitment  # one read of the commitments key
        read = args.audit_rate * commitments  # an honest swarm's failed verdicts: none
        results["per_run_size"][n] = {
            "microbatches_per_peer_per_step": share, "commitment_entry_bytes": commitment,
            "commitments_read_bytes": round(commitments), "read_bytes": round(read),
            "served_per_step_bytes": round(n * read), "accusations_read_bytes": round(received * n * failed),
            "monitor_read_bytes": round(received * n * (audit + commitment)),
        }  # fmt: skip
        table.add_row(
            f"{n:,}", str(share), f"{commitment:,} B", f"{commitments / 1e6:,.2f} MB", f"{read / 1e6:,.2f} MB",
            f"{n * read / 1e6:,.1f} MB", f"{received * n * failed / 1e6:,.2f} MB",
        )  # fmt: skip
    console.print(
        f"an auditor's record of {VERDICTS_KEPT} passed verdicts: {audit_value:,} B ({audit:,} B as a signed entry), "
        f"which the monitor and the averagers (probation) read; of {VERDICTS_KEPT} failed ones, with their sketches: "
        f"{failed_value:,} B ({failed:,} B), which every peer reads at every step. In an honest swarm no auditor "
        "publishes failed verdicts: a peer's reads are the commitments, at a step it audits (--audit-rate)"
    )
    console.print(table)
    results["probation"] = probation_reads(console, audit, peers, args, received)
    save_results("records", results, started, console)


if __name__ == "__main__":
    main()
