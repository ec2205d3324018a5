"""A peer's part in the audits (training/audit/records.py): it commits to its work, and checks the others'.

Every microbatch it trains on, the peer notes the rows, the leased blocks they came from and the sketch of the
gradient (`Commitments`); at each new global step it publishes what it computed in the last ones, but for the
microbatches of a step before a state download, whose gradients the download reset (`forget_unsent`). It keeps its
parameters of the last SNAPSHOTS_KEPT global steps (`Recomputer`), so that it can recompute any microbatch the others
committed at a step it was at.

At each new global step t, with probability --audit-rate (its own coins: nobody knows in advance which steps it
checks), the peer picks at random one microbatch that another peer committed at step t - AUDIT_LAG (by then everyone
has published that step) and computed at the same parameters as its own (equal lineage), an outlying one likelier
(sketch.py's `audit_weights`: a sketch far from the step's others is picked up to 25 times as often), checks
that its rows were that peer's to read (leased.py), recomputes it, and publishes the verdict, passed or failed (a failed
one unless another peer's microbatch of that step and lineage fails at its parameters too: `own_parameters_off`). It
also re-checks every failed verdict of another auditor about a step it still holds, and publishes its own verdict on
the same evidence: a failed verdict becomes a conviction only where a second auditor checked the same (records.py's
`convicted_by`).

After each gradient round it reduced, it checks what each sender sent it against the sender's commitments of that
step (received.py), once they are in the DHT, and publishes a failed check as a failed verdict.

It publishes its passed verdicts and its failed ones under two keys: every peer reads the failed ones at every global
step (an honest swarm's auditors publish none) and every STEPLESS_READS seconds without one (to hear of its own
conviction: `Ledger.announce_own_conviction`); the commitments, the larger read at a thousand peers
(bench/records.py), only at a step it audits, re-checks or has reduced rounds to check; the passed ones only the
monitor reads.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pipeline.core.stream import CodeStream, DatasetIndex, collate, read_rows, with_tensors
from training.audit.leased import LeaseCheck, ReadLessees
from training.audit.ledger import Ledger, read_commitments, read_records
from training.audit.received import ReducerCheck
from training.audit.records import (
    AUDIT_LAG,
    COMMITMENTS_KEPT,
    AuditRecord,
    Commitment,
    CommitmentRecord,
    MicrobatchCommitment,
    Verdict,
    commitments_key,
    publish,
)
from training.audit.sketch import AUDIT_TOLERANCE, SKETCH_SIZE, Sketcher, audit_weights, sketch_distance
from training.model import DalleTransformer

SNAPSHOTS_KEPT = AUDIT_LAG + 2  # parameters kept for audits and re-checks (one step later than audits)
RECHECKS_PER_STEP = 2  # others' failed verdicts a peer recomputes at most per global step
STEPLESS_READS = 30.0  # seconds without a global step after which a peer reads the failed verdicts anyway


@dataclass
class Snapshot:
    """This peer's parameters (and buffers) at one global step, and their lineage."""

    lineage: str
    state: dict[str, torch.Tensor]


class Recomputer:
    """Recomputes the sketch of a committed microbatch at this peer's parameters of that step."""

    def __init__(self, model: torch.nn.Module, spare: torch.nn.Module, stream: CodeStream, sketcher: Sketcher) -> None:
        self.model, self.spare, self.sketcher = model, spare, sketcher  # `spare`: a second model of the same shape
        self.index: DatasetIndex = stream.index
        self.settings, self.tokenizer = stream.settings, stream.tokenizer
        self.snapshots: dict[int, Snapshot] = {}

    def keep(self, step: int, lineage: str) -> None:
        """Remember the model's parameters as they are at the start of global `step`, in host memory (a GPU's is
        the scarcer)."""
        for old in [s for s in self.snapshots if s <= step - SNAPSHOTS_KEPT]:  # first: SNAPSHOTS_KEPT at most
            del self.snapshots[old]
        state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in self.model.state_dict().items()}
        self.snapshots[step] = Snapshot(lineage, state)

    def sketch(self) -> list[float]:
        """The sketch of the gradient the live model holds now."""
        return self.sketcher.sketch([parameter.grad for parameter in self.model.parameters()])

    def recompute(self, step: int, rows: list[list[int]]) -> list[float] | None:
        """The sketch of the gradient of `rows` at this peer's parameters of `step`; None when a row is not in the
        dataset (the commitment names rows nobody can have trained on)."""
        batch = self.batch(rows)
        if batch is None:
            return None
        self.spare.load_state_dict(self.snapshots[step].state)
        self.spare.zero_grad(set_to_none=True)
        device = next(self.spare.parameters()).device
        self.spare(batch["text"].to(device), batch["codes"].to(device))["loss"].backward()
        sketch = self.sketcher.sketch([parameter.grad for parameter in self.spare.parameters()])
        self.spare.zero_grad(set_to_none=True)
        return sketch

    def batch(self, rows: list[list[int]]) -> dict | None:
        found = {}
        for unit in {unit for unit, _ in rows}:
            if not 0 <= unit < len(self.index.units):
                return None
            found.update({(unit, row.row): row for row in read_rows(self.index, self.settings, unit)[0]})
        if any((unit, row) not in found for unit, row in rows):
            return None
        return with_tensors(collate([found[unit, row] for unit, row in rows], self.tokenizer, self.settings.text_len))


