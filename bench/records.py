"""What the audits' DHT records weigh, as a peer publishes them, and what reading them costs a run of N peers
(docs/scale.md).

Builds a commitment record and an audit record as training/audit/ does (32-number sketches of random values, rows
spread over a large dataset), for a global step of --step-samples samples in microbatches of --microbatch rows, and
weighs them with hivemind's serializer and signature validator: the value, and the whole entry (key, subkey, signed
value). Every peer reads both keys at every global step (training/audit/auditor.py, `step_done`); the table projects
what one read holds and what the keys' replicas serve per step at N peers.

Prints a table and writes every figure to bench/results/records.json.

    .venv/bin/python -m bench.records [--step-samples 4096] [--microbatch 16] [--peers 32,100,1000]
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
from training.audit.records import (
    COMMITMENTS_KEPT,
    VERDICTS_KEPT,
    AuditRecord,
    Commitment,
    CommitmentRecord,
    MicrobatchCommitment,
    Verdict,
    audits_key,
    commitments_key,
)
from training.audit.sketch import SKETCH_SIZE

RUN_ID = "a-run-of-strangers"
PEER_ID = "12D3KooWQ8ZjPZ7a9K1uHFVdzqL5kB3s9fXTtJpRW7s2yYbGN6Cx"  # a libp2p id's length
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
    parser.add_argument("--peers", default="32,100,1000", help="the run sizes to project to")
    args = parser.parse_args()
    started, console, coins, signer = time.perf_counter(), Console(), random.Random(0), RSASignatureValidator()
    audit_value, audit = entry_bytes(signer, audits_key(RUN_ID), audit_record(coins, passed=True))
    failed_value, failed = entry_bytes(signer, audits_key(RUN_ID), audit_record(coins, passed=False))
    results = {
        "step_samples": args.step_samples,
        "microbatch": args.microbatch,
        "audit_record_value_bytes": audit_value,
        "audit_record_entry_bytes": audit,
        "failed_audit_record_value_bytes": failed_value,
        "failed_audit_record_entry_bytes": failed,
        "per_run_size": {},
    }
    title = f"the audits' records: global steps of {args.step_samples} samples, microbatches of {args.microbatch}"
    table = Table(title=title)
    for column in ("peers", "microbatches per peer per step", "commitment entry", "one read of both keys",
                   "served per step, in all"):  # fmt: skip
        table.add_column(column, justify="right")
    for n in (int(p) for p in args.peers.split(",")):
        # The step's samples spread over the peers: each commits its share of the microbatches (one at least).
        share = max(1, round(args.step_samples / args.microbatch / n))
        _, commitment = entry_bytes(signer, commitments_key(RUN_ID), commitment_record(coins, share, args.microbatch))
        read = n * (commitment + audit)
        results["per_run_size"][n] = {
            "microbatches_per_peer_per_step": share, "commitment_entry_bytes": commitment, "read_bytes": read,
            "served_per_step_bytes": n * read,
        }  # fmt: skip
        table.add_row(f"{n:,}", str(share), f"{commitment:,} B", f"{read / 1e6:,.2f} MB", f"{n * read / 1e9:,.2f} GB")
    console.print(
        f"an audit record of {VERDICTS_KEPT} passed verdicts: {audit_value:,} B ({audit:,} B as a signed entry); of "
        f"{VERDICTS_KEPT} failed ones, with their sketches: {failed_value:,} B ({failed:,} B); the table counts an "
        "honest swarm's, all passed"
    )
    console.print(table)
    save_results("records", results, started, console)


if __name__ == "__main__":
    main()
