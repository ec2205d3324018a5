"""`ttt monitor`: the live monitor of the shared swarm run (tests/conftest.py), its dashboard in a real browser,
and its aggregation, history and record validation on their own."""

import io
import json
import multiprocessing as mp
import random
import socket
import sqlite3
import time

import hivemind
import pytest
from conftest import DISPLAY_NAMES, MAX_STEPS, run_ttt
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from rich.console import Console

from training.config import MonitorSettings
from training.metrics import CountingValidator, PeerMetrics, PeerRecord, make_validators, metrics_key, parse_records
from training.monitor.aggregate import global_step, outliers_sent, summarize
from training.monitor.history import SCHEMA, History
from training.monitor.report import RunState, prometheus_text, state_json
from training.monitor.run import Monitor

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
    from synthetic_peers import SyntheticPeers, make_keys

    settings = MonitorSettings(
        run_id="crowd", port=0, host_maddrs=["/ip4/127.0.0.1/tcp/0"], checkpoint_dir=str(tmp_path), checkpoint_every=0
    )
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
    assert b'"command": "ttt train --stream --run-id r --preset tiny --initial-peers /ip4/1.2.3.4/tcp/5/p2p/Qm"' in (
        document
    )
    assert json.loads(document)["outliers"] == {"step": 3, "dropped": 1, "clipped": 2}
    assert {peer["name"]: peer["outliers"] for peer in json.loads(document)["peers"]} == {
        'evil"name\n<script>': 5,
        "bob": 0,
    }
    text = prometheus_text(state).decode()
    assert 'ttt_peer_samples_total{run_id="r",name="evil\\"name\\n<script>"} 100' in text
    assert 'ttt_peer_outliers_total{run_id="r",name="evil\\"name\\n<script>"} 5' in text
    assert 'ttt_dropped{run_id="r"} 1' in text and 'ttt_clipped{run_id="r"} 2' in text
    assert 'ttt_rejected_records{run_id="r"} 2' in text and "ttt_loss{" in text


def test_records_that_fail_validation_are_counted_and_never_read():
    """An attacker without the run's schema stores a malformed record; the monitor's DHT rejects and counts it."""
    run_id = "validated-run"
    rejected = mp.Value("q", 0)
    validators, _ = make_validators(run_id)
    monitor = hivemind.DHT(start=True, record_validators=[CountingValidator(validators, rejected)])
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
    assert f'ttt_global_step{{run_id="test-run"}} {MAX_STEPS}' in seen.metrics_text
    assert seen.stop_code == 0 and "Traceback" not in seen.process.text, seen.process.text
    assert "monitor stopped after" in seen.process.text


def test_a_killed_monitor_restarts_with_its_history(swarm):
    before, after = swarm.monitor.before_kill, swarm.monitor.final
    points = len(before["history"]["time"])
    assert points >= 2 and after["history"]["time"][:points] == before["history"]["time"]
    samples_after = {peer["name"]: peer["samples"] for peer in after["peers"]}
    assert all(samples_after[peer["name"]] >= peer["samples"] > 0 for peer in before["peers"])


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


def test_the_dashboard_and_the_join_page_in_a_real_browser(swarm):
    """Headless Chromium opened both pages while the run trained (the fixture saved dashboard.png, join.png)."""
    dashboard, join = swarm.monitor.dashboard, swarm.monitor.join
    assert dashboard["errors"] == [] and dashboard["canvases"] >= 3, dashboard
    assert "test-run" in dashboard["text"] and all(name in dashboard["text"] for name in DISPLAY_NAMES.values())
    assert join["errors"] == [], join
    assert swarm.monitor.during["join"]["addresses"][0] in join["text"]
    assert (swarm.root / "dashboard.png").stat().st_size > 10_000


def test_monitor_mistakes_are_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_ttt("monitor", "--port", str(port), "--checkpoint-dir", tmp_path, check=False, timeout=60)
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        f"Error: cannot serve the dashboard on 127.0.0.1:{port} (Address already in use); pass --port with a free port"
    ]
    for args, expected in [
        (["--initial-peers", "not-an-address"], "--initial-peers 'not-an-address' is not a multiaddress"),
        (["--push-to", "hf://datasets/org/name"], "bad Hub location 'hf://datasets/org/name'"),
        (["--push-to", "hf://org/name"], "set HF_TOKEN to a Hugging Face token with write access"),
    ]:
        result = run_ttt("monitor", "--port", "0", "--checkpoint-dir", tmp_path, *args, check=False, env=NO_TOKEN)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1 and expected in lines[0], result.stderr


def test_wandb_logging_works_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    settings = MonitorSettings(
        run_id="logged", port=0, host_maddrs=["/ip4/127.0.0.1/tcp/0"], checkpoint_dir=str(tmp_path),
        checkpoint_every=0, wandb_project="ttt-tests",
    )  # fmt: skip
    monitor = Monitor(settings, Console(file=io.StringIO()))
    try:
        monitor.refresh()
    finally:
        monitor.shutdown()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0
