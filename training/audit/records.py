"""The audits' records in the run's DHT, each signed by its writer (its subkey is its public key, as for metrics):

    {run_id}_commitments   per peer: what it trained on in each of its last COMMITMENTS_KEPT global steps: for each
                           microbatch, the rows (row group, row), the leased blocks they came from (epoch, block) and
                           the sketch of its gradient; the lineage of the parameters it computed them at
    {run_id}_audits        per auditor: its last VERDICTS_KEPT passed verdicts, each naming the microbatch (the
                           accused, the step and lineage, the microbatch's index) and the sketches' distance. The
                           monitor reads them (its credit), and each peer's averagers, every REFRESH seconds
                           (standing.py): a passed verdict ends the accused's probation (`proven_by`)
    {run_id}_accusations   per auditor: its last VERDICTS_KEPT failed verdicts, each also holding its evidence, the
                           accused's committed sketch and the one recomputed (or, from a reducer's check, the sums
                           it committed and those received: `received`). Every peer reads them at every global
                           step; an honest swarm's auditors write none, so that read is nearly empty (bench/records.py)

Who stands convicted is each peer's own conclusion (`convicted_by`): a peer whose commitments failed the audits of
at least CONVICTING_AUDITORS different auditors, one of them the reader itself (its own audit, or its re-check of
another's verdict). A verdict alone convicts nobody, however many keys publish it: every honest peer believes only
what it recomputed.

The accused is its signing key (`peer_key`). The averagers refuse it by the peer id its commitments name, when no
other key names that id: a key that names another peer's id convicts only itself.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping
from concurrent.futures import TimeoutError as FutureTimeout

import pydantic.v1 as pydantic  # hivemind's schema validator is written for pydantic's v1 API
from hivemind.utils import ValueWithExpiration, get_dht_time

from training.audit.sketch import SKETCH_SIZE
from training.metrics import peer_key, read_latest

COMMITMENTS_KEPT = 4  # global steps a peer's commitment record covers: audits look two steps back, re-checks three
VERDICTS_KEPT = 16  # verdicts an auditor's record holds, of each kind (passed, failed)
CONVICTING_AUDITORS = 2  # different auditors whose failed verdicts convict a peer, the reader itself among them
AUDIT_LAG = 2  # global steps between a step and its audit: every live peer has published that step's commitment
UNAUDITED_STEPS = 2  # a peer's last committed steps that match no other peer's lineage: nobody can audit it
RECORD_LIFE = 600.0  # seconds a commitment or audit record lives unless published again
MAX_MICROBATCHES = 256  # microbatches one commitment holds at most (a step's samples / the peer's batch size)
MAX_ROWS = 4096  # rows of one microbatch
MAX_BLOCKS = 64  # blocks a microbatch's rows came from

Count = pydantic.conint(ge=0, strict=True)
RowAt = pydantic.conlist(Count, min_items=2, max_items=2)  # (row group of the dataset, row within it)
BlockAt = pydantic.conlist(Count, min_items=2, max_items=2)  # (epoch, block of the epoch: pipeline/core/blocks.py)
Sketch = pydantic.conlist(pydantic.StrictFloat, min_items=SKETCH_SIZE, max_items=SKETCH_SIZE)
PeerId = pydantic.constr(max_length=64)


class MicrobatchCommitment(pydantic.BaseModel):
    rows: pydantic.conlist(RowAt, min_items=1, max_items=MAX_ROWS)
    blocks: pydantic.conlist(BlockAt, min_items=1, max_items=MAX_BLOCKS)  # those its rows came from (leased.py)
    sketch: Sketch


class Commitment(pydantic.BaseModel):
    step: Count  # the global step whose gradients these microbatches were
    lineage: pydantic.constr(max_length=16)  # of the parameters they were computed at (swarm/optimizer.py)
    microbatches: pydantic.conlist(MicrobatchCommitment, max_items=MAX_MICROBATCHES)


class CommitmentRecord(pydantic.BaseModel):
    peer_id: PeerId  # the libp2p id the writer averages under
    steps: pydantic.conlist(Commitment, max_items=COMMITMENTS_KEPT)


class Verdict(pydantic.BaseModel):
    step: Count
    accused: pydantic.constr(max_length=16)  # the accused's signing key (`peer_key`)
    accused_peer_id: PeerId  # the id its commitments name
    microbatch: Count
    lineage: pydantic.constr(max_length=16)
    distance: pydantic.confloat(ge=0.0)  # sketch_distance(claimed, recomputed)
    passed: pydantic.StrictBool
    claimed: Sketch | None = None  # the accused's committed sketch: a failed verdict's evidence
    recomputed: Sketch | None = None  # the auditor's
    received: pydantic.StrictBool | None = None  # True: a reducer's check of what it received (received.py)
    unleased: pydantic.StrictBool | None = None  # True: the rows were not the accused's to read (leased.py)
    # A received verdict of an overclaim (received.py): the samples the accused claimed in the round, and the rows of
    # the committed run whose sums it sent.
    samples_claimed: pydantic.confloat(ge=0.0) | None = None
    rows_committed: Count | None = None

    @pydantic.root_validator(skip_on_failure=True)
    def failed_verdicts_hold_their_evidence(cls, values: dict) -> dict:
        """The evidence of a failed verdict: both sketches; that of unleased rows is the accused's commitment and
        leases, which anyone reads in the DHT."""
        if values["passed"] or values["unleased"]:
            return values
        if values["claimed"] is None or values["recomputed"] is None:
            raise ValueError("a failed verdict holds both sketches")
        return values


class AuditRecord(pydantic.BaseModel):
    auditor: PeerId
    verdicts: pydantic.conlist(Verdict, max_items=VERDICTS_KEPT)


def commitments_key(run_id: str) -> str:
    return f"{run_id}_commitments"


def audits_key(run_id: str) -> str:
    return f"{run_id}_audits"


def accusations_key(run_id: str) -> str:
    return f"{run_id}_accusations"


def publish(dht, key: str, public_key: bytes, record: pydantic.BaseModel) -> None:
    """Store this peer's record under its own subkey, in the background."""
    dht.store(
        key=key,
        subkey=public_key,
        value=record.dict(exclude_none=True),  # a passed verdict stores no sketches, not two empty ones
        expiration_time=get_dht_time() + RECORD_LIFE,
        return_future=True,
    )


