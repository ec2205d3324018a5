"""`ttt monitor`: the live monitor of the shared swarm run (tests/conftest.py), its dashboard in a real browser,
and its aggregation, history and record validation on their own."""

import io
import json
import math
import multiprocessing as mp
import random
import socket
import sqlite3
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time
from rich.console import Console

from tests.support.commands import DISPLAY_NAMES, MAX_STEPS, run_ttt
from training.audit.records import Commitment, CommitmentRecord, MicrobatchCommitment
from training.audit.sketch import SKETCH_SIZE
from training.calc.memory import MODELS
from training.config import MonitorSettings, RunSettings, RunSpec, agreed_values
from training.metrics import PeerMetrics, PeerRecord, RunValidator, make_validators, metrics_key, parse_records
from training.monitor.aggregate import global_step, outliers_sent, summarize
from training.monitor.history import SCHEMA, History, verified_total
from training.monitor.report import RunState, prometheus_text, state_json
from training.monitor.revocation import ConvictedRevoker, convicted_users
from training.monitor.run import Monitor, join_options
from training.monitor.server import Published, serve
from training.monitor.status import RunStatus, print_status, status_document
from training.monitor.verified import (
    AuditReading,
    CommittedRows,
    Standing,
    VerdictRow,
    Votes,
    committed_rows,
    standings,
    votes_of,
    wilson,
)

ROOT = Path(__file__).resolve().parent.parent

WINDOW = 180.0
NO_TOKEN = {"HF_TOKEN": ""}


def record(key: str, name: str, step: int, total: int, published_at: float, **extra) -> PeerRecord:
    metrics = {
        "step": step,
        "samples_per_second": 2.0,
        "samples_accumulated": 16,
        "total_samples": total,
        "loss": 5.0,
        "mini_steps": 2,
        "display_name": name,
        "parameters_hash": f"hash-{step}",
        **extra,
    }
    return PeerRecord(key, PeerMetrics(**metrics), published_at)


def synthetic_swarm(count: int, now: float, seed: int = 0) -> list[PeerRecord]:
    """COUNT peers under 50 display names (volunteers with several machines), some finished, some gone quiet."""
    rng = random.Random(seed)
    records = []
    for index in range(count):
        published_at = now - (400.0 if index % 10 == 9 else rng.uniform(0, 30))  # every 10th: silent 400 s
        records.append(
            record(f"key{index:04d}", f"volunteer-{index % 50}", 100, rng.randrange(1000, 100_000), published_at)
        )
    records[0] = record("key0000", "volunteer-0", 100, 5000, now, finished=True)
    return records


def test_500_peer_records_give_exact_counts_and_totals_and_survive_a_restart(tmp_path):
    now = time.time()
    records = synthetic_swarm(500, now)
    active = [r for r in records if not r.metrics.finished and now - r.published_at <= WINDOW]
    summary = summarize(records, now, WINDOW)
    assert summary.active_peers == len(active) == 500 - 50 - 1
    assert summary.global_step == 100 and summary.distinct_hashes == 1 and summary.loss == 5.0
    assert summary.samples_per_second == 2.0 * len(active)

    history = History(tmp_path / "monitor.sqlite")
    history.record_refresh(now, records, summary, rejected=0)
    # The next refresh: every peer contributed more; a restarted peer process (new key) joins an old name.
    later = [record(r.key, r.metrics.display_name, 101, r.metrics.total_samples + 64, now + 10) for r in records]
    later.append(record("key-new", "volunteer-7", 101, 32, now + 10))
    history.record_refresh(now + 10, later, summarize(later, now + 10, WINDOW), rejected=0)
    expected = sum(r.metrics.total_samples for r in later)
    board = history.leaderboard(now + 10, WINDOW)
    assert len(board) == 50 and sum(row.samples for row in board) == expected == history.total_samples()
    seven = next(row for row in board if row.name == "volunteer-7")
    assert seven.samples == sum(r.metrics.total_samples for r in later if r.metrics.display_name == "volunteer-7")
    assert [row.samples for row in board] == sorted((row.samples for row in board), reverse=True)
    history.close()

    reopened = History(tmp_path / "monitor.sqlite")  # a restarted monitor keeps curves and leaderboard
    assert reopened.leaderboard(now + 10, WINDOW) == board
    assert reopened.curves()["step"] == [100, 101]


def test_a_monitor_fed_500_signed_peer_records_counts_and_totals_them_exactly(tmp_path):
    """500 peers' signed records through the DHT, as a run of hundreds of peers makes them, into one refresh."""
    from tests.support.synthetic_peers import SyntheticPeers, make_keys

    settings = MonitorSettings(
        run=RunSettings(run_id="crowd"), port=0, host_maddrs=["/ip4/127.0.0.1/tcp/0"], checkpoint_dir=str(tmp_path),
        checkpoint_every=0,
    )  # fmt: skip
    monitor = Monitor(settings, Console(file=io.StringIO()))
    peers = SyntheticPeers("crowd", make_keys(500, bits=1024), monitor.dht.get_visible_maddrs())
    try:
        records = [r.metrics for r in synthetic_swarm(500, time.time())]
        peers.publish(records)
        state = monitor.refresh()
        assert state.summary.active_peers == 499 and state.rejected_records == 0  # record 0 is a finished peer's
        assert state.total_samples == sum(m.total_samples for m in records)
        assert len(state.leaderboard) == 50 and sum(row.samples for row in state.leaderboard) == state.total_samples
        assert state.summary.global_step == 100 and state.summary.samples_per_second == 2.0 * 499
    finally:
        peers.shutdown()
        monitor.shutdown()


def test_peers_that_left_age_out_of_active_but_stay_on_the_leaderboard(tmp_path):
    now = time.time()
    history = History(tmp_path / "monitor.sqlite")
    early = [record("a", "alice", 10, 640, now), record("b", "bob", 10, 320, now)]
    history.record_refresh(now, early, summarize(early, now, WINDOW), rejected=0)
    late = [record("a", "alice", 30, 1920, now + 200)]  # bob's record is 200 s old now, beyond the window
    summary = summarize([*late, early[1]], now + 200, WINDOW)
    assert summary.active_peers == 1 and summary.global_step == 30
    history.record_refresh(now + 200, late, summary, rejected=0)
    board = {row.name: row for row in history.leaderboard(now + 200, WINDOW)}
    assert board["alice"].online and not board["bob"].online and board["bob"].samples == 320
    assert board["alice"].seconds_online == 200


def test_the_global_step_follows_the_swarm_not_one_record():
    now = time.time()
    assert global_step([record(str(i), "p", step, 0, now) for i, step in enumerate([7, 7, 8])]) == 7
    assert global_step([record(str(i), "p", step, 0, now) for i, step in enumerate([7, 7, 10**9])]) == 7
    assert global_step([]) == 0


