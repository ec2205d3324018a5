"""`ttt train --stream`: real hivemind peers on 127.0.0.1 training the tiny preset on the sample."""

import json
import re
import shutil
import signal
import subprocess
import time
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.sample.domain import COLORS, SHAPES
from tests.support.commands import MAX_STEPS, PEER_ARGS, run_ttt, run_ttt_concurrently, swarm_run
from tests.support.swarm_runs import ADDRESS, SwarmRun, meets_join_goal, start_ttt
from training.config import PRESETS
from training.metrics import PeerMetrics, make_validators, publish_metrics, read_metrics
from training.model import DalleTransformer


def start_peer(
    dataset: Path | str, folder: Path, *extra: str, env: dict | None = None
) -> tuple[subprocess.Popen, Path]:
    log = folder.with_suffix(".log")
    args = ["--dataset", str(dataset), "--run-id", "test-run", *PEER_ARGS, "--checkpoint-dir", str(folder), *extra]
    return start_ttt("train", args, log, env), log


def weights(folder: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(folder / f"step-{step:06d}" / "model.safetensors"))


def test_peers_reach_the_same_step_with_the_same_parameters(swarm):
    root, logs = swarm.root, swarm.logs
    for log in logs.values():
        assert log.returncode == 0, log.text
        assert f"finished at global step {MAX_STEPS}" in log.text and "Goodbye" in log.text
        assert "Traceback" not in log.text, log.text
    a, b, c = (weights(root / name, MAX_STEPS) for name in "abc")
    # The peers read different data orders and trained, then agreed on their final parameters: a peer apart downloads
    # the others' final state before leaving. Apart they are at every run's end: the state round of step 10 leaves
    # each member apart by the 8-bit noise of its difference (in clean-clone run 159, 39-42 of 60 tensors at step 10,
    # 68-81 in absolute sum, where two steps move them 848), besides a peer whose last round failed.
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)
    torch.manual_seed(0)
    initial = DalleTransformer(PRESETS["tiny"].model).state_dict()
    assert sum((a[k] - initial[k]).abs().sum() for k in a) > 100


def test_every_joiner_takes_part_in_rounds_within_three_steps_of_its_download(swarm):
    """What the peers did during the run, not only how it ended: each joiner trained with the others. A peer that
    misses a round downloads the state and is in the next (what a peer promises): after its download, a joiner
    never misses two rounds in a row, and is in 60% of them or more. C's start on the loaded machine can take five
    steps, and at step 7 a browser, `ttt status` and a refused volunteer start beside it: with six steps left, C
    missed the round of step 7 and that of the last step, which it reached late (clean-clone runs 92 and 97)."""
    logs = swarm.logs
    assert logs["c"].synchronised[0] >= 3, logs["c"].text  # C really joined a run under way
    for name in "bc":
        log = logs[name]
        assert meets_join_goal(log.steps_to_first_round), log.text
        together = [size > 1 for step, size, _ in log.rounds if step > log.synchronised[0]]
        assert not any(not one and not next_one for one, next_one in pairwise(together)), log.text
        assert sum(together) >= 0.6 * len(together), log.text
    # A real share of the samples, not a few batches: at least half of a fair share of the rounds it took part
    # in (C's share of the run depends on how long its start took on a loaded machine; what it did once there not).
    total = sum(log.contributed for log in logs.values())
    rounds = sum(log.rounds_together for log in logs.values())
    shares = {name: (log.contributed, round(total * log.rounds_together / rounds)) for name, log in logs.items()}
    assert all(contributed >= 0.5 * fair for contributed, fair in shares.values()), shares


def test_volunteers_join_with_an_address_alone_and_one_set_otherwise_is_refused(swarm):
    """B joined through the monitor's URL and C through A's multiaddress, with `--join` and no option of the run:
    each read the run's spec (from the monitor's page; from the swarm, where A and the monitor publish it) and
    trained with the others (the tests above). A volunteer who also gave another --optimizer stopped in one line."""
    logs = swarm.logs
    unsigned = "its spec is not signed: any peer there could have published it"
    assert f"joining run 'test-run' at {swarm.monitor.process.url}: {unsigned}" in logs["b"].text, logs["b"].text
    address = r"/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+"
    assert re.search(rf"^joining run 'test-run' at {address}: {unsigned}$", logs["c"].text, re.M), logs["c"].text
    assert swarm.monitor.final["join"]["spec"]["run_id"] == "test-run"
    refused = swarm.refused
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        "Error: --optimizer adam-8bit contradicts run 'test-run', which trains with --optimizer lamb-8bit; leave the "
        "option out to train with the run's"
    )