@dataclass
class Commitments:
    """What this peer trained on in its last global steps, published as its signed commitment record."""

    peer_id: str
    steps: list[Commitment] = field(default_factory=list)
    current: Commitment | None = None

    def add(self, step: int, lineage: str, rows: list[list[int]], blocks: list[list[int]], sketch: list[float]) -> None:
        if self.current is None or self.current.step != step or self.current.lineage != lineage:
            self.close()
            self.current = Commitment(step=step, lineage=lineage, microbatches=[])
        self.current.microbatches.append(MicrobatchCommitment(rows=rows, blocks=blocks, sketch=sketch))

    def drop_current(self) -> None:
        """Forget the current step's microbatches: their gradients were never sent."""
        self.current = None

    def close(self) -> bool:
        """The current step's commitment into the record; whether there was one."""
        if self.current is None or not self.current.microbatches:
            return False
        self.steps = [*self.steps, self.current][-COMMITMENTS_KEPT:]
        self.current = None
        return True

    def record(self) -> CommitmentRecord:
        return CommitmentRecord(peer_id=self.peer_id, steps=self.steps)


@dataclass
class Audits:
    """This peer's commitments, audits and re-checks, and its reducer's checks (the module's docstring says when
    each happens), judged into its `Ledger`."""

    recomputer: Recomputer
    commitments: Commitments
    member_lineage: Callable[[], str]
    leases: LeaseCheck  # whether a microbatch's rows were its peer's to read
    ledger: Ledger  # this peer's verdicts, published and convicting (ledger.py)
    rate: float  # --audit-rate: the share of global steps at which this peer audits one microbatch
    reducer: ReducerCheck = field(default_factory=ReducerCheck)  # what its reducer received, checked (received.py)
    member_downloads: Callable[[], int] = int  # the state downloads this peer tried so far (SwarmMember.downloads)
    downloads_seen: int = 0
    coins: random.Random = field(default_factory=random.SystemRandom)
    checked: set[tuple[str, int, str, int]] = field(default_factory=set)  # (accused, step, lineage, microbatch) judged
    read_at: float = field(default_factory=time.monotonic)  # when this peer last read the failed verdicts

    def microbatch_done(self, step: int, batch: dict) -> None:
        """After a microbatch's backward pass: its rows, the leased blocks they came from and the sketch of the
        gradient it left in the model. A batch that names no blocks was read in the peer's own order (its DHT did not
        answer its leases): nothing to commit, since no lease holds its rows (leased.py)."""
        if "blocks" not in batch:
            return
        self.forget_unsent()
        lineage = self.member_lineage()
        kept = self.recomputer.snapshots.get(step)
        if kept is None or kept.lineage != lineage:  # the first step after joining, or a state downloaded mid-step
            self.recomputer.keep(step, lineage)
        self.commitments.add(step, lineage, batch["at"], batch["blocks"], self.recomputer.sketch())

    def commit_sent(self) -> None:
        """Publish the microbatches the new step's round took (but those a state download reset: `forget_unsent`).
        The loop calls it first at a new step, before it checks the parameters: non-finite ones make the peer roll
        back and download the swarm's state, and that download would drop what the round sent from the
        commitments, leaving the round's reducers only other steps' microbatches to judge the sender's sums by."""
        self.forget_unsent()
        if self.commitments.close():
            ledger = self.ledger
            publish(ledger.dht, commitments_key(ledger.run_id), ledger.public_key, self.commitments.record())

    def step_done(self, step: int) -> None:
        """At a new global `step` whose parameters are healthy (after `commit_sent`): keep them, audit the step
        AUDIT_LAG back if this peer's coin says so, re-check the others' failed verdicts."""
        self.recomputer.keep(step, self.member_lineage())
        self.checked = {judged for judged in self.checked if judged[1] > step - SNAPSHOTS_KEPT}
        auditing = self.coins.random() < self.rate
        reduced = self.reducer.collect()
        self.read_at = time.monotonic()
        found = read_records(self.ledger.dht, self.ledger.run_id, auditing or reduced)
        if found is None:  # a slow DHT costs this step its audits, not its time
            return
        accusations, commitments = found
        judged = len(self.ledger.verdicts)
        if auditing:
            self.audit_one(step - AUDIT_LAG, commitments)
        if reduced:
            self.reducer.check(step, commitments, self.ledger)
        self.recheck(accusations, commitments)
        self.ledger.publish(self.ledger.verdicts[judged:])
        self.ledger.announce_own_conviction(accusations)

    def between_steps(self) -> None:
        """From the loop, at every batch: a peer that took no global step in the last STEPLESS_READS seconds reads the
        failed verdicts, to hear of its own conviction. A convicted home takes no step again: every reducer it could
        average through and every peer it could download the state from refuses it."""
        if time.monotonic() < self.read_at + STEPLESS_READS:
            return
        self.read_at = time.monotonic()
        found = read_records(self.ledger.dht, self.ledger.run_id, with_commitments=False)
        if found is not None:
            self.ledger.announce_own_conviction(found[0])

    def forget_unsent(self) -> None:
        """A state download, arrived or not, resets the gradients the peer gathered for its step (hivemind's
        `load_state_from_peers`): the microbatches of the step before it were never sent, so they are not committed.
        Committed, they were audited at parameters they may not have been computed at: two auditors convicted an
        honest joiner by the one microbatch of its first step, computed before the download that found it a step
        behind (its sketch off by 0.847; CI of stop 66)."""
        downloads = self.member_downloads()
        if downloads != self.downloads_seen:
            self.commitments.drop_current()
            self.downloads_seen = downloads

    def audit_one(self, step: int, commitments: dict[str, CommitmentRecord]) -> None:
        """One random microbatch another peer (not convicted yet) committed at `step`, at the same parameters as
        this peer's then; an outlying one (its sketch far from the step's others: `audit_weights`) is likelier."""
        snapshot = self.recomputer.snapshots.get(step)
        if snapshot is None:
            return
        committed = [
            (key, record.peer_id, index, microbatch.sketch)
            for key, record in commitments.items()
            for commitment in record.steps
            if commitment.step == step and commitment.lineage == snapshot.lineage
            for index, microbatch in enumerate(commitment.microbatches)
        ]
        weights = audit_weights([sketch for *_, sketch in committed])
        candidates = [
            (microbatch[:3], weight)
            for microbatch, weight in zip(committed, weights, strict=True)
            if microbatch[0] != self.ledger.key and microbatch[0] not in self.ledger.convicted
        ]
        if candidates:
            [picked] = self.coins.choices([c for c, _ in candidates], [w for _, w in candidates])
            self.judge(step, snapshot.lineage, *picked, commitments)

    def recheck(self, accusations: dict[str, AuditRecord], commitments: dict[str, CommitmentRecord] | None) -> None:
        """Recompute the evidence of up to RECHECKS_PER_STEP failed verdicts of other auditors about steps this peer
        still holds (from the commitments, read now if this step did not read them: None)."""
        due = [
            verdict
            for auditor, record in accusations.items()
            if auditor != self.ledger.key
            for verdict in record.verdicts
            if not verdict.passed and not verdict.received and verdict.accused != self.ledger.key
            and verdict.step in self.recomputer.snapshots
            and verdict.lineage == self.recomputer.snapshots[verdict.step].lineage
            and (verdict.accused, verdict.step, verdict.lineage, verdict.microbatch) not in self.checked
        ]  # fmt: skip
        if due and commitments is None:
            commitments = read_commitments(self.ledger.dht, self.ledger.run_id)
        for verdict in self.coins.sample(due, min(len(due), RECHECKS_PER_STEP)):  # many accusers cost no more
            self.judge(
                verdict.step, verdict.lineage, verdict.accused, verdict.accused_peer_id, verdict.microbatch, commitments
            )
        self.ledger.announce_convictions(accusations, commitments)

    def judge(
        self, step: int, lineage: str, accused: str, peer_id: str, index: int, commitments: dict[str, CommitmentRecord]
    ) -> None:
        """Check that one microbatch the accused committed at `step` and `lineage` (read from its own signed record;
        a peer whose state was downloaded mid-step commits two lineages of one step) was its to read (leased.py),
        recompute it, and record the verdict."""
        if (accused, step, lineage, index) in self.checked or accused not in commitments:
            return
        if step not in self.recomputer.snapshots:  # dropped by an earlier judgement: its parameters were off
            return
        committed = [c for c in commitments[accused].steps if c.step == step and c.lineage == lineage]
        if not committed or index >= len(committed[0].microbatches):
            return
        self.checked.add((accused, step, lineage, index))
        microbatch = committed[0].microbatches[index]
        judged = {"step": step, "accused": accused, "accused_peer_id": peer_id, "microbatch": index, "lineage": lineage}
        unleased = self.leases.why_not_leased(accused, microbatch)
        if unleased is not None:
            verdict = Verdict(**judged, distance=float("inf"), passed=False, unleased=True)
            why = f"was not its to read ({unleased})"
        else:
            recomputed = self.recomputer.recompute(step, microbatch.rows)
            distance = float("inf") if recomputed is None else sketch_distance(microbatch.sketch, recomputed)
            passed = distance <= AUDIT_TOLERANCE
            if not passed and recomputed is not None and self.own_parameters_off(step, lineage, accused, commitments):
                return
            evidence = {} if passed else {"claimed": microbatch.sketch, "recomputed": recomputed or [0.0] * SKETCH_SIZE}
            verdict = Verdict(**judged, distance=distance, passed=passed, **evidence)
            why = f"is not what it committed (sketch off by {distance:.3g} of its length)"
        self.ledger.verdicts.append(verdict)
        if not verdict.passed:
            line = f"audit: ...{peer_id[-8:]}'s microbatch {index} of step {step} {why}: verdict published"
            self.ledger.console.print(line)

    def own_parameters_off(
        self, step: int, lineage: str, accused: str, commitments: dict[str, CommitmentRecord]
    ) -> bool:
        """Before a failed verdict: whether this peer's parameters of `step` are not those its lineage names, for a
        microbatch another peer committed at the same step and lineage (not the accused's, the least outlying of
        them: `audit_weights`) fails here too. Then it forgets its parameters of that step, judges nothing of it and
        says so. A lineage is only a name for the rounds the parameters went through: a helper once failed honest
        peers' microbatches of three steps after a state round, by 1.2-2.1 of a sketch's length, at parameters of
        their lineage that were not theirs (clean-clone run 193; most likely a state round that gave a peer apart the
        others' lineage, since mended: training/swarm/optimizer.py), and two such auditors would convict an honest
        peer."""
        others = [
            microbatch
            for key, record in commitments.items()
            if key not in (accused, self.ledger.key) and key not in self.ledger.convicted
            for commitment in record.steps
            if commitment.step == step and commitment.lineage == lineage
            for microbatch in commitment.microbatches
        ]
        if not others:
            return False
        weights = audit_weights([microbatch.sketch for microbatch in others])
        least = min(weights)
        control = self.coins.choice([m for m, weight in zip(others, weights, strict=True) if weight == least])
        recomputed = self.recomputer.recompute(step, control.rows)
        if recomputed is None or sketch_distance(control.sketch, recomputed) <= AUDIT_TOLERANCE:
            return False
        del self.recomputer.snapshots[step]
        self.ledger.console.print(
            f"audit: this peer's parameters of step {step} are not its lineage's (two peers' microbatches fail at "
            "them): no verdict on that step"
        )
        return True


