"""Verified credit: what the audits (training/audit/) say of each peer's work, as the monitor shows it.

Every AUDITS_REFRESH seconds the monitor reads the run's audit records, passed and failed verdicts, and keeps every
verdict in its history (an auditor's records hold only their last 16 of each). Per peer, that is per signing key
(the key of its metrics records too):

    audited     its microbatches that some auditor recomputed; each one passed or failed by the majority of its
                auditors (a tie counts as neither)
    convicted   CONVICTING_AUDITORS different auditors or more failed microbatches of it
    committed   the rows its commitment records named, summed over the global steps the monitor read them at
                (each step's as first read: a record published again with more rows adds none)
    verified    its claimed samples, at most the rows it committed, x the share of its audited microbatches that
                passed, with the 95% Wilson interval of that share; 0 before its first audit (interval: 0 to that
                bound), 0 once convicted

A claim counts only as far as the rows behind it were committed: a peer that claims more samples than it trained
on, or than it let the auditors pick from, is credited for its commitments alone. A commitment record covers a
peer's last COMMITMENTS_KEPT global steps, so a monitor reading every AUDITS_REFRESH seconds sees every step of a
run whose steps take AUDITS_REFRESH / COMMITMENTS_KEPT seconds or more; of faster steps, and of steps before the
monitor started, it credits only those it read.

The monitor recomputes nothing, so unlike a peer (records.py's `convicted_by`) it takes the auditors' word: what
it shows, it shows; whom the averagers refuse, each peer decides for itself. An honest peer that some key falsely
accuses gets a passed verdict on the same microbatch from each honest peer that re-checks it, so one accuser is
outvoted; keys that outnumber the honest re-checkers of one microbatch can still mark a peer on the dashboard.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from training.audit.records import CONVICTING_AUDITORS, AuditRecord, CommitmentRecord, read_records, unaudited_keys

AUDITS_REFRESH = 10.0  # seconds between two reads of the audit and commitment records
Z_95 = 1.96  # the normal quantile of a two-sided 95% interval


@dataclass(frozen=True)
class VerdictRow:
    """One auditor's verdict on one committed microbatch, as the history keeps it."""

    auditor: str
    accused: str
    step: int
    lineage: str
    microbatch: int
    passed: bool


@dataclass(frozen=True)
class CommittedRows:
    """The rows one signing key committed at one global step (and lineage), as the history keeps them."""

    key: str
    step: int
    lineage: str
    rows: int


@dataclass(frozen=True)
class Standing:
    """What the audits say of one signing key's work."""

    passed: int = 0  # its audited microbatches that passed
    failed: int = 0  # that failed
    accusers: frozenset[str] = frozenset()  # the auditors of the microbatches that failed who failed them

    @property
    def convicted(self) -> bool:
        """CONVICTING_AUDITORS different auditors or more failed its microbatches."""
        return len(self.accusers) >= CONVICTING_AUDITORS

    def credit(self, claimed: int, committed: int) -> tuple[int, int, int]:
        """Verified samples of a claim, of which `committed` rows were committed: (estimate, low, high) of the 95%
        interval."""
        claimed = min(claimed, committed)
        if self.convicted:
            return 0, 0, 0
        audited = self.passed + self.failed
        if audited == 0:
            return 0, 0, claimed
        low, high = wilson(self.passed, audited)
        return round(claimed * self.passed / audited), math.floor(claimed * low), math.ceil(claimed * high)


def wilson(successes: int, trials: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a binomial share (sound for a handful of trials, and at 0 or all of them)."""
    share, spread = successes / trials, z * z / trials
    centre = (share + spread / 2) / (1 + spread)
    half = z * math.sqrt(share * (1 - share) / trials + spread / (4 * trials)) / (1 + spread)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class Votes:
    """The verdicts of different auditors (never the accused's own) on one audited microbatch."""

    accused: str
    passers: frozenset[str]  # the auditors who passed it
    failers: frozenset[str]  # the auditors who failed it


def votes_of(verdicts: Iterable[VerdictRow]) -> list[Votes]:
    """The verdicts of other auditors than the accused (its own count for nothing) on each audited microbatch."""
    passers: dict[tuple, set[str]] = defaultdict(set)
    failers: dict[tuple, set[str]] = defaultdict(set)
    for v in verdicts:
        if v.auditor != v.accused:
            (passers if v.passed else failers)[(v.accused, v.step, v.lineage, v.microbatch)].add(v.auditor)
    return [
        Votes(audited[0], frozenset(passers[audited]), frozenset(failers[audited])) for audited in {*passers, *failers}
    ]


def standings(votes: Iterable[Votes]) -> dict[str, Standing]:
    """Signing key -> its standing, from the votes on each of its audited microbatches."""
    passed: dict[str, int] = defaultdict(int)
    failed: dict[str, int] = defaultdict(int)
    accusers: dict[str, set[str]] = defaultdict(set)
    for vote in votes:
        if len(vote.passers) > len(vote.failers):
            passed[vote.accused] += 1
        elif len(vote.failers) > len(vote.passers):
            failed[vote.accused] += 1
            accusers[vote.accused].update(vote.failers)
    return {key: Standing(passed[key], failed[key], frozenset(accusers[key])) for key in {*passed, *failed}}


def convicted_keys(found: Mapping[str, Standing]) -> set[str]:
    """The signing keys of those standings that are convicted."""
    return {key for key, standing in found.items() if standing.convicted}


def verdict_rows(records: dict[str, AuditRecord]) -> list[VerdictRow]:
    return [
        VerdictRow(auditor, v.accused, v.step, v.lineage, v.microbatch, v.passed)
        for auditor, record in records.items()
        for v in record.verdicts
    ]


def committed_rows(records: dict[str, CommitmentRecord]) -> list[CommittedRows]:
    return [
        CommittedRows(key, commitment.step, commitment.lineage, sum(len(m.rows) for m in commitment.microbatches))
        for key, record in records.items()
        for commitment in record.steps
    ]


@dataclass(frozen=True)
class AuditReading:
    """What one read of the audit and commitment records found."""

    verdicts: list[VerdictRow]
    committed: list[CommittedRows]
    unaudited: frozenset[str] | None = None  # the keys nobody can audit now (`unaudited_keys`); None: not read


class AuditWatch:
    """Reads the run's audit and commitment records every AUDITS_REFRESH seconds (the refresh keeps what they say in
    the history)."""

    def __init__(self, dht, run_id: str) -> None:
        self.dht, self.run_id = dht, run_id
        self.read_at = -float("inf")

    def read(self) -> AuditReading:
        """Every verdict and commitment the records hold now; none when the last read is not AUDITS_REFRESH old."""
        if time.monotonic() - self.read_at < AUDITS_REFRESH:
            return AuditReading([], [])
        self.read_at = time.monotonic()
        commitments, passed, failed = read_records(self.dht, self.run_id)
        found = verdict_rows(passed) + verdict_rows(failed)
        return AuditReading(found, committed_rows(commitments), frozenset(unaudited_keys(commitments)))
