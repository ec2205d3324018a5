"""Checked work (training/audit/): sketches, recomputation of a committed microbatch, and who convicts whom."""

import asyncio
import io
import json
import re
import signal
import statistics
import time
from concurrent.futures import Future
from functools import partial
from types import SimpleNamespace

import pydantic.v1 as pydantic
import pytest
import torch
from hivemind.utils import ValueWithExpiration, get_dht_time
from rich.console import Console

from pipeline.core.stream import CodeStream
from tests.test_leases import SilentDHT, lease_books, swarm_stream
from tests.test_stream import CODEBOOK, GRID, write_dataset
from training.audit.auditor import STEPLESS_READS, Audits, Commitments, Recomputer
from training.audit.helper import HELPER_OUTCOME, HelperChecks
from training.audit.leased import LeaseCheck
from training.audit.ledger import Ledger, kept_verdicts
from training.audit.received import (
    RECEIVED_TOLERANCE,
    ReducerCheck,
    committed_runs,
    failure_line,
    received_failures,
)
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
    claimed_ids,
    commitments_key,
    convicted_by,
    proven_by,
    refused_peer_ids,
    unaudited_keys,
)
from training.audit.sketch import (
    AUDIT_TOLERANCE,
    OUTLIER_WEIGHT,
    SKETCH_SIZE,
    Sketcher,
    audit_weights,
    run_seed,
    sketch_distance,
)
from training.audit.standing import AuditStanding
from training.config import ModelConfig
from training.metrics import peer_key
from training.model import DalleTransformer
from training.monitor.snapshots import SwarmSnapshots
from training.monitor.verified import AuditWatch
from training.swarm.leases import lessees
from training.swarm.member import SwarmMember
from training.swarm.optimizer import Download

CONFIG = ModelConfig(codebook_size=CODEBOOK, grid=GRID, text_len=16, width=32, layers=2, heads=2, head_dim=16)


@pytest.fixture
def stream(tmp_path) -> CodeStream:
    write_dataset(tmp_path, files=2, rows_per_file=20, row_group=10)
    return CodeStream(tmp_path, batch_size=4, text_len=CONFIG.text_len, seed=0, peer="p", shuffle_buffer=8)


def model() -> DalleTransformer:
    torch.manual_seed(0)
    return DalleTransformer(CONFIG)


def sketcher_of(net: torch.nn.Module) -> Sketcher:
    return Sketcher.for_run([parameter.numel() for parameter in net.parameters()], run_seed("run"))


def gradient_of(net: DalleTransformer, batch: dict) -> list[torch.Tensor]:
    net.zero_grad(set_to_none=True)
    net(batch["text"], batch["codes"])["loss"].backward()
    return [parameter.grad.clone() for parameter in net.parameters()]


def test_a_sketch_is_linear_and_the_same_for_every_peer_of_a_run():
    sizes = [300, 7, 1000]
    grads = [torch.randn(size) for size in sizes]
    others = [torch.randn(size) for size in sizes]
    sketcher = Sketcher.for_run(sizes, run_seed("run"))
    again = Sketcher.for_run(sizes, run_seed("run"))
    summed = sketcher.sketch([a + b for a, b in zip(grads, others, strict=True)])
    parts = [a + b for a, b in zip(sketcher.sketch(grads), sketcher.sketch(others), strict=True)]
    assert torch.allclose(torch.tensor(summed), torch.tensor(parts), atol=1e-5)
    assert again.sketch(grads) == sketcher.sketch(grads) and len(summed) == SKETCH_SIZE
    assert Sketcher.for_run(sizes, run_seed("another run")).sketch(grads) != sketcher.sketch(grads)
    assert sketcher.sketch([None, grads[1], grads[2]]) != sketcher.sketch(grads)  # a parameter without a gradient


def test_every_attack_moves_the_sketch_by_about_its_length(stream):
    """What each attacker sends, against the honest gradient of its batch: far outside the tolerance."""
    net = model()
    batches = iter(stream)
    first, second = next(batches), next(batches)
    honest = gradient_of(net, first)
    sketcher = Sketcher.for_run([p.numel() for p in net.parameters()], run_seed("run"))
    recomputed = sketcher.sketch(gradient_of(net, first))
    assert sketch_distance(sketcher.sketch(honest), recomputed) == 0.0
    attacks = {
        "free rider": [torch.zeros_like(g) for g in honest],
        "quiet poisoner (-9x)": [-9 * g for g in honest],
        "wrong rows": gradient_of(net, second),
    }
    for name, sent in attacks.items():
        assert sketch_distance(sketcher.sketch(sent), recomputed) > 1.5 * AUDIT_TOLERANCE, name


def test_a_recomputed_microbatch_matches_what_its_peer_committed(stream):
    """The auditor reads the committed rows back from the dataset and gets the same sketch at the same parameters;
    rows that are not in the dataset cannot be recomputed."""
    net = model()
    recomputer = Recomputer(net, DalleTransformer(CONFIG), stream, sketcher_of(net))
    recomputer.keep(3, "lineage")
    batch = next(iter(stream))
    gradient_of(net, batch)
    committed = recomputer.sketch()
    assert sketch_distance(committed, recomputer.recompute(3, batch["at"])) == 0.0
    assert recomputer.recompute(3, [[0, 999]]) is None and recomputer.recompute(3, [[99, 0]]) is None
    with torch.no_grad():  # the live model moves on; the snapshot of step 3 stays
        next(net.parameters()).add_(1.0)
    assert sketch_distance(committed, recomputer.recompute(3, batch["at"])) == 0.0


def test_an_audit_recomputes_the_commitment_of_its_own_lineage_when_a_step_has_two(stream):
    """A peer whose state was downloaded mid-step commits two lineages of that step: each microbatch is judged against
    the one it was computed at (judging the first found convicted honest joiners)."""
    net = model()
    recomputer = Recomputer(net, DalleTransformer(CONFIG), stream, sketcher_of(net))
    recomputer.keep(3, "downloaded")
    batches = iter(stream)
    before, after = next(batches), next(batches)
    accused = Commitments("id-x")
    accused.add(3, "own", before["at"], [[0, 0]], [1.0] * SKETCH_SIZE)  # at the parameters it had before its download
    gradient_of(net, after)
    accused.add(3, "downloaded", after["at"], [[0, 0]], recomputer.sketch())
    accused.close()
    auditor = Audits(
        recomputer=recomputer, commitments=Commitments("id-me"), member_lineage=lambda: "downloaded",
        leases=Leased(), ledger=ledger_of(None), rate=0.0,
    )  # fmt: skip
    auditor.judge(3, "downloaded", "x", "id-x", 0, {"x": accused.record()})
    assert [(v.lineage, v.passed) for v in auditor.ledger.verdicts] == [("downloaded", True)]