def parse_entries(found: ValueWithExpiration | None, model: type[pydantic.BaseModel]) -> dict[str, pydantic.BaseModel]:
    """Signing key (`peer_key`) -> its valid record, from a `dht.get` of a commitments or audits key (the signature
    validator every peer attaches lets only the key's owner write its entry; a malformed one is skipped here)."""
    if found is None or not isinstance(found.value, dict):
        return {}
    records = {}
    for subkey, entry in found.value.items():
        try:
            records[peer_key(subkey)] = model.parse_obj(entry.value)
        except (pydantic.ValidationError, TypeError):  # the validators already reject these; be safe
            continue
    return records


def read_keys(
    dht, models: Mapping[str, type[pydantic.BaseModel]], timeout: float | None = None
) -> dict[str, dict[str, pydantic.BaseModel]] | None:
    """For each key of `models` (its record's model), its records: signing key -> record (a key nobody wrote yet:
    empty), all read at once; None when the DHT has not answered them all within `timeout` seconds (None: however long
    it takes)."""
    futures = {key: read_latest(dht, key, return_future=True) for key in models}
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        found = {
            key: future.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
            for key, future in futures.items()
        }
    except FutureTimeout:
        return None
    return {key: parse_entries(value, models[key]) for key, value in found.items()}


def read_records(dht, run_id: str, timeout: float | None = None) -> list[dict[str, pydantic.BaseModel]] | None:
    """The commitments', the passed verdicts' and the failed verdicts' records (`read_keys`), for a reader of all of
    them (the monitor)."""
    keys = (commitments_key(run_id), audits_key(run_id), accusations_key(run_id))
    found = read_keys(dht, dict(zip(keys, (CommitmentRecord, AuditRecord, AuditRecord), strict=True)), timeout)
    return None if found is None else [found[key] for key in keys]


def read_verdicts(dht, run_id: str) -> tuple[dict[str, AuditRecord], dict[str, AuditRecord]]:
    """The passed and the failed verdicts' records (`read_keys`), for a reader of the audits alone (`ttt status`)."""
    keys = (audits_key(run_id), accusations_key(run_id))
    found = read_keys(dht, dict.fromkeys(keys, AuditRecord))
    return found[keys[0]], found[keys[1]]