def test_progress_lines_and_the_loss_going_down(swarm):
    logs = swarm.logs
    text = logs["a"].text
    together = r"(round \d|state download(?:ed|\ failed))"
    line = rf"^step\s+(\d+) \| data epoch \d+ \| loss ([\d.]+) \| peers \d \| {together}(.*)$"
    lines = re.findall(line, text, re.M)
    steps, losses = [int(step) for step, *_ in lines], [float(loss) for _, loss, *_ in lines]
    assert steps == sorted(set(steps)) and steps[-1] == MAX_STEPS, text
    # On a loaded machine a slow peer may miss a round and download the swarm's state; it says so.
    for previous, (step, _, _, rest) in zip(steps[:-1], lines[1:], strict=True):
        assert (int(step) == previous + 1) != (f"caught up from step {previous}" in rest), text
    assert len(losses) >= MAX_STEPS // 2 and losses[-1] < losses[0], text
    # --wait-for-peers 2: A's first step waited for B
    assert text.index("waiting until 2 peers") < text.index("2 peers are here: training") < text.index("step     1 ")
    assert re.search(ADDRESS, text, re.M)  # the join address on a line of its own


def test_a_swarm_keeps_training_together_when_a_peer_dies_and_another_arrives(sample_dataset, tmp_path):
    """Churn: B is SIGKILLed mid-run (no goodbye), D joins after that; A, C and D keep taking part in rounds."""
    max_steps = 13  # D trains for 7 steps or so
    run = swarm_run(sample_dataset, tmp_path, "churn-run", max_steps)
    run.start("a", "--wait-for-peers", "2")
    run.start("b")
    run.wait_for_step("a", 1)
    run.start("c")
    run.wait_for_step("a", 3)
    run.kill("b")
    killed_at = run.logs["a"].rounds[-1][0]
    run.wait_for_step("a", 5)
    run.start("d")
    logs = run.finish()
    for name in "acd":
        assert logs[name].returncode == 0 and f"finished at global step {max_steps}" in logs[name].text, run.timeline()
    assert meets_join_goal(logs["d"].steps_to_first_round), run.timeline()
    # After the round B's death broke, 80% of A's and C's steps averaged with others, and 60% of the joiner D's (its
    # join download may arrive a step old: one more download then). Measured: 8 of 8 of D's in one run of 2026-11-27;
    # 4 of 6 and 6 of 8 in two runs of 2026-11-26, before a peer out of step joined the next round's group while it
    # downloaded (docs/design/averaging.md#a-peer-that-missed-a-round).
    for name, share in (("a", 0.8), ("c", 0.8), ("d", 0.6)):
        rounds = [size for step, size, _ in logs[name].rounds if step > killed_at + 2]
        together = sum(size > 1 for size in rounds)
        assert together >= share * len(rounds), f"{name}: {together} of {len(rounds)} together\n{run.timeline()}"


def test_a_volunteer_who_leaves_early_holds_nobody_up(sample_dataset, tmp_path):
    """A gives 3 steps (its own --max-steps) and B trains on to 6. B's round after A finished has nobody to meet: it
    takes that step alone at once, instead of looking for a group until --averaging-timeout (300 s here: longer than
    this test may take), and A, waiting for B to pass its last step, leaves then. Measured with the default 60 s:
    B took 60 s for that step before, 1.4 s after."""
    run = swarm_run(sample_dataset, tmp_path, "early-run", 6)
    run.start("a", "--wait-for-peers", "2", "--max-steps", "3", "--averaging-timeout", "300")
    run.start("b", "--averaging-timeout", "300")
    logs = run.finish(timeout=240)
    assert logs["a"].returncode == 0 and "finished at global step 3" in logs["a"].text, run.timeline()
    assert logs["b"].returncode == 0 and "finished at global step 6" in logs["b"].text, run.timeline()
    assert max((step for step, size, _ in logs["b"].rounds if size > 1), default=0) <= 3, run.timeline()