def test_disagreeing_hashes_and_the_weighted_loss():
    now = time.time()
    records = [
        record("a", "a", 5, 0, now, parameters_hash="x", loss=2.0, samples_accumulated=48),
        record("b", "b", 5, 0, now, parameters_hash="y", loss=4.0, samples_accumulated=16),
    ]
    summary = summarize(records, now, WINDOW)
    assert summary.distinct_hashes == 2 and summary.loss == 2.5


def test_the_swarm_figures_bound_each_claim_and_leave_out_the_convicted():
    """A record says what its peer claims: one of a million samples at loss 0.01 weighs as twice the median claim in
    the swarm's loss (it set the loss alone before), and the audits' convicted keys count for nothing."""
    now = time.time()
    honest = [record(key, key, 5, 0, now, loss=4.0, samples_accumulated=32) for key in "abc"]
    liar = record("x", "x", 9, 0, now, loss=0.01, samples_accumulated=1_000_000, samples_per_second=1e6)
    summary = summarize([*honest, liar], now, WINDOW)
    assert summary.loss == pytest.approx((3 * 32 * 4.0 + 64 * 0.01) / (3 * 32 + 64))
    assert summary.active_peers == 4 and summary.samples_per_second == 3 * 2.0 + 2 * 2.0  # its rate bounded too
    summary = summarize([*honest, liar], now, WINDOW, convicted={"x"})
    assert (summary.loss, summary.active_peers, summary.samples_per_second, summary.global_step) == (4.0, 3, 6.0, 5)


def test_outliers_sent_are_what_the_other_peers_report_of_a_peer_id():
    now = time.time()
    records = [
        record("a", "alice", 5, 0, now, peer_id="QmA", outliers={"QmC": 3, "QmGone": 7}, dropped=1),
        record("b", "bob", 5, 0, now, peer_id="QmB", outliers={"QmC": 2, "": 4}, clipped=2),
        record("c", "carol", 5, 0, now, peer_id="QmC"),
        record("d", "dave", 4, 0, now, outliers={"QmA": 1}, dropped=9),  # an older version's: no peer id
    ]
    # Two reports about carol add up; one of a peer id no record carries is nobody's; dave cannot be named.
    assert outliers_sent(records) == {"a": 1, "b": 0, "c": 5, "d": 0}
    summary = summarize(records, now, WINDOW)
    assert (summary.dropped, summary.clipped) == (1, 2)  # dave's 9 are of step 4, not the global step 5
    assert outliers_sent([]) == {}


def test_the_history_keeps_the_most_outliers_seen_and_upgrades_an_old_database(tmp_path):
    path = tmp_path / "monitor.sqlite"
    old_schema = SCHEMA.replace(", outliers INTEGER NOT NULL DEFAULT 0", "")  # the monitor's before outliers
    assert old_schema != SCHEMA
    old = sqlite3.connect(path)
    old.executescript(old_schema)
    old.execute("INSERT INTO peers VALUES ('c', 'carol', 64, 0, 0, 1.0, 1, 'h', 0)")
    old.commit()
    old.close()
    now = time.time()
    history = History(path)
    assert [(row.name, row.outliers) for row in history.leaderboard(now, WINDOW)] == [("carol", 0)]
    first = [
        record("a", "alice", 2, 0, now, peer_id="QmA", outliers={"QmC": 3}),
        record("c", "carol", 2, 96, now, peer_id="QmC"),
    ]
    # Alice restarted (a new key, its counts from zero): carol's first peer is reported less than before.
    second = [
        record("a2", "alice", 3, 0, now + 10, peer_id="QmA2", outliers={"QmC": 1, "QmC2": 4}),
        record("b", "bob", 3, 0, now + 10, peer_id="QmB", outliers={"QmC": 1}),
        record("c", "carol", 3, 128, now + 10, peer_id="QmC", outliers={"QmB": 2}),
        record("c2", "carol", 3, 32, now + 10, peer_id="QmC2"),  # carol's second machine
    ]
    for records in (first, second):
        at = records[0].published_at
        history.record_refresh(at, records, summarize(records, at, WINDOW), rejected=0)
    board = {row.name: row.outliers for row in history.leaderboard(now + 10, WINDOW)}
    assert board == {"alice": 0, "bob": 2, "carol": 3 + 4}  # carol's first peer kept its 3, not the 2 of now
    history.close()
    assert {row.name: row.outliers for row in History(path).leaderboard(now + 10, WINDOW)} == board


def test_state_json_and_prometheus_text_escape_peer_names(tmp_path):
    now = time.time()
    history = History(tmp_path / "monitor.sqlite")
    records = [
        record("a", 'evil"name\n<script>', 3, 100, now, peer_id="QmA", dropped=1, clipped=2),
        record("b", "bob", 3, 100, now, outliers={"QmA": 5}),
    ]
    summary = summarize(records, now, WINDOW)
    history.record_refresh(now, records, summary, rejected=2)
    state = RunState(
        run_id="r", updated_at=now, refresh_seconds=10, summary=summary, total_steps=200, time_left_seconds=None,
        total_samples=history.total_samples(), rejected_records=2, leaderboard=history.leaderboard(now, WINDOW),
        curves=history.curves(), previews=None, checkpoint=None, addresses=["/ip4/1.2.3.4/tcp/5/p2p/Qm"],
        join_options=["--preset", "tiny"],
    )  # fmt: skip
    document = state_json(state)
    assert json.loads(document)["join"]["command"] == "ttt train --join /ip4/1.2.3.4/tcp/5/p2p/Qm"
    assert json.loads(document)["outliers"] == {"step": 3, "dropped": 1, "clipped": 2}
    assert json.loads(document)["local_steps"] == 0  # a synchronous run
    assert {peer["name"]: peer["outliers"] for peer in json.loads(document)["peers"]} == {
        'evil"name\n<script>': 5,
        "bob": 0,
    }
    text = prometheus_text(state).decode()
    assert 'ttt_peer_samples_total{run_id="r",name="evil\\"name\\n<script>"} 100' in text
    assert 'ttt_peer_outliers_total{run_id="r",name="evil\\"name\\n<script>"} 5' in text
    assert 'ttt_dropped{run_id="r"} 1' in text and 'ttt_clipped{run_id="r"} 2' in text
    assert 'ttt_rejected_records{run_id="r"} 2' in text and "ttt_loss{" in text