def test_the_microbatches_of_a_step_before_a_state_download_are_not_committed(stream):
    """A state download resets the gradients gathered for the step (hivemind): the microbatches before it were never
    sent. Committed, they were audited at parameters they may not have been computed at: two auditors convicted an
    honest joiner by the one microbatch of its first step, before the download that found it a step behind (CI).
    A download after a new step began (non-finite parameters after the round: the loop's rollback) keeps what that
    round took: the loop commits it first (`commit_sent`), then looks at the parameters."""
    downloads = 0
    auditor = auditor_of(RecordsDHT({}, {}), stream)
    auditor.member_downloads = lambda: downloads
    batches = iter(stream)

    def microbatch(step: int) -> None:
        batch = next(batches)
        gradient_of(auditor.recomputer.model, batch)
        auditor.microbatch_done(step, {**batch, "blocks": [[0, 0]]})

    def new_step(step: int) -> None:  # as the loop's `on_new_step` with healthy parameters
        auditor.commit_sent()
        auditor.step_done(step)

    microbatch(3), microbatch(3)
    downloads += 1  # a repair's download, say, and the step goes on
    microbatch(3)
    new_step(4)
    microbatch(4)
    downloads += 1  # found a step behind: downloaded, the step's one microbatch unsent
    new_step(5)
    microbatch(5), microbatch(5)
    auditor.commit_sent()  # step 6 began, and its parameters are not finite: rolled back, and a download
    downloads += 1
    microbatch(6)
    assert [(c.step, len(c.microbatches)) for c in auditor.commitments.record().steps] == [(3, 1), (5, 2)]


def test_a_state_download_drops_the_gradients_of_the_batch_before_it():
    """The loop's repair download comes between a batch's backward and its optimizer step. The audits hold that
    batch unsent (above): its gradients must not reach the next round, after the download reset the step's
    accumulator. Three reducers failed two honest senders whose repair had sent them (bench.verify)."""
    calls = []
    optimizer = SimpleNamespace(
        load_state_from_peers=lambda then_train: calls.append("download"),
        zero_grad=lambda: calls.append("zero_grad"),
        downloads=[Download(1.0, True)],
    )
    assert SwarmMember(optimizer, torch.nn.Linear(1, 1)).download_state().arrived
    assert calls == ["download", "zero_grad"]


class Leased:
    """The lease check of an auditor (training/audit/leased.py, tested through a real DHT below) that finds every
    microbatch's rows its peer's, or none (WHY: why not)."""

    def __init__(self, why: str | None = None) -> None:
        self.why = why

    def why_not_leased(self, accused: str, microbatch: MicrobatchCommitment) -> str | None:
        return self.why


def test_the_rows_a_peer_committed_pass_only_where_its_own_leases_name_their_blocks(tmp_path):
    """The wrong-rows check through a real DHT: every batch a peer read from its leases is its own; the same rows
    are not another peer's, nor a commitment's whose blocks do not hold its rows; a DHT that does not answer convicts
    nobody. A peer reading in its own order (its DHT did not answer its leases) names no blocks, and commits nothing."""
    folder = tmp_path / "data"
    write_dataset(folder)
    dhts, books = lease_books(2, lease=120.0)
    try:
        stream = swarm_stream(folder, books[0])
        units = [unit.rows for unit in stream.index.units]
        check = LeaseCheck(partial(lessees, dhts[1], "coverage", timeout=10.0), units, seed=3)
        reader, other = peer_key(books[0].public_key), peer_key(books[1].public_key)
        batches = list(stream)
        read = [MicrobatchCommitment(rows=b["at"], blocks=b["blocks"], sketch=[0.0] * SKETCH_SIZE) for b in batches]
        assert len(read) > 3 and all(check.why_not_leased(reader, microbatch) is None for microbatch in read)
        assert all("which it did not lease" in check.why_not_leased(other, microbatch) for microbatch in read)
        elsewhere = read[0].copy(update={"blocks": [[0, b] for b in range(len(units)) if [0, b] not in read[0].blocks]})
        assert "in none of the blocks it names" in check.why_not_leased(reader, elsewhere)
        silent = LeaseCheck(partial(lessees, SilentDHT(), "coverage", timeout=0.2), units, seed=3)
        assert silent.why_not_leased(other, read[0]) is None
    finally:
        for dht in dhts:
            dht.shutdown()
    auditor = auditor_of(RecordsDHT({}, {}), stream)
    auditor.microbatch_done(3, {key: value for key, value in batches[0].items() if key != "blocks"})
    assert not auditor.commitments.close()


def test_an_auditor_whose_parameters_are_not_its_lineages_accuses_nobody(stream):
    """An auditor whose parameters of a step are not those its lineage names fails every honest microbatch of it.
    Before a failed verdict it recomputes another peer's microbatch of the same step and lineage: when that fails
    too, it forgets the step's parameters and judges nothing of it; when that passes, the accused is off."""
    peers = model()  # the parameters the peers committed at
    batches = iter(stream)
    records = {}
    for name, scale in (("x", 1.0), ("z", 1.0), ("w", -9.0)):  # w: a quiet poisoner, never the control
        batch = next(batches)
        sketch = [scale * value for value in sketcher_of(peers).sketch(gradient_of(peers, batch))]
        commitments = Commitments(f"id-{name}")
        commitments.add(3, "l", batch["at"], [[0, 0]], sketch)
        commitments.close()
        records[peer_key(name.encode())] = commitments.record()
    x, w = peer_key(b"x"), peer_key(b"w")

    off = auditor_of(RecordsDHT({}, records), stream)
    torch.manual_seed(1)
    off.recomputer.model.load_state_dict(DalleTransformer(CONFIG).state_dict())  # other parameters, the same lineage
    off.recomputer.keep(3, "l")
    off.judge(3, "l", x, "id-x", 0, records)
    assert off.ledger.verdicts == [] and 3 not in off.recomputer.snapshots
    assert "parameters of step 3 are not its lineage's" in off.ledger.console.file.getvalue()
    off.judge(3, "l", w, "id-w", 0, records)  # nothing more of that step
    assert off.ledger.verdicts == []

    right = auditor_of(RecordsDHT({}, records), stream)
    right.recomputer.keep(3, "l")
    for accused in (x, w):
        right.judge(3, "l", accused, f"id-{accused}", 0, records)
    assert [(v.accused, v.passed) for v in right.ledger.verdicts] == [(x, True), (w, False)]
    assert 3 in right.recomputer.snapshots


def test_an_audit_of_rows_the_accused_did_not_lease_fails_and_a_second_auditor_convicts_on_its_own_check(stream):
    """Rows that were not the accused's to read fail its audit whatever their sketch; the verdict's evidence is in
    the DHT (the accused's commitment and leases), so it holds no sketches; another auditor checks the same and
    convicts."""
    commitments = Commitments("id-x")
    commitments.add(3, "l", next(iter(stream))["at"], [[0, 0]], [0.0] * SKETCH_SIZE)
    commitments.close()
    x, why = peer_key(b"x"), "its row 4 of row group 1 is in block 1 of epoch 0, which it did not lease"
    auditor = auditor_of(RecordsDHT({}, {"x": commitments.record()}), stream, leases=Leased(why))
    auditor.recomputer.keep(3, "l")
    auditor.judge(3, "l", x, "id-x", 0, {x: commitments.record()})
    [failed] = auditor.ledger.verdicts
    assert (failed.passed, failed.unleased, failed.claimed, failed.distance) == (False, True, None, float("inf"))
    assert f"was not its to read ({why})" in " ".join(auditor.ledger.console.file.getvalue().split())
    record = AuditRecord.parse_obj(AuditRecord(auditor="id-me", verdicts=[failed]).dict(exclude_none=True))
    other = auditor_of(RecordsDHT({"a": record}, {"x": commitments.record()}), stream, leases=Leased(why))
    other.recomputer.keep(3, "l")
    other.recheck({peer_key(b"a"): record}, {x: commitments.record()})
    assert [(v.accused, v.unleased) for v in other.ledger.verdicts] == [(x, True)] and other.ledger.convicted == {x}


