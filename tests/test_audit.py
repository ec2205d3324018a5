"""Checked work (training/audit/): sketches, recomputation of a committed microbatch, and who convicts whom."""

import asyncio
import io
import re
from concurrent.futures import Future

import pydantic.v1 as pydantic
import pytest
import torch
from hivemind.utils import ValueWithExpiration, get_dht_time
from rich.console import Console

from pipeline.core.stream import CodeStream
from tests.test_stream import CODEBOOK, GRID, write_dataset
from training.audit.auditor import Audits, Commitments, Recomputer, kept_verdicts
from training.audit.records import (
    COMMITMENTS_KEPT,
    VERDICTS_KEPT,
    AuditRecord,
    CommitmentRecord,
    Verdict,
    accusations_key,
    audits_key,
    claimed_ids,
    commitments_key,
    convicted_by,
    refused_peer_ids,
)
from training.audit.refusal import ConvictedRefused
from training.audit.sketch import AUDIT_TOLERANCE, SKETCH_SIZE, Sketcher, sketch_distance, step_seed
from training.config import ModelConfig
from training.metrics import peer_key
from training.model import DalleTransformer
from training.monitor.verified import AuditWatch

CONFIG = ModelConfig(codebook_size=CODEBOOK, grid=GRID, text_len=16, width=32, layers=2, heads=2, head_dim=16)


@pytest.fixture
def stream(tmp_path) -> CodeStream:
    write_dataset(tmp_path, files=2, rows_per_file=20, row_group=10)
    return CodeStream(tmp_path, batch_size=4, text_len=CONFIG.text_len, seed=0, peer="p", shuffle_buffer=8)


def model() -> DalleTransformer:
    torch.manual_seed(0)
    return DalleTransformer(CONFIG)


def gradient_of(net: DalleTransformer, batch: dict) -> list[torch.Tensor]:
    net.zero_grad(set_to_none=True)
    net(batch["text"], batch["codes"])["loss"].backward()
    return [parameter.grad.clone() for parameter in net.parameters()]


def test_a_sketch_is_linear_and_the_same_for_every_peer_at_one_step():
    sizes = [300, 7, 1000]
    grads = [torch.randn(size) for size in sizes]
    others = [torch.randn(size) for size in sizes]
    sketcher = Sketcher.for_step(sizes, step_seed("run", 5))
    again = Sketcher.for_step(sizes, step_seed("run", 5))
    summed = sketcher.sketch([a + b for a, b in zip(grads, others, strict=True)])
    parts = [a + b for a, b in zip(sketcher.sketch(grads), sketcher.sketch(others), strict=True)]
    assert torch.allclose(torch.tensor(summed), torch.tensor(parts), atol=1e-5)
    assert again.sketch(grads) == sketcher.sketch(grads) and len(summed) == SKETCH_SIZE
    assert Sketcher.for_step(sizes, step_seed("run", 6)).sketch(grads) != sketcher.sketch(grads)
    assert sketcher.sketch([None, grads[1], grads[2]]) != sketcher.sketch(grads)  # a parameter without a gradient


def test_every_attack_moves_the_sketch_by_about_its_length(stream):
    """What each attacker sends, against the honest gradient of its batch: far outside the tolerance."""
    net = model()
    batches = iter(stream)
    first, second = next(batches), next(batches)
    honest = gradient_of(net, first)
    sketcher = Sketcher.for_step([p.numel() for p in net.parameters()], step_seed("run", 0))
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
    recomputer = Recomputer(net, DalleTransformer(CONFIG), stream, "run")
    recomputer.keep(3, "lineage")
    batch = next(iter(stream))
    gradient_of(net, batch)
    committed = recomputer.sketch(3)
    assert sketch_distance(committed, recomputer.recompute(3, batch["at"])) == 0.0
    assert recomputer.recompute(3, [[0, 999]]) is None and recomputer.recompute(3, [[99, 0]]) is None
    with torch.no_grad():  # the live model moves on; the snapshot of step 3 stays
        next(net.parameters()).add_(1.0)
    assert sketch_distance(committed, recomputer.recompute(3, batch["at"])) == 0.0


def test_an_audit_recomputes_the_commitment_of_its_own_lineage_when_a_step_has_two(stream):
    """A peer whose state was downloaded mid-step commits two lineages of that step: each microbatch is judged against
    the one it was computed at (judging the first found convicted honest joiners)."""
    net = model()
    recomputer = Recomputer(net, DalleTransformer(CONFIG), stream, "run")
    recomputer.keep(3, "downloaded")
    batches = iter(stream)
    before, after = next(batches), next(batches)
    accused = Commitments("id-x")
    accused.add(3, "own", before["at"], [1.0] * SKETCH_SIZE)  # at the parameters it had before its download
    gradient_of(net, after)
    accused.add(3, "downloaded", after["at"], recomputer.sketch(3))
    accused.close()
    auditor = Audits(
        dht=None, run_id="run", public_key=b"", key="me", recomputer=recomputer, commitments=Commitments("id-me"),
        member_lineage=lambda: "downloaded", console=Console(file=io.StringIO()), rate=0.0,
    )  # fmt: skip
    auditor.judge(3, "downloaded", "x", "id-x", 0, {"x": accused.record()})
    assert [(v.lineage, v.passed) for v in auditor.verdicts] == [("downloaded", True)]