def test_a_diloco_runs_dashboard_counts_outer_steps_in_a_real_browser(web, tmp_path):
    """With --local-steps the run's steps are outer steps: the dashboard says so, and how often the peers average."""
    from tests.support.browser import open_dashboard

    published, base = web
    now = time.time()
    history = History(tmp_path / "monitor.sqlite")
    for step in (1, 2):
        records = [record(key, key, step, 100 * step, now - 60 + step) for key in ("alice", "bob")]
        summary = summarize(records, now - 60 + step, WINDOW)
        history.record_refresh(now - 60 + step, records, summary, rejected=0)
    state = RunState(
        run_id="diloco-run", updated_at=now, refresh_seconds=60, summary=summary, total_steps=20,
        time_left_seconds=None, total_samples=history.total_samples(), rejected_records=0,
        leaderboard=history.leaderboard(now, WINDOW), curves=history.curves(), previews=None, checkpoint=None,
        addresses=["/ip4/127.0.0.1/tcp/31337/p2p/QmPeer"], join_options=["--preset", "tiny", "--local-steps", "100"],
        local_steps=100,
    )  # fmt: skip
    published.publish(state_json(state), b"")
    page = open_dashboard(base, tmp_path / "diloco-dashboard.png")
    assert page["errors"] == [], page
    assert "OUTER STEP\n2 / 20\nDiLoCo: averaging every 100 local steps" in page["text"], page["text"]
    assert "GLOBAL STEP" not in page["text"]


def audited_history(path: Path, now: float) -> History:
    """alice passed 3 audits, bob 1 (a lone accuser's verdict on his second microbatch was outvoted by a re-check),
    mallory failed the audits of two auditors, carol was never audited. The auditors' records roll over between the
    two refreshes: the history keeps every verdict it saw. Each committed the rows it claims, but bob: 120 of his
    200 (his step 3 published again with 500 rows adds none)."""
    history = History(path)
    people = [("a", "alice", 300), ("b", "bob", 200), ("m", "mallory", 400), ("c", "carol", 100)]
    records = [record(key, name, 5, claimed, now) for key, name, claimed in people]
    first = [
        VerdictRow("b", "a", 2, "l", 0, True), VerdictRow("m", "a", 2, "l", 1, True),
        VerdictRow("a", "m", 2, "l", 0, False), VerdictRow("m", "b", 3, "l", 1, False),
        VerdictRow("a", "b", 3, "l", 1, True), VerdictRow("m", "m", 3, "l", 0, True),  # its own word: not counted
    ]  # fmt: skip
    second = [
        VerdictRow("b", "a", 4, "l", 0, True), VerdictRow("a", "b", 4, "l", 2, True),
        VerdictRow("b", "m", 2, "l", 0, False), VerdictRow("b", "m", 4, "l", 0, False),
        VerdictRow("c", "b", 3, "l", 1, True),  # a second re-check of the accused microbatch
    ]  # fmt: skip
    committed_first = [
        CommittedRows("a", 2, "l", 150), CommittedRows("b", 3, "l", 60), CommittedRows("m", 2, "l", 400),
        CommittedRows("c", 2, "l", 100),
    ]  # fmt: skip
    committed_second = [
        CommittedRows("a", 4, "l", 150), CommittedRows("b", 3, "l", 500), CommittedRows("b", 4, "l", 60),
    ]  # fmt: skip
    for at, verdicts, committed in ((now - 10, first, committed_first), (now, second, committed_second)):
        audits = AuditReading(verdicts, committed)
        history.record_refresh(at, records, summarize(records, at, WINDOW), rejected=0, audits=audits)
    return history


def test_the_leaderboard_credits_verified_samples_and_marks_the_convicted_whose_claims_leave_the_total(tmp_path):
    now = time.time()
    history = audited_history(tmp_path / "monitor.sqlite", now)
    board = {row.name: row for row in history.leaderboard(now, WINDOW)}
    low_3, high_3 = wilson(3, 3)
    assert board["alice"].verified == (300, math.floor(300 * low_3), 300) and board["alice"].audits == (3, 0)
    low_2, _ = wilson(2, 2)  # bob's claim counts as the 120 rows he committed
    assert board["bob"].verified == (120, math.floor(120 * low_2), 120) and board["bob"].audits == (2, 0)
    assert not board["bob"].convicted
    assert board["mallory"].verified == (0, 0, 0) and board["mallory"].audits == (0, 2) and board["mallory"].convicted
    assert history.convicted() == {"m"}  # what the swarm's figures leave out (summarize)
    assert history.total_samples() == 300 + 200 + 100  # samples in all: mallory's 400 are not believed
    totals = [row[0] for row in history.db.execute("SELECT total_samples FROM series ORDER BY time")]
    assert totals == [1000, 600]  # at the first refresh one auditor had failed her: not convicted yet
    assert board["carol"].verified == (0, 0, 100) and board["carol"].audits == (0, 0)  # never audited: 0 to its claim
    assert [name for name, row in board.items() if row.probation] == ["carol"]  # committed, never passed, online
    assert not any(row.probation for row in history.leaderboard(now + 2 * WINDOW, WINDOW))  # nobody online
    assert [row.name for row in history.leaderboard(now, WINDOW)] == ["alice", "bob", "mallory", "carol"]
    summed = tuple(sum(row.verified[i] for row in board.values()) for i in range(3))
    assert verified_total(history.leaderboard(now, WINDOW)) == summed
    history.close()
    assert {row.name: row.verified for row in History(tmp_path / "monitor.sqlite").leaderboard(now, WINDOW)} == {
        name: row.verified for name, row in board.items()
    }  # a restarted monitor keeps the verdicts it saw


def test_rows_committed_where_nobody_else_held_the_parameters_earn_no_credit_and_an_unaudited_peer_is_on_probation(
    tmp_path,
):
    """An audit recomputes only at the auditor's own lineage: a step's rows count toward a claim when another key
    committed at the same step and lineage, or another auditor judged a microbatch there. h was proven at step 2, then
    committed 400 rows under a lineage of its own, which nobody can audit: its verified samples stay those of step 2,
    and while its record names that lineage alone (`unaudited`), it is on probation again. p committed alone at step
    6 (nobody else held that step yet), where an auditor that commits nothing, a helper, judged a microbatch."""
    now = time.time()
    history = History(tmp_path / "monitor.sqlite")
    people = [("a", "alice", 300), ("b", "bob", 300), ("h", "hank", 500), ("p", "pat", 200)]
    records = [record(key, name, 5, claimed, now) for key, name, claimed in people]
    verdicts = [
        VerdictRow("a", "h", 2, "l", 0, True), VerdictRow("b", "a", 2, "l", 0, True),
        VerdictRow("a", "b", 2, "l", 0, True), VerdictRow("helper", "p", 6, "m", 0, True),
    ]  # fmt: skip
    committed = [
        CommittedRows("a", 2, "l", 150), CommittedRows("b", 2, "l", 150), CommittedRows("h", 2, "l", 100),
        CommittedRows("a", 3, "l3", 150), CommittedRows("b", 3, "l3", 150), CommittedRows("h", 3, "own", 200),
        CommittedRows("h", 4, "own", 200), CommittedRows("p", 6, "m", 200),
    ]  # fmt: skip
    audits = AuditReading(verdicts, committed, unaudited=frozenset({"h"}))
    history.record_refresh(now, records, summarize(records, now, WINDOW), rejected=0, audits=audits)
    board = {row.name: row for row in history.leaderboard(now, WINDOW)}
    assert {name: row.verified[0] for name, row in board.items()} == {"alice": 300, "bob": 300, "hank": 100, "pat": 200}
    assert [name for name, row in board.items() if row.probation] == ["hank"]
    history.record_refresh(now + 1, records, summarize(records, now + 1, WINDOW), 0, AuditReading([], []))
    again = history.leaderboard(now + 1, WINDOW)
    assert [row.name for row in again if row.probation] == ["hank"]  # a refresh that read nothing keeps what was read
    history.record_refresh(now + 2, records, summarize(records, now + 2, WINDOW), 0, AuditReading([], [], frozenset()))
    assert not any(row.probation for row in history.leaderboard(now + 2, WINDOW))


