"""An auditor's verdicts: kept, published under its signing key, and the convictions they make with the others'.

Two kinds of peer judge: a trainer (auditor.py: its audits, re-checks and reducer's checks) and a public helper
(helper.py: its reducer's checks alone). Both keep their verdicts, publish them and convict by the same rule
(records.py's `convicted_by`: two auditors, the reader among them) through one `Ledger`, and both read the run's
records the same way (`read_records`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rich.console import Console

from training.audit.records import (
    RECORD_LIFE,
    VERDICTS_KEPT,
    AuditRecord,
    CommitmentRecord,
    Verdict,
    accusations_key,
    audits_key,
    claimed_ids,
    commitments_key,
    convicted_by,
    convicting_auditors,
    publish,
    read_keys,
)

DHT_READ_TIMEOUT = 2.0  # seconds a new step waits for the records at most (a home's DHT may be slow)


def kept_verdicts(verdicts: list[Verdict]) -> list[Verdict]:
    """The VERDICTS_KEPT newest verdicts of each kind, passed and failed: each kind has its record, so a conviction
    does not fade as passed audits go on."""
    kept = {id(v) for passed in (True, False) for v in [v for v in verdicts if v.passed == passed][-VERDICTS_KEPT:]}
    return [verdict for verdict in verdicts if id(verdict) in kept]


def read_records(
    dht, run_id: str, with_commitments: bool
) -> tuple[dict[str, AuditRecord], dict[str, CommitmentRecord] | None] | None:
    """The failed verdicts, read at every step (an honest swarm's auditors publish none), and the commitments (the
    larger read at a thousand peers: bench/records.py) only `with_commitments` (None: not read); None when the DHT
    did not answer within DHT_READ_TIMEOUT."""
    models = {accusations_key(run_id): AuditRecord}
    if with_commitments:
        models[commitments_key(run_id)] = CommitmentRecord
    found = read_keys(dht, models, DHT_READ_TIMEOUT)
    return None if found is None else (found[accusations_key(run_id)], found.get(commitments_key(run_id)))


def read_commitments(dht, run_id: str) -> dict[str, CommitmentRecord]:
    """The commitment records, read now ({}: the DHT did not answer within DHT_READ_TIMEOUT)."""
    found = read_keys(dht, {commitments_key(run_id): CommitmentRecord}, DHT_READ_TIMEOUT)
    return {} if found is None else found[commitments_key(run_id)]


@dataclass
class Ledger:
    """One auditor's verdicts, its records of them in the DHT, and whom it convicted."""

    dht: object
    run_id: str
    public_key: bytes
    key: str  # this auditor's signing key as the records name it (`peer_key`)
    peer_id: str  # the auditor its records name
    console: Console
    refuse: Callable[[list[str]], None] = lambda peer_ids: None  # tells the averagers (SwarmMember.refuse_convicted)
    # what a conviction does here, as this auditor's console says it
    outcome: str = "its averaging requests are refused and its data leases ignored from now on"
    verdicts: list[Verdict] = field(default_factory=list)
    convicted: set[str] = field(default_factory=set)
    published_at: float = -RECORD_LIFE  # monotonic time of this auditor's last record: republished before it expires
    convicted_here_by: set[str] = field(default_factory=set)  # the auditors convicting this peer, as its console said

    def publish(self, new: list[Verdict]) -> None:
        """This auditor's records: its passed verdicts (for the monitor's credit) and its failed ones (which every
        peer reads), each when it holds new verdicts, and both before they expire."""
        self.verdicts = kept_verdicts(self.verdicts)
        refresh = time.monotonic() >= self.published_at + RECORD_LIFE / 4
        for key, passed in ((audits_key(self.run_id), True), (accusations_key(self.run_id), False)):
            mine = [verdict for verdict in self.verdicts if verdict.passed == passed]
            if mine and (refresh or any(verdict.passed == passed for verdict in new)):
                publish(self.dht, key, self.public_key, AuditRecord(auditor=self.peer_id, verdicts=mine))
        if refresh:
            self.published_at = time.monotonic()

    def announce_convictions(
        self, accusations: dict[str, AuditRecord], commitments: dict[str, CommitmentRecord] | None
    ) -> None:
        """One line per peer this auditor newly convicts, and its averagers told to refuse it at once: by the peer id
        its commitments name, unless another key names it too (records.py's `claimed_ids`, as the averagers' own
        reads of the verdicts do; the commitments are read now if this step did not read them: None)."""
        ids = {v.accused: v.accused_peer_id for record in accusations.values() for v in record.verdicts}
        ids.update({verdict.accused: verdict.accused_peer_id for verdict in self.verdicts})
        failed = [verdict for verdict in kept_verdicts(self.verdicts) if not verdict.passed]  # what convicts
        mine = {self.key: AuditRecord(auditor=self.peer_id, verdicts=failed)}
        convicted = convicted_by({**accusations, **mine}, self.key)
        new = [accused for accused in convicted if accused not in self.convicted]
        if not new:
            return
        named = claimed_ids(read_commitments(self.dht, self.run_id) if commitments is None else commitments)
        self.refuse([named[accused] for accused in new if accused in named])
        for accused in new:
            self.convicted.add(accused)
            self.console.print(
                f"audit: ...{ids[accused][-8:]} convicted by {len(convicted[accused])} auditors (this peer among "
                f"them): {self.outcome}"
            )

    def announce_own_conviction(self, accusations: dict[str, AuditRecord]) -> None:
        """A line when the auditors' failed verdicts convict this peer in their eyes (records.py's
        `convicting_auditors`), and another whenever one more auditor joins them: what they found, and what it costs.
        The peer goes on (others, whose checks it passed, still average with it): one that left on the word of two
        keys would let anyone send an honest peer away with two."""
        convicting = convicting_auditors(accusations, self.key)
        if not convicting or convicting.keys() <= self.convicted_here_by:
            return
        self.convicted_here_by |= convicting.keys()
        auditors = ", ".join(sorted(f"...{accusations[auditor].auditor[-8:]}" for auditor in convicting))
        found = sorted({what_failed(verdict) for verdicts in convicting.values() for verdict in verdicts})
        self.console.print(
            f"[yellow]audit: this peer is convicted by {len(convicting)} auditors ({auditors}): {'; '.join(found)}. "
            "They refuse its averaging requests and ignore its data leases from now on (an honest peer whose "
            "arithmetic differs from theirs: docs/training.md#checked-work)[/]"
        )


def what_failed(verdict: Verdict) -> str:
    """What a failed verdict found, in a few words."""
    if verdict.unleased:
        return "it trained on rows it had not leased"
    if verdict.samples_claimed is not None:
        return "it claimed more samples than it committed rows"
    if verdict.received:
        return "it sent a reducer something else than it committed"
    return "a microbatch it committed, recomputed, gives another gradient"