def test_commitments_keep_the_last_steps_and_start_anew_at_each_step():
    commitments = Commitments("peer")
    for step in range(COMMITMENTS_KEPT + 2):
        commitments.add(step, "l", [[0, 1]], [0.0] * SKETCH_SIZE)
        commitments.add(step, "l", [[0, 2]], [0.0] * SKETCH_SIZE)
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

    def get(self, key, latest, return_future) -> Future:
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


def auditor_of(dht: RecordsDHT, stream: CodeStream, rate: float = 0.0) -> Audits:
    recomputer = Recomputer(model(), DalleTransformer(CONFIG), stream, "run")
    return Audits(
        dht=dht, run_id="run", public_key=b"", key="me", recomputer=recomputer, commitments=Commitments("id-me"),
        member_lineage=lambda: "l", console=Console(file=io.StringIO()), rate=rate,
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


def test_an_auditor_publishes_its_passed_verdicts_for_the_monitor_and_its_failed_ones_for_every_peer(stream):
    dht = RecordsDHT({}, {})
    auditor = auditor_of(dht, stream)
    auditor.verdicts = [verdict("x", passed=True)]
    auditor.publish_verdicts(auditor.verdicts)  # the first publication: the passed verdicts, nothing failed yet
    auditor.verdicts.append(verdict("y"))
    auditor.publish_verdicts(auditor.verdicts[-1:])  # a new failed verdict: its record alone
    assert dht.stored == ["run_audits", "run_accusations"]


def test_the_monitor_reads_the_passed_and_the_failed_verdicts():
    dht = RecordsDHT(audits(a=[verdict("x")]), {}, passed=audits(b=[verdict("h", passed=True)]))
    rows = AuditWatch(dht, "run").read().verdicts
    assert {(row.auditor, row.accused, row.passed) for row in rows} == {
        (peer_key(b"a"), "x", False), (peer_key(b"b"), "h", True),
    }  # fmt: skip


def test_an_averager_reads_the_commitments_only_while_somebody_stands_convicted():
    """The averagers' refusal names peer ids, which only the commitments hold: it reads them when it needs them."""
    me, x = peer_key(b"me"), peer_key(b"x")
    commitments = {"x": CommitmentRecord(peer_id="id-x", steps=[])}
    for records, refused, reads in (
        ({"me": [verdict(x)]}, set(), ["accusations"]),  # one auditor convicts nobody
        ({"me": [verdict(x)], "b": [verdict(x)]}, {"id-x"}, ["accusations", "commitments"]),
    ):
        dht = RecordsDHT(audits(**records), commitments)
        dht.get = lambda key, latest, return_future, get=dht.get: asyncio.wrap_future(get(key, latest, return_future))
        assert asyncio.run(ConvictedRefused("run", me).read_refused(dht)) == refused
        assert dht.reads == [f"run_{key}" for key in reads]


@pytest.mark.e2e
def test_a_quiet_poisoner_is_convicted_and_left_out_and_nobody_else(sample_dataset, tmp_path):
    """a and b train honestly; x sends its gradients times -9 (under the 10x-median drop) and commits to what it
    sends; every peer audits one microbatch a step. a and b each convict x (an audit of its own or a re-check, and
    the other's), their averagers then refuse it and its groups, and nobody convicts an honest peer."""
    from tests.support.commands import SWARM_ARGS
    from tests.support.swarm_runs import ADDRESS, SwarmRun

    args = ["--dataset", str(sample_dataset), "--run-id", "audited", "--max-steps", "8", *SWARM_ARGS,
            "--audit-rate", "1"]  # fmt: skip
    run = SwarmRun(tmp_path, args)
    run.start("a", "--wait-for-peers", "3")
    run.start("b")
    run.start("x", fault="scale:-9")
    logs = run.finish()
    x_id = run.wait_for("x", ADDRESS).group(0).rsplit("/", 1)[1]

    assert all(log.returncode == 0 for log in logs.values()), {n: log.text[-2000:] for n, log in logs.items()}
    for name in ("a", "b"):
        text = logs[name].text
        assert f"audit: ...{x_id[-8:]} convicted by 2 auditors (this peer among them)" in text, text
        assert re.search(rf"audit: \.\.\.{x_id[-8:]}'s microbatch \d+ of step \d+ is not what it committed", text)
    for name, log in logs.items():
        assert re.findall(r"audit: \.\.\.(\w+) convicted", log.text) in ([], [x_id[-8:]]), (name, log.text)
    assert logs["x"].rounds[-1][1] <= 1, logs["x"].text  # its last step: nobody averaged with it