def test_a_commitment_record_gives_the_rows_of_each_step_it_holds():
    sketch = [0.0] * SKETCH_SIZE
    first = [
        MicrobatchCommitment(rows=[[0, 1], [0, 2]], blocks=[[0, 0]], sketch=sketch),
        MicrobatchCommitment(rows=[[3, 0]], blocks=[[0, 3]], sketch=sketch),
    ]
    steps = [Commitment(step=2, lineage="l", microbatches=first), Commitment(step=3, lineage="m", microbatches=[])]
    record = CommitmentRecord(peer_id="QmPeer", steps=steps)
    assert committed_rows({"k": record}) == [CommittedRows("k", 2, "l", 3), CommittedRows("k", 3, "m", 0)]


def test_the_votes_are_read_once_per_refresh_that_brings_verdicts(tmp_path):
    """A refresh asks for the votes up to three times (figures, leaderboard, revocations): read once, and again after
    each refresh with new verdicts. A second accuser convicts mallory at once."""
    now = time.time()
    history = History(tmp_path / "monitor.sqlite")
    records = [record("m", "mallory", 5, 100, now)]
    for auditor, convicted in (("a", set()), (None, set()), ("b", {"m"})):
        verdicts = [VerdictRow(auditor, "m", 2, "l", 0, False)] if auditor else []
        audits = AuditReading(verdicts, [])
        history.record_refresh(now, records, summarize(records, now, WINDOW), rejected=0, audits=audits)
        assert history.convicted() == convicted and history.votes() is history.votes()


def test_the_wilson_interval_holds_the_share_and_narrows_with_more_audits():
    assert wilson(0, 4)[0] == 0.0 and wilson(4, 4)[1] == 1.0
    assert wilson(45, 50)[0] < 0.9 < wilson(45, 50)[1]
    assert wilson(450, 500)[1] - wilson(450, 500)[0] < (wilson(45, 50)[1] - wilson(45, 50)[0]) / 3
    assert standings([Votes("x", frozenset({"b"}), frozenset({"a"}))]) == {}  # a tie: neither passed nor failed


def test_verdicts_are_votes_per_audited_microbatch_and_an_accuseds_own_counts_for_nothing():
    verdicts = [
        VerdictRow("a", "x", 4, "l", 2, False), VerdictRow("b", "x", 4, "l", 2, False),
        VerdictRow("c", "x", 4, "l", 2, True), VerdictRow("x", "x", 4, "l", 2, True),  # x vouching for itself
        VerdictRow("a", "x", 5, "l", 0, True),  # another microbatch: another vote
    ]  # fmt: skip
    votes = sorted(votes_of(verdicts), key=lambda vote: len(vote.failers))
    assert votes == [Votes("x", frozenset("a"), frozenset()), Votes("x", frozenset("c"), frozenset("ab"))]
    assert standings(votes) == {"x": Standing(passed=1, failed=1, accusers=frozenset("ab"))}


def test_ttt_status_leaves_a_convicted_peer_out_of_the_figures_and_marks_it(tmp_path):
    """`ttt status` reads the verdicts as the monitor does: the peer two auditors failed weighs nothing in the loss
    or the swarm's samples per second, and its row says so, with every peer's audits."""
    now = time.time()
    records = [record("a", "ada", 5, 80, now), record("x", "mallory", 5, 80, now, loss=50.0, samples_per_second=9.0)]
    audits = {"x": Standing(0, 2, frozenset("ab")), "a": Standing(3, 0)}
    convicted = {key for key, standing in audits.items() if standing.convicted}
    summary = summarize(records, now, WINDOW, convicted)
    status = RunStatus("/ip4/x", RunSpec(RunSettings(run_id="r")), summary, records, audits, now)
    assert summary.loss == 5.0 and summary.samples_per_second == 2.0 and summary.active_peers == 1
    peers = {peer["name"]: peer for peer in status_document(status)["peers"]}
    assert peers["mallory"]["convicted"] and peers["mallory"]["audits"] == {"passed": 0, "failed": 2}
    assert not peers["ada"]["convicted"] and peers["ada"]["audits"] == {"passed": 3, "failed": 0}
    console = Console(record=True, width=160)
    print_status(status, console)
    printed = console.export_text()
    assert "mallory (convicted)" in printed and "0 passed, 2 failed" in printed and "3 passed" in printed, printed


def test_the_monitor_counts_a_users_accusers_and_vouchers_by_username():
    """--revoke-convicted's rule: users, not keys, accuse and vouch; never the accused user's own peers, nor keys
    without a verified username."""
    names = {"a": "alice", "a2": "alice", "b": "bob", "m": "mallory", "m2": "mallory"}
    vouched = [Votes("m", frozenset({"m2"}), frozenset({"a"})), Votes("m", frozenset({"m2"}), frozenset({"b"}))]
    assert standings(vouched) == {}  # by keys, mallory's second peer ties each vote
    assert convicted_users(vouched, names) == {"mallory": frozenset({"alice", "bob"})}
    assert convicted_users([Votes("b", frozenset(), frozenset({"a", "a2"}))], names) == {}  # alice's two peers: one
    assert convicted_users([Votes("b", frozenset(), frozenset({"a", "x", "y"}))], names) == {}  # x, y: nobody
    assert convicted_users([Votes("x", frozenset(), frozenset({"a", "b"}))], names) == {}  # whose is x? nobody's
    outvoted = [Votes("a", frozenset({"b"}), frozenset({"m", "m2"}))]
    assert convicted_users(outvoted, {**names, "c": "carol"}) == {}