def test_an_outlying_microbatch_is_audited_likelier_and_a_decoy_cannot_draw_the_audits_off_it():
    """Honest sketches scatter around one gradient; a quiet poisoner's (-9x) lie about 9 scatters off and weigh
    OUTLIER_WEIGHT each; decoys of 1,000x weigh no more, so the poisoner keeps at least its uniform share."""
    generator = torch.Generator().manual_seed(0)
    gradient = torch.randn(SKETCH_SIZE, generator=generator)
    honest = [(gradient + torch.randn(SKETCH_SIZE, generator=generator)).tolist() for _ in range(12)]
    poisoned = [(-9 * (gradient + torch.randn(SKETCH_SIZE, generator=generator))).tolist() for _ in range(4)]
    weights = audit_weights(honest + poisoned)
    assert weights[12:] == [OUTLIER_WEIGHT] * 4 and statistics.mean(weights[:12]) < 2
    assert sum(weights[12:]) / sum(weights) > 0.8  # uniform picks: 0.25
    decoys = [[1000.0 * value for value in sketch] for sketch in honest[:4]]
    weights = audit_weights(honest + poisoned + decoys)
    assert sum(weights[12:16]) / sum(weights) >= 4 / 20
    assert audit_weights(honest[:2]) == [1.0, 1.0] and audit_weights([[0.0] * SKETCH_SIZE] * 3) == [1.0] * 3


def test_an_audit_picks_no_microbatch_of_a_peer_it_convicted_already(stream):
    commitments = Commitments("id-x")
    commitments.add(3, "l", next(iter(stream))["at"], [[0, 0]], [0.0] * SKETCH_SIZE)
    commitments.close()
    x = peer_key(b"x")
    for convicted, judged in ((set(), 1), ({x}, 0)):
        auditor = auditor_of(RecordsDHT({}, {"x": commitments.record()}), stream)
        auditor.recomputer.keep(3, "l")
        auditor.ledger.convicted = convicted
        auditor.audit_one(3, {x: commitments.record()})
        assert len(auditor.ledger.verdicts) == judged


def test_commitments_keep_the_last_steps_and_start_anew_at_each_step():
    commitments = Commitments("peer")
    for step in range(COMMITMENTS_KEPT + 2):
        commitments.add(step, "l", [[0, 1]], [[0, 0]], [0.0] * SKETCH_SIZE)
        commitments.add(step, "l", [[0, 2]], [[0, 0]], [0.0] * SKETCH_SIZE)
    assert commitments.close() and not commitments.close()
    record = CommitmentRecord.parse_obj(commitments.record().dict())  # what the DHT's schema validator accepts
    assert [c.step for c in record.steps] == list(range(2, COMMITMENTS_KEPT + 2))
    assert all(len(c.microbatches) == 2 for c in record.steps)


def verdict(accused: str, passed: bool = False, step: int = 1) -> Verdict:
    evidence = {} if passed else {"claimed": [0.0] * SKETCH_SIZE, "recomputed": [1.0] * SKETCH_SIZE}
    return Verdict(
        step=step, accused=accused, accused_peer_id=f"id-{accused}", microbatch=0, lineage="l",
        distance=0.0 if passed else 10.0, passed=passed, **evidence,
    )  # fmt: skip


def test_a_failed_verdict_holds_its_evidence_and_a_passed_one_no_sketches():
    """A passed verdict leaves both sketches out (they were four fifths of an auditor's record); a failed one without
    them is not a verdict, so any peer can re-check what it says."""
    assert verdict("h", passed=True).dict()["claimed"] is None
    failed = verdict("x").dict()
    assert Verdict.parse_obj(failed) == verdict("x")
    for sketch in "claimed", "recomputed":
        with pytest.raises(pydantic.ValidationError, match="a failed verdict holds both sketches"):
            Verdict.parse_obj({**failed, sketch: None})


def audits(**verdicts: list[Verdict]) -> dict[str, AuditRecord]:
    return {auditor: AuditRecord(auditor=f"id-{auditor}", verdicts=found) for auditor, found in verdicts.items()}


def test_a_peer_convicts_only_what_it_recomputed_itself_and_a_second_auditor_confirmed():
    assert convicted_by(audits(me=[verdict("x")]), "me") == {}  # one auditor: nobody convicted
    assert convicted_by(audits(b=[verdict("x")], c=[verdict("x")]), "me") == {}  # two others: not on their word
    assert convicted_by(audits(me=[verdict("x")], b=[verdict("x")]), "me") == {"x": {"me", "b"}}
    assert convicted_by(audits(me=[verdict("x", passed=True)], b=[verdict("x")]), "me") == {}
    assert convicted_by(audits(me=[verdict("x")], x=[verdict("x")]), "me") == {}  # the accused does not count


def test_an_auditors_record_keeps_its_failed_verdicts_as_passed_ones_go_on():
    """A conviction must not fade because the auditor went on passing other peers' work."""
    verdicts = [verdict("x", step=1), verdict("x", step=2)] + [verdict("h", passed=True, step=s) for s in range(3, 40)]
    kept = kept_verdicts(verdicts)
    assert len(kept) == 2 + VERDICTS_KEPT and [v.step for v in kept[:2]] == [1, 2]
    assert [v.step for v in kept[2:]] == list(range(40 - VERDICTS_KEPT, 40))
    assert kept_verdicts(verdicts[:3]) == verdicts[:3]


def test_a_false_accuser_with_many_keys_convicts_nobody():
    """Five keys accuse honest h; the reader's own re-check of h passed: h stays in, whatever they publish."""
    accusers = {f"liar{i}": [verdict("h")] for i in range(5)}
    records = audits(**accusers, me=[verdict("h", passed=True)])
    assert convicted_by(records, "me") == {}
    assert refused_peer_ids(records, {}, "me") == set()


def test_a_key_that_names_another_peers_id_convicts_only_itself():
    """An impostor commits under honest h's peer id: its conviction refuses no id (two keys name it)."""
    commitments = {
        "h": CommitmentRecord(peer_id="id-h", steps=[]),
        "impostor": CommitmentRecord(peer_id="id-h", steps=[]),
        "x": CommitmentRecord(peer_id="id-x", steps=[]),
    }
    assert claimed_ids(commitments) == {"x": "id-x"}
    records = audits(me=[verdict("impostor"), verdict("x")], b=[verdict("impostor"), verdict("x")])
    assert set(convicted_by(records, "me")) == {"impostor", "x"}
    assert refused_peer_ids(records, commitments, "me") == {"id-x"}


class RecordsDHT:
    """A run's DHT holding the given failed verdicts, commitments and passed verdicts, which notes the keys read and
    stored."""

    def __init__(
        self, accusations: dict[str, AuditRecord], commitments: dict[str, CommitmentRecord], passed: dict | None = None
    ) -> None:
        self.entries = {
            accusations_key("run"): as_entries(accusations),
            commitments_key("run"): as_entries(commitments),
            audits_key("run"): as_entries(passed or {}),
        }
        self.reads: list[str] = []
        self.stored: list[str] = []

    def get(self, key, latest, return_future, beam_size) -> Future:
        self.reads.append(key)
        found = Future()
        found.set_result(self.entries[key])
        return found

    def store(self, key, **record) -> None:
        self.stored.append(key)