class AuditedMember(Protocol):
    """What the audits read of a peer's part in the swarm (training/swarm/member.py's `SwarmMember`)."""

    @property
    def lineage(self) -> str: ...

    @property
    def downloads(self) -> list: ...

    def received_rounds(self) -> list[dict]: ...

    def leave_out_unaudited(self, peer_ids: list[str]) -> None: ...


def open_audits(
    ledger: Ledger,
    rate: float,
    model: DalleTransformer,
    member: AuditedMember,
    stream: CodeStream,
    sketcher: Sketcher,
    read_lessees: ReadLessees,
    seed: int,
) -> Audits:
    """A peer's commitments and audits, judged into its `ledger`, with a second model to recompute the others' work:
    a trainer's, and a public helper's that recomputes (`ttt monitor --audit-rate`: training/audit/helper.py), which
    commits nothing. `read_lessees`: the run's leases, read from its DHT (training/swarm/leases.py's `lessees`);
    `seed`: the run's, which plans each epoch's blocks."""
    spare = DalleTransformer(model.config).to(next(model.parameters()).device)
    return Audits(
        recomputer=Recomputer(model, spare, stream, sketcher), commitments=Commitments(ledger.peer_id),
        member_lineage=lambda: member.lineage,
        leases=LeaseCheck(read_lessees, [unit.rows for unit in stream.index.units], seed),
        ledger=ledger, rate=rate, reducer=ReducerCheck(member.received_rounds, member.leave_out_unaudited),
        member_downloads=lambda: len(member.downloads),
    )  # fmt: skip