def test_the_monitor_revokes_a_user_the_audits_convict_once_and_a_lift_stands(tmp_path):
    """With the run's authority (`ttt monitor --revoke-convicted`), the monitor signs a revocation list naming
    mallory, whom alice and bob failed, writes it where the auth server reads it and relays it through the DHT;
    once the organiser lifts it, the same verdicts revoke nobody again, after a restart either."""
    from types import SimpleNamespace

    from training.auth.commands import revoke
    from training.auth.keys import AuthError, create_authority, load_authority
    from training.auth.tokens import read_revocations

    authority = create_authority(tmp_path / "authority", "audited")
    out = io.StringIO()
    revoker = ConvictedRevoker(authority.folder, "audited", authority.public, Console(file=out, width=200))
    relayed = []
    monitor = SimpleNamespace(
        history=audited_history(tmp_path / "monitor.sqlite", time.time()),
        revoker=revoker,
        access=SimpleNamespace(relay=relayed.append),
    )
    Monitor.revoke_convicted(monitor, time.time())
    assert "audit: mallory revoked: its work failed the audits of alice, bob" in out.getvalue(), out.getvalue()
    assert [list(revocations.revoked) for revocations in relayed] == [["mallory"]]
    assert relayed[0].verified(authority.public) and read_revocations(load_authority(authority.folder)) == relayed[0]

    revoke(authority.folder, "mallory", lift=True)
    Monitor.revoke_convicted(monitor, time.time())
    monitor.history.close()
    monitor.history = History(tmp_path / "monitor.sqlite")  # restarted
    Monitor.revoke_convicted(monitor, time.time())
    assert len(relayed) == 1 and read_revocations(authority).revoked == {}
    assert revoker.revoke({"mallory": frozenset({"alice", "bob"})}) is not None  # the revoker alone would

    with pytest.raises(AuthError, match="is the authority of run 'audited', not of --run-id 'other'"):
        ConvictedRevoker(authority.folder, "other", authority.public, Console(file=out))
    rival = create_authority(tmp_path / "rival", "audited")
    with pytest.raises(AuthError, match="is another authority than --authority-key's"):
        ConvictedRevoker(authority.folder, "audited", rival.public, Console(file=out))


def test_the_dashboard_shows_each_peers_audits_and_verified_samples_in_a_real_browser(web, tmp_path):
    from tests.support.browser import open_dashboard

    published, base = web
    now = time.time()
    history = audited_history(tmp_path / "monitor.sqlite", now)
    records = [record(key, key, 5, 100, now) for key in ("a",)]
    state = RunState(
        run_id="audited", updated_at=now, refresh_seconds=60, summary=summarize(records, now, WINDOW), total_steps=20,
        time_left_seconds=None, total_samples=history.total_samples(), rejected_records=0,
        leaderboard=history.leaderboard(now, WINDOW), curves=history.curves(), previews=None, checkpoint=None,
        addresses=["/ip4/127.0.0.1/tcp/31337/p2p/QmPeer"], join_options=["--preset", "tiny"],
        verified_samples=verified_total(history.leaderboard(now, WINDOW)),
    )  # fmt: skip
    document = json.loads(state_json(state))
    estimate, low, high = state.verified_samples
    assert document["verified_samples"] == {"estimate": estimate, "low": low, "high": high}
    assert 'ttt_peer_verified_samples{run_id="audited",name="alice"} 300' in prometheus_text(state).decode()
    assert 'ttt_peer_probation{run_id="audited",name="carol"} 1' in prometheus_text(state).decode()
    published.publish(state_json(state), b"")
    page = open_dashboard(base, tmp_path / "audited-dashboard.png")
    assert page["errors"] == [], page
    assert f"verified 420 ({low:,}–{high:,})" in page["text"], page["text"]
    assert "0 / 2" in page["text"] and "convicted" in page["text"] and "3 / 0" in page["text"], page["text"]
    assert page["text"].count("on probation") == 1, page["text"]  # carol's row
    assert [peer["name"] for peer in document["peers"] if peer["probation"]] == ["carol"]


def test_a_monitor_told_other_settings_than_the_runs_says_so_once():
    """A monitor started without the run's --local-steps or --optimizer could not read the trainers' states: one line
    says so, once for each setting a trainer publishes otherwise."""
    output = io.StringIO()
    monitor = Monitor.__new__(Monitor)  # only what check_settings reads: no DHT, no server
    monitor.settings = MonitorSettings(run=RunSettings(run_id="demo"))
    monitor.console = Console(file=output, width=300)
    monitor.agreed = agreed_values(monitor.settings.run, {})
    monitor.said = set()
    monitor.snapshots = None
    now = time.time()
    diloco = agreed_values(RunSettings(run_id="demo", local_steps=100), {})
    adamw = agreed_values(RunSettings(run_id="demo", optimizer="adamw"), {})
    for _ in range(2):
        monitor.check_settings([
            record("a", "alice", 3, 100, now, run_settings=diloco), record("b", "bob", 3, 100, now, run_settings=adamw),
            record("c", "carol", 3, 100, now, run_settings=monitor.agreed),
        ])  # fmt: skip
    assert output.getvalue().splitlines() == [
        "run 'demo' trains with --local-steps 100, this monitor with --local-steps 0: restart it with the run's "
        "setting",
        "run 'demo' trains with --optimizer adamw, this monitor with --optimizer lamb-8bit: restart it with the run's "
        "setting",
    ]


def test_a_monitor_that_would_recompute_without_holding_the_runs_parameters_is_refused_in_one_line(tmp_path):
    """--audit-rate recomputes at the parameters of each global step, which only a helper (--assist-averaging) holds:
    refused before the monitor starts anything."""
    refused = run_ttt(
        "monitor", "--run-id", "demo", "--audit-rate", "0.5", "--checkpoint-dir", tmp_path, check=False, timeout=60
    )
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        "Error: --audit-rate recomputes the others' work at the parameters of each global step, which only a helper "
        "holds: add --assist-averaging, or leave --audit-rate out"
    )


class CallsCounted(RecordValidatorBase):
    """Passes every record but those whose value is b"bad", counting the calls."""

    def __init__(self) -> None:
        self.calls = 0

    def validate(self, record: DHTRecord) -> bool:
        self.calls += 1
        return record.value != b"bad"


def test_the_run_validator_checks_each_record_once_until_validators_are_added():
    """One record arrives from every node near its key: checked the first time, its verdict kept; any change of the
    record is another record; a validator added later (as hivemind's optimizer adds its own) checks again."""
    inner, rejected = CallsCounted(), mp.Value("q", 0)
    validator = RunValidator([inner], rejected)
    good, bad = DHTRecord(b"k", b"s", b"good", 10.0), DHTRecord(b"k", b"s", b"bad", 10.0)
    assert [validator.validate(good) for _ in range(5)] == [True] * 5 and inner.calls == 1
    assert [validator.validate(bad) for _ in range(3)] == [False] * 3 and inner.calls == 2
    assert rejected.value == 3  # each arrival of a rejected record counts, as before the verdicts were kept
    changed = [DHTRecord(b"k", b"s", b"good", 11.0), DHTRecord(b"k", b"t", b"good", 10.0)]  # expiration, subkey
    assert all(validator.validate(record) for record in changed) and inner.calls == 4
    later = CallsCounted()
    validator.merge_with(later)
    assert validator.validate(good) and inner.calls == 5 and later.calls == 1