def claimed_ids(commitments: Mapping[str, CommitmentRecord]) -> dict[str, str]:
    """Signing key -> the peer id its commitments name, for the ids that only one key names."""
    keys_of: dict[str, set[str]] = defaultdict(set)
    for key, record in commitments.items():
        keys_of[record.peer_id].add(key)
    return {next(iter(keys)): peer_id for peer_id, keys in keys_of.items() if len(keys) == 1}


def failed_verdicts(audits: Mapping[str, AuditRecord]) -> dict[str, dict[str, list[Verdict]]]:
    """Accused signing key -> auditor -> its failed verdicts against it (never an auditor's own about itself)."""
    failed: dict[str, dict[str, list[Verdict]]] = defaultdict(lambda: defaultdict(list))
    for auditor, record in audits.items():
        for verdict in record.verdicts:
            if not verdict.passed and verdict.accused != auditor:
                failed[verdict.accused][auditor].append(verdict)
    return failed


def convicted_by(audits: Mapping[str, AuditRecord], reader: str) -> dict[str, set[str]]:
    """Accused signing key -> the auditors whose failed verdicts convict it, as `reader` (a signing key) concludes:
    at least CONVICTING_AUDITORS of them, the reader among them; never the reader itself."""
    return {
        accused: set(auditors)
        for accused, auditors in failed_verdicts(audits).items()
        if accused != reader and reader in auditors and len(auditors) >= CONVICTING_AUDITORS
    }


def convicting_auditors(audits: Mapping[str, AuditRecord], accused: str) -> dict[str, list[Verdict]]:
    """The auditors in whose eyes `accused` stands convicted (`convicted_by`, each of them the reader), with their
    failed verdicts against it: all those that failed it, once there are CONVICTING_AUDITORS of them; else none."""
    auditors = failed_verdicts(audits).get(accused, {})
    return dict(auditors) if len(auditors) >= CONVICTING_AUDITORS else {}


def proven_by(audits: Mapping[str, AuditRecord], reader: str, proven: set[str], convicted: set[str]) -> set[str]:
    """The signing keys `reader` holds proven: `proven` (those it held so far) and the accused of every passed verdict
    by the reader itself or by a key it holds proven, never a convicted key (`convicted`): trust grows from what the
    reader recomputed itself, one auditor it trusts at a time."""
    passes = [
        (auditor, verdict.accused)
        for auditor, record in audits.items()
        for verdict in record.verdicts
        if verdict.passed and verdict.accused != auditor
    ]
    proven = set(proven) - convicted
    grown = True
    while grown:
        new = {accused for auditor, accused in passes if auditor == reader or auditor in proven} - proven - convicted
        proven |= new
        grown = bool(new)
    return proven


def refused_peer_ids(
    audits: Mapping[str, AuditRecord], commitments: Mapping[str, CommitmentRecord], reader: str
) -> set[str]:
    """The peer ids of the keys `reader` convicts, for those whose id no other key names."""
    ids = claimed_ids(commitments)
    return {ids[key] for key in convicted_by(audits, reader) if key in ids}


def unaudited_keys(commitments: Mapping[str, CommitmentRecord]) -> set[str]:
    """The signing keys whose work nobody can audit now: at none of the last UNAUDITED_STEPS steps at which each
    committed microbatches is its lineage one another key committed at, while two other keys or more committed at one
    lineage (a body of peers that can audit each other: between two peers whose lineages differ, there is no telling
    which one is apart). An audit recomputes only microbatches committed at the auditor's own lineage (auditor.py),
    and a lineage is its writer's word: a peer that names a lineage, or steps, of its own is never audited, so never
    convicted. An honest peer holds a lineage of its own while it is apart (a round it missed or took a step behind,
    until its repair or next download)."""
    held_by: dict[tuple[int, str], set[str]] = defaultdict(set)
    latest: dict[str, list[tuple[int, str]]] = {}
    for key, record in commitments.items():
        for commitment in record.steps:
            held_by[commitment.step, commitment.lineage].add(key)
        worked = sorted((c.step, c.lineage) for c in record.steps if c.microbatches)
        if worked:
            latest[key] = worked[-UNAUDITED_STEPS:]
    alone = {key for key, steps in latest.items() if all(held_by[at] == {key} for at in steps)}
    body = {key for keys in held_by.values() if len(keys) >= 2 for key in keys}
    return {key for key in alone if len(body - {key}) >= 2}