def as_entries(records: dict[str, pydantic.BaseModel]) -> ValueWithExpiration:
    """Records as a `dht.get` returns them, each under the subkey of its name: the reader knows it as
    `peer_key(name.encode())`."""
    expiration = get_dht_time() + 60
    entries = {
        name.encode(): ValueWithExpiration(record.dict(exclude_none=True), expiration)
        for name, record in records.items()
    }
    return ValueWithExpiration(entries, expiration)


def ledger_of(dht: RecordsDHT | None) -> Ledger:
    return Ledger(dht=dht, run_id="run", public_key=b"", key="me", peer_id="id-me", console=Console(file=io.StringIO()))


def auditor_of(dht: RecordsDHT, stream: CodeStream, rate: float = 0.0, leases: Leased | None = None) -> Audits:
    net = model()
    recomputer = Recomputer(net, DalleTransformer(CONFIG), stream, sketcher_of(net))
    return Audits(
        recomputer=recomputer, commitments=Commitments("id-me"), member_lineage=lambda: "l",
        leases=leases or Leased(), ledger=ledger_of(dht), rate=rate,
    )  # fmt: skip


def test_a_step_reads_the_failed_verdicts_and_the_commitments_only_when_it_audits_or_rechecks(stream):
    """What the audits read at a thousand peers (bench/records.py): a step reads the failed verdicts (an honest
    swarm's auditors publish none), and the commitments only when its coin says audit or a failed verdict is due a
    re-check. Nobody but the monitor reads the passed verdicts."""
    accused = {"b": AuditRecord(auditor="id-b", verdicts=[verdict("x", step=3)])}
    for rate, accusations, reads in (
        (0.0, {}, ["accusations"]),
        (1.0, {}, ["accusations", "commitments"]),
        (0.0, accused, ["accusations", "commitments"]),
    ):
        dht = RecordsDHT(accusations, {"x": CommitmentRecord(peer_id="id-x", steps=[])})
        auditor_of(dht, stream, rate).step_done(3)
        assert dht.reads == [f"run_{key}" for key in reads], (rate, accusations)


def test_a_peer_without_a_step_for_a_while_reads_the_failed_verdicts_to_hear_of_its_own_conviction(stream):
    """A convicted home takes no step again (refused by every reducer and every peer that could serve it the state):
    between steps, it reads the failed verdicts at most every STEPLESS_READS seconds, and only those."""
    me = peer_key(b"me")  # this peer's key, as the others' records name it
    dht = RecordsDHT({name: AuditRecord(auditor=f"id-{name}", verdicts=[verdict(me)]) for name in "bc"}, {})
    auditor = auditor_of(dht, stream)
    auditor.ledger.key = me
    auditor.between_steps()
    assert dht.reads == []
    auditor.read_at -= STEPLESS_READS
    auditor.between_steps()
    auditor.between_steps()
    assert dht.reads == ["run_accusations"]
    assert "this peer is convicted by 2 auditors (...id-b, ...id-c)" in auditor.ledger.console.file.getvalue()


def test_an_auditor_publishes_its_passed_verdicts_for_the_monitor_and_its_failed_ones_for_every_peer(stream):
    dht = RecordsDHT({}, {})
    auditor = auditor_of(dht, stream)
    auditor.ledger.verdicts = [verdict("x", passed=True)]
    auditor.ledger.publish(auditor.ledger.verdicts)  # the first publication: the passed verdicts, nothing failed yet
    auditor.ledger.verdicts.append(verdict("y"))
    auditor.ledger.publish(auditor.ledger.verdicts[-1:])  # a new failed verdict: its record alone
    assert dht.stored == ["run_audits", "run_accusations"]


def test_the_monitor_reads_the_passed_and_the_failed_verdicts():
    dht = RecordsDHT(audits(a=[verdict("x")]), {}, passed=audits(b=[verdict("h", passed=True)]))
    rows = AuditWatch(dht, "run").read().verdicts
    assert {(row.auditor, row.accused, row.passed) for row in rows} == {
        (peer_key(b"a"), "x", False), (peer_key(b"b"), "h", True),
    }  # fmt: skip


def test_an_averager_reads_the_commitments_only_when_it_needs_peer_ids():
    """The averagers' refusal and probation name peer ids, which only the commitments hold: it reads them while
    somebody stands convicted, and once for each key it holds newly proven."""
    me, x = peer_key(b"me"), peer_key(b"x")
    commitments = {"x": CommitmentRecord(peer_id="id-x", steps=[])}
    for failed, passed, refused, proven, reads in (
        ({"me": [verdict(x)]}, {}, set(), {}, ["accusations", "audits"]),  # one auditor convicts nobody
        ({"me": [verdict(x)], "b": [verdict(x)]}, {}, {"id-x"}, {}, ["accusations", "audits", "commitments"]),
        ({}, {"me": [verdict(x, passed=True)]}, set(), {x: "id-x"}, ["accusations", "audits", "commitments"]),
    ):
        dht = RecordsDHT(audits(**failed), commitments, passed=audits(**passed))
        dht.get = lambda key, get=dht.get, **read: asyncio.wrap_future(get(key, **read))
        standing = AuditStanding("run", me)
        asyncio.run(standing.read(dht))
        assert (standing.refused, standing.proven_ids) == (refused, proven)
        assert dht.reads == [f"run_{key}" for key in reads]
        asyncio.run(standing.read(dht))  # a proven key's peer id is read once (and nobody was held since)
        again = [key for key in reads if key != "audits" and (key != "commitments" or refused)]
        assert dht.reads[len(reads) :] == [f"run_{key}" for key in again]


def test_an_averager_reads_the_passed_verdicts_again_only_after_it_held_a_sender_on_probation():
    """The passed verdicts (every auditor's) are read at the first refresh, then only after a reducer asked about a
    sender that was not proven: in a swarm whose every sender is proven, an averager stops reading them."""
    me, x = peer_key(b"me"), peer_key(b"x")
    dht = RecordsDHT({}, {"x": CommitmentRecord(peer_id="id-x", steps=[])}, passed=audits(me=[verdict(x, passed=True)]))
    dht.get = lambda key, get=dht.get, **read: asyncio.wrap_future(get(key, **read))
    standing = AuditStanding("run", me)
    reads = []
    for asked in (None, "id-x", None, "id-y", None):
        if asked is not None:
            standing.proven(SimpleNamespace(to_base58=lambda name=asked: name))  # a reducer asks about a sender
        before = len(dht.reads)
        asyncio.run(standing.read(dht))
        reads.append("run_audits" in dht.reads[before:])
    assert reads == [True, False, False, True, False]  # x is proven: asking about it is no reason to read
    assert standing.proven_ids == {x: "id-x"}


def test_a_peer_holds_proven_whom_it_or_an_auditor_it_holds_proven_passed():
    """Probation ends on the reader's own passed audit, or on one by an auditor whose own work it holds proven: trust
    grows from what it recomputed itself, never from strangers' word, and a conviction ends it."""
    passed = partial(verdict, passed=True)
    assert proven_by(audits(b=[passed("c")], c=[passed("b")]), "me", set(), set()) == set()  # strangers vouch
    assert proven_by(audits(b=[passed("c")], me=[passed("b")]), "me", set(), set()) == {"b", "c"}
    assert proven_by(audits(b=[passed("b")]), "me", {"c"}, set()) == {"c"}  # nobody proves itself; proven stays
    assert proven_by(audits(me=[passed("b")], b=[passed("c")]), "me", {"x"}, {"b", "x"}) == set()  # convicted
    assert proven_by(audits(me=[verdict("b")]), "me", set(), set()) == set()  # a failed verdict proves nothing