def test_records_that_fail_validation_are_counted_and_never_read():
    """An attacker without the run's schema stores a malformed record; the monitor's DHT rejects and counts it."""
    run_id = "validated-run"
    rejected = mp.Value("q", 0)
    validators, _ = make_validators(run_id, rejected)
    monitor = hivemind.DHT(start=True, record_validators=validators)
    monitor.add_validators([RSASignatureValidator()])  # as hivemind's optimizer does: it must merge, not re-check
    peer_validators, peer_key = make_validators(run_id)
    peer = hivemind.DHT(start=True, initial_peers=monitor.get_visible_maddrs(), record_validators=peer_validators)
    attacker_signature = RSASignatureValidator()
    attacker = hivemind.DHT(
        start=True, initial_peers=monitor.get_visible_maddrs(), record_validators=[attacker_signature]
    )
    try:
        good = record("", "honest", 4, 64, 0).metrics
        peer.store(metrics_key(run_id), good.dict(), get_dht_time() + 60, subkey=peer_key)
        garbage = {"step": "not a number", "display_name": "x" * 1000}
        attacker.store(metrics_key(run_id), garbage, get_dht_time() + 60, subkey=attacker_signature.local_public_key)
        records, unparsed = parse_records(monitor.get(metrics_key(run_id), latest=True))
        assert [r.metrics for r in records] == [good] and unparsed == 0
        assert rejected.value >= 1
    finally:
        for dht in (attacker, peer, monitor):
            dht.shutdown()


def test_history_is_one_transaction_per_refresh(tmp_path):
    """A refresh that fails half-way leaves nothing of itself behind."""
    now = time.time()
    history = History(tmp_path / "monitor.sqlite")
    records = [record("a", "a", 1, 10, now)]
    history.record_refresh(now, records, summarize(records, now, WINDOW), rejected=0)
    history.db.execute("CREATE TRIGGER fail BEFORE INSERT ON series BEGIN SELECT RAISE(ABORT, 'disk full'); END")
    later = [record("a", "a", 2, 99, now + 1)]
    with pytest.raises(sqlite3.IntegrityError):
        history.record_refresh(now + 1, later, summarize(later, now + 1, WINDOW), rejected=0)
    assert history.total_samples() == 10 and history.curves()["step"] == [1]


def test_the_monitor_reports_the_swarm_and_its_leaderboard_equals_what_the_peers_reported(swarm):
    seen = swarm.monitor
    contributed = {DISPLAY_NAMES[name]: log.contributed for name, log in swarm.logs.items()}
    final = seen.final
    assert {peer["name"]: peer["samples"] for peer in final["peers"]} == contributed
    assert final["total_samples"] == sum(contributed.values())
    assert final["global_step"] == MAX_STEPS and final["hashes"] == {"step": MAX_STEPS, "distinct": 1, "agree": True}
    assert final["active_peers"] == 0 and not any(peer["online"] for peer in final["peers"])  # all finished
    during = seen.during
    assert during["active_peers"] == 3 and all(peer["online"] for peer in during["peers"])
    assert during["loss"] > 0 and during["samples_per_second"] > 0 and during["time_left_seconds"] > 0
    coverage = during["coverage"]  # the swarm's data epoch, from its leases: the sample's 8 row groups, a block each
    parts = ("done", "reading", "left", "not_started")
    assert coverage["blocks"] == 8 and sum(coverage[part] for part in parts) == 8 and coverage["not_started"] < 8
    assert f'ttt_global_step{{run_id="test-run"}} {MAX_STEPS}' in seen.metrics_text
    assert seen.stop_code == 0 and "Traceback" not in seen.process.text, seen.process.text
    assert "monitor stopped after" in seen.process.text
    # The monitor read every peer's commitments: rows behind its claim, never more than it claimed (a step's
    # microbatches are published at the next step, so the last ones may be missing)
    history = sqlite3.connect(swarm.root / "monitor" / "monitor.sqlite")
    backed = history.execute(
        "SELECT total_samples, coalesce(sum(rows), 0) FROM peers "
        "LEFT JOIN commitments ON commitments.key = peers.key GROUP BY peers.key"
    ).fetchall()
    assert len(backed) == 3 and all(0 < committed <= claimed for claimed, committed in backed), backed


def test_a_killed_monitor_restarts_with_its_history(swarm):
    before, after = swarm.monitor.before_kill, swarm.monitor.final
    points = len(before["history"]["time"])
    assert points >= 2 and after["history"]["time"][:points] == before["history"]["time"]
    samples_before = {peer["name"]: peer["samples"] for peer in before["peers"]}
    samples_after = {peer["name"]: peer["samples"] for peer in after["peers"]}
    # A volunteer that joined just before the kill may show none yet: its first record comes before its first batch
    # (clean-clone run 35, where peers started 2 s sooner).
    assert sum(samples_before.values()) > 0
    assert all(samples_after[name] >= samples for name, samples in samples_before.items())


def test_the_monitors_checkpoint_generates_images_and_its_previews_are_served(swarm, tmp_path):
    seen = swarm.monitor
    folder = seen.process.folder
    step = json.loads((folder / "latest.json").read_text())["step"]
    assert step >= 5 and seen.final["checkpoint"]["step"] == step
    result = run_ttt("generate", "a red circle", "--checkpoint", folder, "--out", tmp_path, "--num-samples", "2")
    assert f"global step {step}" in result.stdout and len(list(tmp_path.glob("a-red-circle-seed0-0*.png"))) == 2
    previews = seen.final["previews"]
    assert previews["images"][0]["prompt"] == "a red circle"
    assert seen.preview[:8] == b"\x89PNG\r\n\x1a\n"
    assert "--dry-run: would push to ttt-tests/monitor-run" in seen.process.text


def test_ttt_status_shows_the_run_from_its_swarm_with_or_without_the_monitor(swarm):
    """`ttt status` during the run: through the monitor's multiaddress (--json: the DHT, without the monitor's web
    server) and through the monitor's URL."""
    as_json, printed = swarm.status
    assert as_json.returncode == 0 and printed.returncode == 0, (as_json.stderr, printed.stderr)
    document = json.loads(as_json.stdout)
    assert document["run_id"] == "test-run" and document["spec"]["preset"] == "tiny" and not document["signed"]
    peers = document["peers"]
    assert document["global_step"] >= 7 and {peer["name"] for peer in peers} == set(DISPLAY_NAMES.values())
    assert document["active_peers"] == sum(not peer["finished"] for peer in peers)  # read while the run went on
    assert all(peer["reachable"] and peer["version"] for peer in peers)
    first, *rows = printed.stdout.splitlines()
    assert first.startswith("run 'test-run' (unsigned spec: preset tiny, lamb-8bit, synchronous) | global step ")
    assert all(any(name in row for row in rows) for name in DISPLAY_NAMES.values()), printed.stdout