def test_checkpoints_hold_config_weights_optimizer_and_stream_state(swarm):
    root = swarm.root
    folder = root / "a"
    latest = json.loads((folder / "latest.json").read_text())
    assert latest == {"step": MAX_STEPS, "path": f"step-{MAX_STEPS:06d}"}
    step_dir = folder / latest["path"]
    config = json.loads((step_dir / "config.json").read_text())
    assert config["model"]["codebook_size"] == 512 and config["dataset"]["grid"] == [8, 8]
    assert config["dataset"]["vqgan"]["target"] == "taming.models.vqgan.VQModel"
    assert {p.name for p in step_dir.iterdir()} == {
        "config.json", "model.safetensors", "training_state.pt", "stream.json"
    }  # fmt: skip


def test_resume_continues_from_the_checkpoint(swarm, sample_dataset, tmp_path):
    root = swarm.root
    folder = tmp_path / "resumed"
    subprocess.run(["cp", "-r", str(root / "a"), str(folder)], check=True)
    process, log = start_peer(sample_dataset, folder, "--resume", "--max-steps", str(MAX_STEPS + 2))
    assert process.wait(timeout=180) == 0, log.read_text()
    text = log.read_text()
    assert f"resumed from {folder / f'step-{MAX_STEPS:06d}'} (global step {MAX_STEPS})" in text
    assert f"finished at global step {MAX_STEPS + 2}" in text


@pytest.mark.parametrize(
    ("signum", "code"),
    [(signal.SIGINT, 130), (signal.SIGTERM, 0)],
    ids=["ctrl-c", "sigterm-to-the-group"],
)
def test_a_signal_to_the_whole_group_saves_a_checkpoint_and_says_goodbye(signum, code, sample_dataset, tmp_path):
    """A terminal's Ctrl-C reaches every process of the peer's group, and so does a service manager's stop: systemd
    (KillMode=control-group, its default) and Slurm signal every process of the unit or job at once. hivemind's
    processes leave the peer's graceful leave to it. Before, they died of the SIGTERM at once, the peer's calls into
    its DHT hung, and it left when its leave timed out (60 s here), with status 1."""
    run = SwarmRun(tmp_path, ["--dataset", str(sample_dataset), "--run-id", "group-signal", *PEER_ARGS])
    run.start("ck")
    run.wait_for_step("ck", 2)
    run.kill("ck", signum)
    text = run.finish(timeout=60)["ck"].text
    assert run.processes["ck"].returncode == code, text
    assert "checkpoint saved, leaving the swarm" in text and "Goodbye" in text and "Traceback" not in text
    assert json.loads((tmp_path / "ck" / "latest.json").read_text())["step"] >= 2


def test_bad_input_is_one_clear_line(sample_dataset, tmp_path):
    unreachable = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWNru9M8ZVTJHWFDbWiSixRgKEWUWbwo6KR83YU9vAZBEg"
    cases = [
        (["--initial-peers", unreachable], "cannot reach any of --initial-peers"),
        (["--initial-peers", "/ip4/nonsense"], "is not a multiaddress"),
        (["--preset", "small"], "codebook of 512 on a 8x8 grid, but the model expects a codebook of 8192"),
        (["--dataset", str(tmp_path / "missing")], "does not exist; make one with `ttt preprocess`"),
        (["--batch-size", "1000000"], "lower --batch-size, or let --batch-size auto choose"),
        (["--batch-size", "auto", "--max-memory", "0.001"], "even at batch 1"),
    ]
    commands = [
        ["train", *([] if "--dataset" in args else ["--dataset", sample_dataset]), "--run-id", "mistakes",
         "--checkpoint-dir", tmp_path / "ck", *args]
        for args, _ in cases
    ]  # fmt: skip
    for (args, message), result in zip(cases, run_ttt_concurrently(commands, timeout=180), strict=True):
        assert result.returncode == 1 and "Traceback" not in result.stderr, (args, result.stderr)
        assert message in result.stderr.strip().splitlines()[-1], (args, result.stderr)