@pytest.mark.e2e
def test_a_quiet_poisoner_and_a_sketch_liar_are_convicted_and_left_out_and_nobody_else(sample_dataset, tmp_path):
    """a and b train honestly; x (a quiet poisoner) sends its gradients times -9 (under the 10x-median drop), commits
    to what it sends and claims its samples honestly; y commits its honest sketches and sends its gradients times -9.
    Every trainer audits one microbatch a step, and so does a public helper (`ttt monitor --assist-averaging
    --audit-rate 1`, which reads the run's dataset). Only a and the helper can reduce: b, x and y are homes (client
    mode), as most volunteers are. a, b and the helper each convict x (an audit or re-check of their own, and another
    auditor's: the attackers audit too); a and the helper convict y (each one's check of what y sent it as a reducer,
    and the other's); the reducers then refuse both, and nobody convicts an honest peer. The helper's recomputations
    fail x alone. Before the helper checked what it reduced, y was never convicted (b, a home, reduces nothing); before
    it recomputed, it never convicted x, which sends what it commits, and averaged it into every round it reached.
    `ttt status`, through the helper's page, reads the same verdicts and marks both attackers, and nobody else."""
    from tests.support.commands import SWARM_ARGS, run_ttt
    from tests.support.swarm_runs import HELPER_LEAVES, TTT, SwarmRun, free_port

    # x's -9x microbatches are outliers, which an audit picks up to 25 times as often as another (about 9 picks in
    # 10 here), so the first audits (step 2, of step 0) find it. y passes every audit: only the two reducers' checks
    # of what it sent them convict it, each in a round with y, each reading the other's verdict: by step 6 to 8 here,
    # and not by step 12 in the CI of stop 92 (a machine 1.4 times slower). So the honest peers train until the
    # reducers' and the helper's convictions are in, then two steps more (both attackers left out meanwhile), at most
    # 40 steps.
    args = ["--dataset", str(sample_dataset), "--run-id", "audited", "--max-steps", "40", *SWARM_ARGS,
            "--audit-rate", "1"]  # fmt: skip
    home = ["--reachability", "client"]
    run = SwarmRun(tmp_path, args)
    run.start("a", "--wait-for-peers", "4")
    port = free_port()
    helper = ["monitor", "--run-id", "audited", "--assist-averaging", "--audit-rate", "1", "--dataset",
              str(sample_dataset), "--initial-peers", run.address, "--port", str(port), "--host-maddrs",
              "/ip4/127.0.0.1/tcp/0", "--checkpoint-dir", str(tmp_path / "ckpt")]
    run.launch("helper", [TTT, *helper])  # fmt: skip
    run.start("b", *home)
    run.start("x", *home, fault="scale:-9")
    run.start("y", *home, fault="lie")
    x_id, y_id = (run.wait_for(name, r"client-mode peer (\w+)").group(1)[-8:] for name in ("x", "y"))
    convicted = r"audit: \.\.\.{} convicted by [234] auditors \(this peer among them\)"
    awaited = [("a", convicted.format(x_id)), ("b", convicted.format(x_id)), ("helper", convicted.format(x_id)),
               ("a", convicted.format(y_id)), ("helper", convicted.format(y_id)),
               ("helper", "audits: the trainers read this helper's data")]  # fmt: skip
    deadline = time.monotonic() + 480
    try:
        for name, pattern in awaited:
            run.wait_for(name, pattern, timeout=max(1.0, deadline - time.monotonic()))
        run.wait_for_step("a", max(step for step, _, _ in run.logs["a"].rounds) + 2, timeout=120)
    except AssertionError as missing:
        raise AssertionError(f"{str(missing)[:300]}\n{run.timeline()}\n{run.stop_stragglers()}") from None
    for name in ("a", "b"):
        run.kill(name, signal.SIGTERM)
    assert run.wait_for_exit(["a", "b"], timeout=120), run.stop_stragglers()
    # Each attacker is told, in one line, who convicts it: at its next step, or between batches within 30 s. One that
    # waits in a round its leaders refuse hears it when the round gives up (--averaging-timeout, 60 s): y, in CI run
    # 141, had not yet when a and b finished. (Waiting for these lines before stopping a and b ran the swarm to step
    # 15 in clean-clone run 193, where the helper failed honest microbatches of steps 11-13: most likely a state
    # round that gave a peer apart the others' lineage, docs/design/averaging.md#lineage.)
    for attacker in ("x", "y"):
        run.wait_for(attacker, r"audit: this peer is convicted by [234] auditors", timeout=120)
    for attacker in ("x", "y"):  # each alone now, and refused by both reducers
        if run.processes[attacker].poll() is None:  # (alone, it may have reached the last step first)
            run.kill(attacker)
    status = run_ttt("status", f"http://127.0.0.1:{port}/", "--json", timeout=120)
    run.kill("helper", signal.SIGINT)
    logs = run.finish(timeout=HELPER_LEAVES)

    assert all(logs[name].returncode == 0 for name in ("a", "b")), {n: log.text[-2000:] for n, log in logs.items()}
    for name in ("a", "b"):
        assert re.search(rf"audit: \.\.\.{x_id}'s microbatch \d+ of step \d+ is not what it committed", logs[name].text)
    # The helper recomputes once it read that the trainers read its data, and fails nobody's microbatch but x's.
    recomputed = re.findall(r"audit: \.\.\.(\w+)'s microbatch \d+ of step \d+ is not what", logs["helper"].text)
    assert set(recomputed) == {x_id}, logs["helper"].text
    for name in ("a", "helper"):
        assert re.search(rf"audit: \.\.\.{y_id} sent this reducer something else than it committed", logs[name].text)
        # x sends what it committed and claims its rows: the reducers' checks of what it sent them pass.
        assert not re.search(rf"audit: \.\.\.{x_id} (sent this reducer|claimed)", logs[name].text)
    for name, log in logs.items():
        assert set(re.findall(r"audit: \.\.\.(\w+) convicted", log.text)) <= {x_id, y_id}, (name, log.text)
    for attacker, short_id in (("x", x_id), ("y", y_id)):
        # Once both reducers convicted it, nobody averages with it: a home alone can neither average nor download the
        # state from the peers that refuse it, and stops there. A round whose group formed before may still finish:
        # the first it reports after. By when the lines appeared, not the steps they name: a helper's lines name the
        # swarm's step as its last refresh (every 10 s) read it, two steps behind in CI run 147.
        both = max(logs[name].first_seen(convicted.format(short_id)) for name in ("a", "helper"))
        later = [size for _, size, seen in logs[attacker].rounds if seen > both]
        assert all(size <= 1 for size in later[1:]), (attacker, later, run.timeline())
    assert "Traceback" not in logs["helper"].text, logs["helper"].text
    peers = json.loads(status.stdout)["peers"]
    assert {peer["name"] for peer in peers if peer["convicted"]} == {"x", "y"}, status.stdout