def test_the_dashboard_and_the_join_page_in_a_real_browser(swarm):
    """Headless Chromium opened both pages while the run trained (the fixture saved dashboard.png, join.png)."""
    dashboard, join = swarm.monitor.dashboard, swarm.monitor.join
    assert dashboard["errors"] == [] and dashboard["canvases"] >= 3, dashboard
    assert "test-run" in dashboard["text"] and all(name in dashboard["text"] for name in DISPLAY_NAMES.values())
    assert "data epoch " in dashboard["text"] and " of 8 blocks read" in dashboard["text"]
    assert join["errors"] == [], join
    assert swarm.monitor.during["join"]["addresses"][0] in join["text"]
    wheel_name = swarm.monitor.during["join"]["wheel"]
    assert f"pip install 'ttt[train] @ {swarm.monitor.process.url}wheel/{wheel_name}'" in join["text"]
    with zipfile.ZipFile(io.BytesIO(swarm.monitor.wheel)) as wheel:  # the very ttt the run uses
        assert wheel.read("training/config.py") == (ROOT / "training" / "config.py").read_bytes()
    assert (swarm.root / "dashboard.png").stat().st_size > 10_000


@pytest.fixture
def web(tmp_path):
    """The monitor's web server on its own, serving whatever the test publishes: (Published, base URL)."""
    published = Published()
    server = serve("127.0.0.1", 0, published, tmp_path)
    yield published, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def ttt_calc(*args: str) -> tuple[dict, list[list[str]], list[str]]:
    """What `ttt calc ARGS` tells a user: its --json estimate, and its table's rows and the lines under it (printed
    on a wide terminal, so that no line is broken)."""
    estimate = json.loads(run_ttt("calc", *args, "--json").stdout)
    printed = run_ttt("calc", *args, env={"COLUMNS": "200"}).stdout.splitlines()
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in printed if line.startswith("│")]
    lines = printed[next(i for i, line in enumerate(printed) if line.startswith("└")) + 1 :]
    return estimate, rows, lines


def test_the_calculators_api_answers_what_ttt_calc_prints_or_what_is_wrong(web):
    _, base = web
    with urllib.request.urlopen(base + "api/calc?preset=tiny&batch_size=8&offload=true&fit_gib=2") as response:
        assert response.headers["Content-Type"] == "application/json"
        assert json.load(response) == ttt_calc("--preset", "tiny", "--batch-size", "8", "--offload", "--fit", "2")[0]
    mistakes = {
        "layers=2&width=10&heads=3&seq_len=8&vocab=16": (
            "width 10 is not divisible by 3 heads; choose a width that is a multiple of them"
        ),
        "preset=tiny&batch_size=": "batch_size must be a number, got ''",  # an emptied field is not the default
        "preset=tiny&fit_gib=nan": "--fit must be a positive number of GiB, got nan",
        "preset=tiny&uplink_mbit=inf": "uplink and PCIe speeds must be positive, finite numbers",
    }
    for query, error in mistakes.items():
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(base + "api/calc?" + query)
        assert answer.value.code == 400 and json.load(answer.value) == {"error": error}, query
    with urllib.request.urlopen(base + "api/calc/choices") as response:
        choices = json.load(response)
    assert choices["models"] == list(MODELS) and choices["reversible"] == ["tiny", "small", "ttt-1.1b"]
    assert choices["defaults"]["offload"] is True  # as ttt train runs: hivemind offloads the optimizer
    assert choices["defaults"]["audits"] is True  # and audits others at its default --audit-rate


def publish_a_run_to_join(published: Published, base: str) -> str:
    """A run of the small preset published to the web server at `base` with no peer yet: the command its Join page
    shows (with the page's own address: the monitor's)."""
    now = time.time()
    state = RunState(
        run_id="fit-run", updated_at=now, refresh_seconds=60, summary=summarize([], now, WINDOW), total_steps=200,
        time_left_seconds=None, total_samples=0, rejected_records=0, leaderboard=[], curves={}, previews=None,
        checkpoint=None, addresses=["/ip4/127.0.0.1/tcp/31337/p2p/QmPeer"], join_options=["--preset", "small"],
    )  # fmt: skip
    published.publish(state_json(state), b"")
    return f"ttt train --join {base.rstrip('/')}"


def calculator_shown(page) -> dict:
    """What the "Will it fit?" card shows: its title, table rows, traffic lines, advice, join command and error
    (None while hidden)."""
    return page.evaluate(
        """() => ({
            title: document.getElementById("calc-title").textContent,
            rows: Array.from(document.querySelectorAll("#calc tbody tr"),
                             (tr) => Array.from(tr.cells, (cell) => cell.textContent)),
            lines: Array.from(document.querySelectorAll("#calc-traffic li"), (li) => li.textContent),
            advice: document.getElementById("calc-advice").textContent,
            command: document.getElementById("calc-join").hidden
                ? null : document.getElementById("calc-command").textContent,
            error: document.getElementById("calc-error").hidden
                ? null : document.getElementById("calc-error").textContent,
        })"""
    )


def assert_calculator_shows(page, flags: str) -> dict:
    """The card shows what `ttt calc FLAGS` prints: the same rows, sizes, traffic and largest batch."""
    estimate, rows, lines = ttt_calc(*flags.split())
    seen = calculator_shown(page)
    assert seen["rows"] == rows and seen["error"] is None
    totals = {row[0]: row[2] for row in seen["rows"]}
    assert [totals["GPU memory"], totals["host RAM"], totals["RAM on a CPU-only machine"]] == [
        f"{estimate[key] / 2**30:,.2f} GiB" for key in ("device_total", "host_total", "cpu_total")
    ]
    assert seen["title"] == f"{estimate['model']}: {estimate['parameters_count'] / 1e6:,.1f} M parameters"
    assert sorted([*seen["lines"], seen["advice"]]) == sorted(lines)
    assert seen["advice"].endswith(f": {estimate['largest_batch_size']}")
    return {**seen, "largest": estimate["largest_batch_size"]}


def check_the_calculator_starts_from_the_runs_model(page, problems, command: str, screenshots: Path) -> None:
    """The card opens on the model and settings `ttt train` runs, with the command to join at the largest batch,
    and fits a phone's width."""
    from tests.support.browser import PHONE, wait_until_attached

    wait_until_attached(page, '#calc[data-state="ok"]', problems)
    form = {name: page.input_value(f"#calc-{name}") for name in ("preset", "batch-size", "optimizer", "precision")}
    assert form == {"preset": "small", "batch-size": "16", "optimizer": "lamb-8bit", "precision": "fp32"}
    checked = [page.is_checked(f"#calc-{name}") for name in ("offload", "reversible", "checkpointing", "audits")]
    assert checked == [True, True, False, True]
    first = assert_calculator_shows(page, "--preset small --batch-size 16 --offload --reversible --audits --fit 8")
    assert first["largest"] > 16 and first["command"] == f"{command} --batch-size {first['largest']}"
    page.screenshot(path=screenshots / "join-calc-desktop.png", full_page=True)

    page.set_viewport_size({"width": PHONE[0], "height": PHONE[1]})
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")  # nothing sticks out
    page.screenshot(path=screenshots / "join-calc-phone.png", full_page=True)