def test_metrics_are_signed_and_validated_in_the_dht():
    import hivemind
    from hivemind.utils import get_dht_time

    validators, key = make_validators("metrics-run")
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validators=validators)
    other_validators, _ = make_validators("metrics-run")
    second = hivemind.DHT(
        start=True,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        initial_peers=[str(a) for a in first.get_visible_maddrs()],
        record_validators=other_validators,
    )
    try:
        metrics = PeerMetrics(
            step=3, samples_per_second=12.5, samples_accumulated=32, total_samples=96, loss=5.5,
            mini_steps=4, display_name="peer-a",
        )  # fmt: skip
        publish_metrics(first, "metrics-run", key, metrics)
        time.sleep(1.0)
        assert read_metrics(second, "metrics-run") == [metrics]
        # A record that breaks the schema is refused by the validators.
        stored = first.store("metrics-run_metrics", {"step": "three"}, get_dht_time() + 60, subkey=key)
        assert not stored
    finally:
        second.shutdown()
        first.shutdown()


def test_non_finite_parameters_roll_back_to_the_last_good_state():
    from training.peer.health import LastGoodState

    torch.manual_seed(0)
    model = DalleTransformer(PRESETS["tiny"].model)
    last_good = LastGoodState(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert not last_good.restore_if_broken(model)
    with torch.no_grad():
        model.blocks[0].attention.qkv.weight[0, 0] = float("nan")
        model.image_embedding.weight.add_(1.0)
    assert last_good.restore_if_broken(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_peer_waiting_for_others_does_not_train_alone_and_leaves_on_ctrl_c(sample_dataset, tmp_path):
    run = SwarmRun(tmp_path, ["--dataset", str(sample_dataset), "--run-id", "alone-run", *PEER_ARGS])
    run.start("alone", "--wait-for-peers", "2")
    run.wait_for("alone", r"^waiting until 2 peers of run 'alone-run' are here")
    time.sleep(5)  # long enough for a lone peer at target batch 32 to take a step if it did not wait
    run.kill("alone", signal.SIGINT)
    text = run.finish(timeout=60)["alone"].text
    assert run.processes["alone"].returncode == 130, text
    assert not re.search(r"^step\s+\d", text, re.M) and "Goodbye" in text and "Traceback" not in text, text


def hub_cache_with(dataset: Path, cache: Path, repo: str) -> Path:
    """A Hub cache holding `repo` as a finished download leaves it (offline, huggingface_hub answers from it)."""
    folder = cache / f"datasets--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / ("0" * 40)
    shutil.copytree(dataset / "data", snapshot / "data")
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0" * 40)
    return snapshot


def caption_tokenizer(path: Path) -> Path:
    """A word-level tokenizers JSON over the sample's words, with its own pad id (0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[PAD]", "[UNK]", "a", "above", "below", "left", "right", "of", *COLORS, *SHAPES]
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


def test_no_stream_trains_from_a_local_copy_and_the_tokenizer_travels_with_the_checkpoint(sample_dataset, tmp_path):
    """--no-stream takes hf:// through the Hub's download API (offline here, answered from its cache);
    --tokenizer FILE trains on a tokenizers JSON, which the checkpoint carries to `ttt generate`."""
    snapshot = hub_cache_with(sample_dataset, tmp_path / "hub", "my-org/sample")
    tokenizer = caption_tokenizer(tmp_path / "words.json")
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    folder = tmp_path / "ck"
    extra = ["--no-stream", "--tokenizer", str(tokenizer), "--max-steps", "2", "--run-id", "no-stream-run"]
    process, log = start_peer("hf://datasets/my-org/sample", folder, *extra, env=env)
    assert process.wait(timeout=180) == 0, log.read_text()
    text = log.read_text()
    assert f"training from a local copy of hf://datasets/my-org/sample: {snapshot}" in text, text
    assert "finished at global step 2" in text
    step_dir = folder / "step-000002"
    config = json.loads((step_dir / "config.json").read_text())
    assert config["tokenizer"] == "tokenizer.json" and config["dataset"]["source"] == "hf://datasets/my-org/sample"
    assert (config["model"]["text_vocab_size"], config["model"]["pad_id"]) == (17, 0)
    assert (step_dir / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    generated = run_ttt("generate", "a red circle", "--checkpoint", folder, "--num-samples", "1", "--out", tmp_path)
    table_text = " ".join(generated.stdout.replace("│", " ").split())  # the cell wraps where the path's length says
    assert "global step 2, tokenizer.json tokenizer" in table_text, generated.stdout
    refused = run_ttt("train", "--dataset", sample_dataset, "--run-id", "resume-run", "--checkpoint-dir", folder,
                      "--resume", *PEER_ARGS, check=False, timeout=120)  # fmt: skip
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert "was trained with another tokenizer than 'bytes'; resume with --tokenizer" in last, refused.stderr


def test_a_held_step_does_not_end_before_the_hold_unless_the_swarm_has_moved_on():
    import hivemind
    from hivemind.utils import get_dht_time

    from training.swarm.optimizer import SwarmProgressTracker

    def until(condition) -> bool:  # hivemind's tracker reads the others' progress every 30 s at most
        deadline = time.monotonic() + 40
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.1)
        return condition()

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    other_dht = hivemind.DHT(
        start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[str(a) for a in dht.get_visible_maddrs()]
    )
    tracker = SwarmProgressTracker(dht=dht, prefix="hold-run", target_batch_size=8, start=True)
    other = SwarmProgressTracker(dht=other_dht, prefix="hold-run", target_batch_size=8, start=True)
    try:
        tracker.report_local_progress(local_epoch=0, samples_accumulated=16)
        assert until(lambda: tracker.ready_to_update_epoch)  # the target batch is reached: hivemind would step
        tracker.hold_until = get_dht_time() + 60  # a newcomer asked the swarm to wait for it
        assert not tracker.ready_to_update_epoch and tracker.estimated_next_update_time >= tracker.hold_until
        # Another peer ends the step once this peer's report has reached it: the two trackers share this process's
        # signing key (hivemind's `RSAPrivateKey.process_wide`), so both write one DHT subkey and the later store wins.
        assert until(lambda: other.global_progress.samples_accumulated >= 16)
        other.report_local_progress(local_epoch=1, samples_accumulated=1)
        assert until(lambda: tracker.global_epoch == 1) and tracker.ready_to_update_epoch  # follow it
    finally:
        for closing in (other, tracker, other_dht, dht):
            closing.shutdown()


def test_a_peer_that_keeps_falling_behind_is_told_what_batch_fits():
    from training.peer.report import falling_behind_advice

    advice = falling_behind_advice(batch_size=48, batch_seconds=20.0, swarm_step_seconds=5.0)
    assert "keeps falling behind" in advice and "a batch of 48 takes 20.0 s" in advice
    assert advice.endswith("use --batch-size 6 so that its batches arrive before the swarm's rounds")
    too_slow = falling_behind_advice(batch_size=1, batch_seconds=20.0, swarm_step_seconds=5.0)
    assert too_slow.endswith("this device is too slow for this run's global steps")
    # As a home peer on a 20 Mbit/s link saw it: the 16-sample batch fits, the state download does not.
    slow_link = falling_behind_advice(batch_size=16, batch_seconds=1.9, swarm_step_seconds=7.9, download_seconds=7.1)
    assert "a state download 7.1 s" in slow_link and "--batch-size" not in slow_link
    assert slow_link.endswith("the run needs longer global steps (its organiser's --target-batch-size)")
    fast_link = falling_behind_advice(batch_size=48, batch_seconds=20.0, swarm_step_seconds=5.0, download_seconds=0.5)
    assert fast_link.endswith("use --batch-size 6 so that its batches arrive before the swarm's rounds")


def published(peer_id: str, **fields) -> PeerMetrics:
    """A record as a peer of this ttt publishes it (its protocol and the run's settings unless `fields` say
    otherwise)."""
    from training.config import PROTOCOL

    fields = {"protocol": PROTOCOL, "run_settings": agreed(), **fields}
    return PeerMetrics(step=3, samples_per_second=1.0, samples_accumulated=16, total_samples=64, loss=5.0,
                       mini_steps=1, display_name=peer_id, peer_id=peer_id, **fields)  # fmt: skip


def agreed(**settings) -> dict:
    """The run settings a peer of run 'r' publishes, with `settings` instead of the defaults."""
    from training.config import RunSettings, agreed_values

    identities = {"dataset": "(1,068 rows, sha256 0123456789ab)", "tokenizer": "(UTF-8 bytes)"}
    identities.update({name: settings.pop(name) for name in identities if name in settings})  # what the files hold
    return agreed_values(RunSettings(run_id="r", **settings), identities)


@pytest.mark.parametrize(
    "ours, refusal",
    [
        (agreed(optimizer="adamw"), "--optimizer lamb-8bit, this peer with --optimizer adamw"),
        (agreed(learning_rate=0.01), "--learning-rate (default), this peer with --learning-rate 0.01"),
        (agreed(target_batch_size=32), "--target-batch-size 64, this peer with --target-batch-size 32"),
        (agreed(aggregation="centered-clip"), "--aggregation mean, this peer with --aggregation centered-clip"),
        (agreed(tokenizer="(a tokenizers JSON, sha256 fedcba987654)"),
         "--tokenizer (UTF-8 bytes), this peer with --tokenizer (a tokenizers JSON, sha256 fedcba987654)"),
        (agreed(dataset="(200 rows, sha256 fedcba987654)"),
         "--dataset (1,068 rows, sha256 0123456789ab), this peer with --dataset (200 rows, sha256 fedcba987654)"),
    ],
)  # fmt: skip
def test_a_peer_set_otherwise_than_the_run_is_refused_naming_the_option_and_both_values(ours, refusal):
    """Checked before the peer downloads anything, for every run setting (training/config.py's RunSettings): the
    states of different optimizers do not load into each other, other learning rates or batches step apart."""
    from training.config import PROTOCOL
    from training.peer.setup import TrainError
    from training.peer.view import check_same_settings

    run = [published("a"), published("b")]
    check_same_settings(run, agreed(), "r", "me")  # the run's settings: admitted
    with pytest.raises(TrainError) as refused:
        check_same_settings(run, ours, "r", "me")
    assert str(refused.value) == f"run 'r' trains with {refusal}; join with the run's setting"
    with pytest.raises(TrainError):  # a peer that finished still says what the run trained with
        check_same_settings([published("a", finished=True)], ours, "r", "me")
    older = published("a", run_settings=ours, finished=True, protocol=PROTOCOL - 1)
    check_same_settings([older], agreed(), "r", "me")  # a finished peer of another protocol: its run is another


def test_a_peer_of_another_protocol_is_refused_naming_both_versions():
    """A record without a protocol is an older ttt's (protocol 1); one of a newer protocol names its version."""
    from training.config import PROTOCOL, ttt_version
    from training.peer.setup import TrainError
    from training.peer.view import check_same_settings

    older = PeerMetrics(step=3, samples_per_second=1.0, samples_accumulated=16, total_samples=64, loss=5.0,
                        mini_steps=1, display_name="old", peer_id="old")  # fmt: skip
    with pytest.raises(TrainError) as refused:
        check_same_settings([older], agreed(), "r", "me")
    assert str(refused.value) == (
        f"run 'r' runs ttt an older version (protocol 1), this peer ttt {ttt_version()} (protocol {PROTOCOL}): "
        "install the run's version (its monitor's Join page has the line) and join again"
    )
    newer = published("new", protocol=PROTOCOL + 1, version="9.9.9")
    with pytest.raises(TrainError, match=rf"^run 'r' runs ttt 9\.9\.9 \(protocol {PROTOCOL + 1}\), this peer"):
        check_same_settings([newer], agreed(), "r", "me")
    check_same_settings([published("same", version="0.0.1")], agreed(), "r", "me")


def test_a_leave_cut_short_says_whether_its_checkpoint_was_written(monkeypatch):
    """A leave that runs past its bound exits at once; its last line says the checkpoint was saved when the loop had
    written it before the hang (a group SIGTERM's leave hung in its DHT calls after the checkpoint, and said
    "without a checkpoint")."""
    import io

    from rich.console import Console

    from training.peer import stopping

    exits = []
    monkeypatch.setattr(stopping, "exit_now", exits.append)
    out = io.StringIO()
    stop = stopping.StopSignals(Console(file=out, width=200), leave_within=60)
    stop.too_slow()
    stop.checkpoint_saved = True
    stop.too_slow()
    lines = out.getvalue().splitlines()
    assert lines == [
        "could not leave within 60 s: leaving at once, without a checkpoint",
        "could not leave within 60 s: leaving at once, its checkpoint saved",
    ]
    assert exits == [1, 1]