def test_a_reducer_finds_what_a_sender_sent_from_its_commitments_and_judges_the_sums_it_received():
    """hivemind sends sum_i (b_i / b_0) g_i / n over a run of a peer's microbatches (sizes b_i): its sketch follows
    from the committed sketches, for each run. An honest sender's sums match a run of the rows it claimed; a sketch
    liar's (-9x) are ten lengths off any; sums of a run of fewer rows than the claim are an overclaim, and of more
    rows pass (harmless); sums that are no run's, with a claim no run holds, are not judged, nor a sender whose
    record holds no later step yet."""
    sketches = [[float(i + j + 1) * (-1) ** j for j in range(SKETCH_SIZE)] for i in range(4)]
    commitments = Commitments("id-x")
    for rows, sketch in zip(([[0, 1], [0, 2]], [[0, 3], [0, 4]], [[0, 5]]), sketches[:3], strict=True):
        commitments.add(4, "l", rows, [[0, 0]], sketch)
    commitments.add(5, "l", [[0, 6], [0, 7]], [[0, 0]], sketches[3])
    commitments.close()
    records = {"x": commitments.record()}
    sent = [(a + b + 0.5 * c) / 3 for a, b, c in zip(*sketches[:3], strict=True)]  # anchor b_0 = 2 rows
    runs = committed_runs(records["x"].steps, 4)  # rows 2 2 1 | 2

    def of(rows: int) -> list[list[float]]:
        return [sketch for total, sketch in runs if total == rows]

    assert of(5)[0] == pytest.approx(sent) and len(of(5)) == 2  # the first three, or the last three
    assert of(1) == [pytest.approx(sketches[2])]  # one microbatch alone
    assert of(6) == [] and len(runs) == 10  # nothing holds 6 rows but all 7

    def reduced(sums: list[float], weight: float = 5.0, step: int = 4) -> dict:
        return {"step": step, "regions": [0, 1, 2, 5], "senders": {"id-x": (weight, sums)}, "gathered": {"id-x": step}}

    honest = [value * 1.005 for value in sent]  # the 8-bit blocks' noise, about
    assert received_failures(reduced(honest), records) == ([], set())
    failures, _ = received_failures(reduced([-9 * value for value in sent]), records)
    assert [(f.key, f.peer_id, f.step, f.lineage) for f in failures] == [("x", "id-x", 4, "l")]
    assert failures[0].distance > 5
    assert failures[0].rows is None and "sent this reducer something else" in failure_line(failures[0])
    elsewhere = [value if region in (0, 1, 2, 5) else -value for region, value in enumerate(sent)]
    assert received_failures(reduced(elsewhere), records) == ([], set())  # regions outside its span: not its to see
    [overclaim], _ = received_failures(reduced(honest, weight=10.0), records)
    assert (overclaim.claim, overclaim.rows) == (10.0, 5) and overclaim.distance < 0.01
    assert failure_line(overclaim) == "claimed 10 samples at step 4 for a gradient of 5 committed rows"
    assert received_failures(reduced(honest, weight=6.0), records)[0][0].rows == 5  # no run holds 6: still judged
    assert received_failures(reduced(honest, weight=4.0), records) == ([], set())  # claimed less than it sent
    assert received_failures(reduced([-9 * value for value in sent], weight=6.0), records) == ([], set())
    assert received_failures(reduced(sent, step=5), records) == ([], {"id-x"})


def test_an_overclaim_is_found_though_its_microbatches_gradients_are_alike():
    """Two microbatches of one step scatter around one gradient: the mean of both lies within a fraction of its length
    of either one's (about half of it for the sample's microbatches of 16 rows, in the audit swarm test). A sender that
    sends one of them and claims the rows of both is an overclaim all the same: its sums are that one microbatch's
    within the codec's noise, and the run of its claimed rows is farther than RECEIVED_TOLERANCE, the codec's noise
    with a margin. Judged within the audits' tolerance (0.5), it passed about one round in two."""
    generator = torch.Generator().manual_seed(0)
    common = torch.randn(SKETCH_SIZE, generator=generator, dtype=torch.float64)
    first, second = (common + 0.4 * torch.randn(SKETCH_SIZE, generator=generator, dtype=torch.float64) for _ in "ab")
    commitments = Commitments("id-x")
    commitments.add(4, "l", [[0, row] for row in range(16)], [[0, 0]], first.tolist())
    commitments.add(4, "l", [[0, row] for row in range(16, 32)], [[0, 0]], second.tolist())
    commitments.add(5, "l", [[0, 32]], [[0, 0]], common.tolist())
    commitments.close()
    records = {"x": commitments.record()}
    both = sketch_distance(first.tolist(), ((first + second) / 2).tolist())
    assert RECEIVED_TOLERANCE < both < AUDIT_TOLERANCE  # the claimed run is near, as an honest sender's would be

    def judged(sums: torch.Tensor, weight: float) -> list:
        round_ = {"step": 4, "regions": list(range(SKETCH_SIZE)), "senders": {"id-x": (weight, sums.tolist())},
                  "gathered": {"id-x": 4}}  # fmt: skip
        return received_failures(round_, records)[0]

    [overclaim] = judged(first * 1.005, weight=32.0)
    assert (overclaim.claim, overclaim.rows) == (32.0, 16)
    assert judged(first * 1.005, weight=16.0) == []  # the same sums, honestly claimed
    assert judged((first + second) / 2 * 1.005, weight=32.0) == []


def test_a_reducer_does_not_judge_a_sender_whose_record_dropped_the_rounds_first_microbatches():
    """A reducer that reads a sender's record late (it downloaded the state, say) may find the round's first
    microbatches gone from it: the other runs of what is left hold the same rows and not what was sent, so an honest
    sender would fail. Such a sender is not judged."""
    sketches = torch.randn(2 + COMMITMENTS_KEPT, SKETCH_SIZE, generator=torch.Generator().manual_seed(0)).tolist()
    commitments = Commitments("id-x")
    for step, sketch in zip([4, 4, 5, *range(6, 5 + COMMITMENTS_KEPT)], sketches, strict=True):  # one row each
        commitments.add(step, "l", [[0, step]], [[0, 0]], sketch)
        if step == 6:
            commitments.close()
            in_time = {"x": commitments.record()}  # steps 4 to 6
    commitments.close()
    late = {"x": commitments.record()}  # steps 5 to 8: step 4's microbatches dropped
    sent = [(b + c) / 2 for b, c in zip(sketches[1], sketches[2], strict=True)]  # the round took step 4's last, 5's
    round_ = {"step": 5, "regions": list(range(SKETCH_SIZE)), "senders": {"id-x": (2.0, sent)}, "gathered": {"id-x": 5}}
    assert received_failures(round_, in_time) == ([], set())
    assert received_failures(round_, late) == ([], set())  # not (step 5's + step 6's) / 2, a failure