def check_the_calculator_on_another_model(page, problems) -> None:
    """Every input changed, to a model the run does not train: the card shows what `ttt calc` prints for it, and
    no command to join with."""
    from tests.support.browser import wait_until_attached

    page.select_option("#calc-preset", "gpt2-m")  # not a ttt model: reversible layers go off with it
    page.fill("#calc-batch-size", "4")
    page.select_option("#calc-optimizer", "adamw")
    page.select_option("#calc-precision", "mixed")
    page.uncheck("#calc-offload")
    page.check("#calc-checkpointing")
    page.uncheck("#calc-audits")
    page.fill("#calc-fit", "12")
    page.fill("#calc-uplink", "20")
    wait_until_attached(page, '#calc[data-state="ok"]', problems)
    assert not page.is_checked("#calc-reversible")
    gpt2 = "--model gpt2-m --batch-size 4 --optimizer adamw --precision mixed --checkpointing"
    other = assert_calculator_shows(page, gpt2 + " --fit 12 --uplink-mbit 20")
    assert other["command"] is None  # ttt train runs this run's model, not gpt2-m
    assert "what ttt train runs: small, lamb-8bit optimizer state" in page.inner_text("#calc-note")
    assert problems.all() == []


def check_bad_inputs_then_the_reset(page, problems, command: str) -> None:
    """A bad batch size shows the server's error instead of a result; Reset goes back to what `ttt train` runs
    (keeping the fit and uplink typed before)."""
    from tests.support.browser import wait_until_attached

    bad_inputs = {"0": "batch size and peers must be positive numbers", "": "batch_size must be a number, got ''"}
    for batch_size, error in bad_inputs.items():
        page.fill("#calc-batch-size", batch_size)
        wait_until_attached(page, '#calc[data-state="error"]', problems)
        assert calculator_shown(page)["error"] == error and page.is_hidden("#calc-result")

    page.click("#calc-reset")  # back to what ttt train runs
    page.fill("#calc-batch-size", "2")
    wait_until_attached(page, '#calc[data-state="ok"]', problems)
    reset = "--model small --batch-size 2 --offload --reversible --audits"
    back = assert_calculator_shows(page, reset + " --fit 12 --uplink-mbit 20")
    assert back["command"] == f"{command} --batch-size {back['largest']}"


def check_only_the_bad_inputs_failed(problems, base: str) -> None:
    """The two bad inputs' answers are the only requests that failed; Chromium logs each in the console."""
    assert problems.page_errors == [] and problems.offsite_requests == []
    assert [failed.split("?")[0] for failed in problems.failed_requests] == [f"GET {base}api/calc"] * 2
    assert all(failed.endswith(" -> 400") for failed in problems.failed_requests)
    assert problems.console_errors == [
        f"Failed to load resource: the server responded with a status of 400 (Bad Request) ({failed.split()[1]}:0)"
        for failed in problems.failed_requests
    ]


def test_the_join_pages_calculator_shows_what_ttt_calc_prints_in_a_real_browser(web, tmp_path):
    """The "Will it fit?" card, driven in Chromium: it starts from this run's model as `ttt train` runs it, shows
    for every input what `ttt calc` prints, and the command to join with at the largest batch that fits."""
    from tests.support.browser import browser_page

    published, base = web
    command = publish_a_run_to_join(published, base)
    with browser_page(base + "join") as (page, problems):
        check_the_calculator_starts_from_the_runs_model(page, problems, command, tmp_path)
        check_the_calculator_on_another_model(page, problems)
        check_bad_inputs_then_the_reset(page, problems, command)
    check_only_the_bad_inputs_failed(problems, base)


def test_monitor_mistakes_are_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monitor = ["monitor", "--run-id", "mistakes", "--checkpoint-dir", tmp_path]
        result = run_ttt(*monitor, "--port", str(port), check=False, timeout=60)
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        f"Error: cannot serve the dashboard on 127.0.0.1:{port} (Address already in use); pass --port with a free port"
    ]
    for args, expected in [
        (["--initial-peers", "not-an-address"], "--initial-peers 'not-an-address' is not a multiaddress"),
        (["--push-to", "hf://datasets/org/name"], "bad Hub location 'hf://datasets/org/name'"),
        (["--push-to", "hf://org/name"], "set HF_TOKEN to a Hugging Face token with write access"),
    ]:
        result = run_ttt(*monitor, "--port", "0", *args, check=False, env=NO_TOKEN)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1 and expected in lines[0], result.stderr


def test_wandb_logging_works_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    settings = MonitorSettings(
        run=RunSettings(run_id="logged"), port=0, host_maddrs=["/ip4/127.0.0.1/tcp/0"], checkpoint_dir=str(tmp_path),
        checkpoint_every=0, wandb_project="ttt-tests",
    )  # fmt: skip
    monitor = Monitor(settings, Console(file=io.StringIO()))
    try:
        monitor.refresh()
    finally:
        monitor.shutdown()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0


def test_a_peer_claiming_far_more_samples_than_the_others_is_marked_and_counted_as_the_bound():
    now = time.time()
    rates = {"cpu-a": 10.0, "cpu-b": 12.0, "liar": 12_000.0}
    records = [record(name, name, 5, 0, now, samples_per_second=rate) for name, rate in rates.items()]
    summary = summarize(records, now, WINDOW)
    assert summary.claims_capped == ("liar",)
    assert summary.samples_per_second == pytest.approx(10.0 + 12.0 + 2 * 12.0)  # twice the median, not 12,000
    two = summarize(records[1:], now, WINDOW)  # a GPU beside a CPU: no majority to doubt either
    assert two.claims_capped == () and two.samples_per_second == pytest.approx(12_012.0)


def test_the_join_command_gives_every_run_setting_that_is_not_the_default():
    """A newcomer who runs the Join page's command steps as the others do: every run setting the organiser changed
    is in it (a peer set otherwise is refused), the run's id on its own."""
    tuned = RunSettings(run_id="tuned", learning_rate=0.01, weight_decay=0.1, seed=7, matchmaking_time=15.0)
    assert join_options(tuned) == [
        "--preset", "tiny", "--learning-rate", "0.01", "--weight-decay", "0.1", "--matchmaking-time", "15",
        "--seed", "7",
    ]  # fmt: skip
    assert join_options(RunSettings(run_id="plain")) == ["--preset", "tiny"]
    assert join_options(RunSettings(dataset="hf://datasets/org/codes", preset="small")) == [
        "--preset", "small", "--dataset", "hf://datasets/org/codes"
    ]  # fmt: skip