def test_a_reducer_judges_each_sender_around_the_step_it_gathered_unless_it_committed_nothing_near_it():
    """A round's members need not agree on its step (a peer that looks for its group before a download gathers the step
    the download brings, which a reducer may not be at yet): each sender is judged around the step it gathered. One that
    gathered a step it committed nothing near is judged around the reducer's own. Before, a round whose members did not
    mostly agree on the step was not kept, so a sketch liar that gathered another step escaped every check in a round of
    two."""
    sketches = torch.randn(4, SKETCH_SIZE, generator=torch.Generator().manual_seed(1)).tolist()
    commitments = Commitments("id-x")
    for step, sketch in zip([4, 5, 6, 7], sketches, strict=True):  # one row a step
        commitments.add(step, "l", [[0, step]], [[0, 0]], sketch)
    commitments.close()
    records = {"x": commitments.record()}

    def reduced(sent: list[float], own: int, gathered: int | None) -> dict:
        return {"step": own, "regions": list(range(SKETCH_SIZE)), "senders": {"id-x": (1.0, sent)},
                "gathered": {"id-x": gathered}}  # fmt: skip

    honest, lie = sketches[2], [-9 * value for value in sketches[2]]  # step 6's microbatch, alone
    assert received_failures(reduced(honest, own=4, gathered=6), records) == ([], set())  # not judged around 4
    [failure], _ = received_failures(reduced(lie, own=4, gathered=6), records)
    assert (failure.step, failure.rows) == (6, None)
    for gathered in (40, None):  # a step it committed nothing near, or none: judged around the reducer's own
        [failure], _ = received_failures(reduced(lie, own=6, gathered=gathered), records)
        assert failure.step == 6
    assert received_failures(reduced(honest, own=6, gathered=40), records) == ([], set())


def test_a_reducers_failed_check_is_a_verdict_nobody_rechecks_and_an_early_one_waits(stream):
    """A reducer publishes a failed check as a failed verdict marked `received` (only it saw those bytes: nobody
    re-checks it); a sender whose record holds no later step yet is checked again at the next steps."""
    commitments = Commitments("id-x")
    commitments.add(4, "l", [[0, 1]], [[0, 0]], [1.0] * SKETCH_SIZE)
    commitments.add(5, "l", [[0, 2]], [[0, 0]], [1.0] * SKETCH_SIZE)
    commitments.close()
    dht = RecordsDHT({}, {"x": commitments.record()})
    x = peer_key(b"x")  # the key the reducer knows x by (`as_entries`)
    lie = {"step": 4, "regions": [0, 1], "senders": {"id-x": (1.0, [-9.0] * SKETCH_SIZE)}, "gathered": {"id-x": 4}}
    early = {"step": 5, "regions": [0, 1], "senders": {"id-x": (1.0, [1.0] * SKETCH_SIZE)}, "gathered": {"id-x": 5}}
    auditor = auditor_of(dht, stream)
    auditor.reducer.received_rounds = lambda: [lie, early]
    auditor.step_done(6)
    assert [(v.accused, v.step, v.received, v.passed) for v in auditor.ledger.verdicts] == [(x, 4, True, False)]
    assert dht.stored == ["run_accusations"] and auditor.reducer.pending == [early]
    auditor.reducer.received_rounds = list
    auditor.step_done(7)
    assert auditor.reducer.pending == [early]
    auditor.step_done(8)  # no step after 5 ever came: given up AUDIT_LAG steps after the round
    assert auditor.reducer.pending == []
    other = auditor_of(RecordsDHT({"me": AuditRecord(auditor="id-me", verdicts=auditor.ledger.verdicts)}, {}), stream)
    other.step_done(6)
    assert other.ledger.verdicts == []  # nothing to recompute


def test_a_helper_checks_what_it_reduced_and_convicts_with_a_second_auditor_by_the_trainers_rule():
    """A public helper (`ttt monitor --assist-averaging`) is an all-NAT run's only reducer and holds no data: it
    checks each sender's sums against its commitments as a trainer's reducer does, publishes a failed check under its
    own key, reads the commitments only when it reduced a round, and convicts a sender once another auditor failed it
    too, telling its averager at once; one auditor's word alone convicts nobody."""
    commitments = Commitments("id-x")
    commitments.add(4, "l", [[0, 1]], [[0, 0]], [1.0] * SKETCH_SIZE)
    commitments.add(5, "l", [[0, 2]], [[0, 0]], [1.0] * SKETCH_SIZE)
    commitments.close()
    x = peer_key(b"x")
    lie = {"step": 4, "regions": [0, 1], "senders": {"id-x": (1.0, [-9.0] * SKETCH_SIZE)}, "gathered": {"id-x": 4}}
    for others, convicted in (({}, set()), ({"b": AuditRecord(auditor="id-b", verdicts=[verdict(x)])}, {x})):
        dht, told = RecordsDHT(others, {"x": commitments.record()}), []
        rounds = iter([[lie], [], []]).__next__
        ledger = Ledger(dht=dht, run_id="run", public_key=b"", key="helper", peer_id="id-helper",
                        console=Console(file=io.StringIO()), refuse=told.append, outcome=HELPER_OUTCOME)  # fmt: skip
        helper = HelperChecks(ledger, ReducerCheck(rounds))
        helper.step_done(6)
        assert [(v.accused, v.step, v.received, v.passed) for v in ledger.verdicts] == [(x, 4, True, False)]
        assert dht.reads == ["run_accusations", "run_commitments"] and dht.stored == ["run_accusations"]
        assert ledger.convicted == convicted and told == ([["id-x"]] if convicted else [])
        helper.step_done(7)  # no round reduced since: the failed verdicts alone are read
        assert dht.reads[2:] == ["run_accusations"] and len(ledger.verdicts) == 1
        helper.step_done(7)  # the same step again (the helper steps twice a second): nothing read
        assert len(dht.reads) == 3
        said = " ".join(ledger.console.file.getvalue().split())
        assert "sent this reducer something else than it committed at step 4" in said
        assert (f"convicted by 2 auditors (this peer among them): {HELPER_OUTCOME}" in said) == bool(convicted)


def test_a_helper_that_recomputes_audits_only_once_a_trainer_reads_its_data():
    """A helper with --audit-rate reads the run's dataset and audits as a trainer does (`Audits`, its reducer's checks
    among them), but only from the refresh at which a trainer's record names the same dataset, said in one line:
    recomputed from other rows, every microbatch would fail. Until then it checks what it reduced, once a step."""
    dht = RecordsDHT({}, {})
    ledger = Ledger(dht=dht, run_id="run", public_key=b"", key="helper", peer_id="id-helper",
                    console=Console(file=io.StringIO()), outcome=HELPER_OUTCOME)  # fmt: skip
    audited: list[int] = []
    audits = SimpleNamespace(step_done=audited.append)
    helper = HelperChecks(ledger, ReducerCheck(lambda: []), audits)
    data = SimpleNamespace(index=SimpleNamespace(identity="(178 rows, sha256 c725048e59dd)"))
    settings = SimpleNamespace(audit_rate=1.0)
    snapshots = SimpleNamespace(data=data, checks=helper, console=ledger.console, settings=settings)
    helper.step_done(3)
    SwarmSnapshots.trainers_read(snapshots, ["(9 rows, sha256 0123456789ab)", None])  # another dataset, a monitor
    helper.step_done(4)
    assert audited == [] and dht.reads == ["run_accusations", "run_accusations"]
    for _ in range(2):
        SwarmSnapshots.trainers_read(snapshots, ["(9 rows, sha256 0123456789ab)", data.index.identity])
    helper.step_done(4)  # the same step: nothing
    helper.step_done(5)
    assert audited == [5] and len(dht.reads) == 2
    said = ledger.console.file.getvalue()
    assert said.count("audits: the trainers read this helper's data (178 rows, sha256 c725048e59dd)") == 1, said


def test_an_auditor_with_many_verdicts_of_both_kinds_still_convicts(stream):
    """Its record keeps VERDICTS_KEPT of each kind, more than one record holds: the conviction reads the failed ones
    (a reducer's checks fail a sketch liar at every round it reduces; with an auditor's passed verdicts, that record
    once broke a peer's step)."""
    auditor = auditor_of(RecordsDHT({}, {}), stream)
    auditor.ledger.verdicts = [verdict("h", passed=True, step=step) for step in range(VERDICTS_KEPT)]
    auditor.ledger.verdicts += [verdict("x", step=step) for step in range(VERDICTS_KEPT)]
    auditor.ledger.announce_convictions(audits(b=[verdict("x")]), {})
    assert auditor.ledger.convicted == {"x"}


def test_a_peer_tells_its_averagers_at_once_whom_it_convicted_by_an_id_only_that_key_names(stream):
    """Its averagers refuse a conviction from that moment, not from their next read of the verdicts (10 s: about
    two steps of rounds that still held the convicted). An impostor that commits under honest h's id is told by no
    id (two keys name it); what an averager is told it keeps refusing through reads that do not convict yet."""
    commitments = {
        "x": CommitmentRecord(peer_id="id-x", steps=[]),
        "impostor": CommitmentRecord(peer_id="id-h", steps=[]),
        "h": CommitmentRecord(peer_id="id-h", steps=[]),
    }
    told = []
    auditor = auditor_of(RecordsDHT({}, commitments), stream)
    auditor.ledger.refuse = told.append
    x, impostor = peer_key(b"x"), peer_key(b"impostor")  # the keys of the DHT's records, as read
    auditor.ledger.verdicts = [verdict(x), verdict(impostor)]
    auditor.ledger.announce_convictions(audits(b=[verdict(x), verdict(impostor)]), None)  # the commitments read now
    assert told == [["id-x"]] and auditor.ledger.convicted == {x, impostor}
    auditor.ledger.announce_convictions(audits(b=[verdict(x), verdict(impostor)]), None)
    assert told == [["id-x"]]  # told once

    dht = RecordsDHT({}, commitments)
    dht.get = lambda key, get=dht.get, **read: asyncio.wrap_future(get(key, **read))
    standing = AuditStanding("run", peer_key(b"me"))
    standing.convict(["id-x"])
    x_id = SimpleNamespace(to_base58=lambda: "id-x")
    assert standing.refuses(x_id) and not standing.proven(x_id)
    asyncio.run(standing.read(dht))  # nobody's verdicts in the DHT yet
    assert standing.refuses(x_id)


def committed_at(peer_id: str, *steps: tuple[int, str], microbatches: int = 1) -> CommitmentRecord:
    """A record of one microbatch (or `microbatches`) at each (step, lineage) of `steps`."""
    one = MicrobatchCommitment(rows=[[0, 1]], blocks=[[0, 0]], sketch=[0.0] * SKETCH_SIZE)
    return CommitmentRecord(
        peer_id=peer_id,
        steps=[Commitment(step=s, lineage=lineage, microbatches=[one] * microbatches) for s, lineage in steps],
    )


def test_a_peer_nobody_can_audit_counts_for_nothing_in_the_reducers_until_somebody_can():
    """An audit recomputes only microbatches of the auditor's own lineage, and a lineage is its writer's word: a
    poisoner proven once, then committing under a lineage (or steps) of its own, would never be audited again, at a
    proven peer's weight. A key whose last UNAUDITED_STEPS committed steps match no other key's step and lineage,
    while two others or more share one, is unaudited; a peer apart at its last step alone is not (by one step, honest
    peers were left out in each of four runs of bench.verify), nor a lone trainer, nor either of two peers apart from
    each other (no telling which one is)."""
    a, b = committed_at("id-a", (5, "l5"), (6, "l6"), (7, "l7")), committed_at("id-b", (5, "l5"), (6, "l6"), (7, "l7"))
    hider = committed_at("id-h", (5, "own"), (6, "own"), (7, "own"))
    apart = committed_at("id-p", (5, "l5"), (6, "l6"), (7, "apart"))
    gone = committed_at("id-g", (5, "l5"), (6, "gone"), (7, "gone"))
    elsewhere = committed_at("id-e", (905, "l5"), (906, "l6"))  # steps of its own
    empty = committed_at("id-s", (7, "own"), microbatches=0)  # a lineage named, no microbatch to audit there
    assert unaudited_keys({"a": a, "b": b, "h": hider, "p": apart, "g": gone, "e": elsewhere}) == {"h", "g", "e"}
    assert unaudited_keys({"a": a, "h": hider}) == set()  # two apart from each other
    assert unaudited_keys({"a": a, "h": hider, "s": empty}) == {"a"}  # h and s (one attacker's two keys) share
    assert unaudited_keys({"h": hider}) == set()  # nobody else commits: nothing to tell

    told: list[list[str]] = []
    ledger = ledger_of(None)
    reducer = ReducerCheck(leave_out=told.append)
    for records in ({"a": a, "h": hider}, {"a": a, "h": hider, "b": b}, {"a": a, "h": hider, "b": b}, {"a": a, "h": a}):
        reducer.leave_out_unaudited(records, ledger)
    assert told == [["id-h"], []]  # told when it changes: h left out beside a and b, then nobody
    said = " ".join(ledger.console.file.getvalue().split())
    assert re.findall(r"audit: \.\.\.(\S+) commits under lineages no other peer holds", said) == ["id-h"]
    assert "nobody can audit its work, so this peer's reducers count its gradients for nothing until they can" in said

    standing = AuditStanding("run", peer_key(b"me"))
    standing.proven_ids = {"h": "id-h"}
    h_id = SimpleNamespace(to_base58=lambda: "id-h")
    standing.leave_out(["id-h"])
    assert standing.proven(h_id) and not standing.counted(h_id)
    standing.leave_out([])
    assert standing.counted(h_id)


def test_a_convicted_peer_is_told_why_once_per_new_auditor_and_not_on_one_auditors_word():
    """The peer's own console says who convicts it and what they found (it is not stopped: two keys' word would then
    send any honest peer away); nothing on one auditor's verdicts, or on verdicts about others."""
    ledger = ledger_of(None)
    said = ledger.console.file

    def told(**verdicts: list[Verdict]) -> str:
        at = said.tell()
        ledger.announce_own_conviction(audits(**verdicts))
        return " ".join(said.getvalue()[at:].split())  # unwrapped (the test's console is 80 columns wide)

    unleased = verdict("me").copy(update={"unleased": True})
    assert told(b=[verdict("me")], c=[verdict("x")]) == ""
    line = told(b=[verdict("me")], c=[verdict("x"), unleased], me=[verdict("me")])
    assert line.startswith("audit: this peer is convicted by 2 auditors (...id-b, ...id-c): a microbatch it "), line
    assert "; it trained on rows it had not leased. They refuse its averaging requests" in line, line
    assert told(b=[verdict("me")], c=[unleased]) == ""  # told once
    line = told(b=[verdict("me")], c=[unleased], d=[verdict("me").copy(update={"received": True})])
    assert "convicted by 3 auditors (...id-b, ...id-c, ...id-d)" in line and "it sent a reducer something" in line
