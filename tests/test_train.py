"""`ttt train --stream`: real hivemind peers on 127.0.0.1 training the tiny preset on the sample."""

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import TTT, run_ttt
from safetensors.torch import load_file

from pipeline.sample.domain import COLORS, SHAPES
from training.config import PRESETS
from training.metrics import PeerMetrics, make_validators, publish_metrics, read_metrics
from training.model import DalleTransformer

MAX_STEPS = 12
PEER_ARGS = [
    "--target-batch-size", "32", "--batch-size", "8", "--threads", "1", "--matchmaking-time", "3",
    "--averaging-timeout", "30", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--loader-workers", "0",
]  # fmt: skip


def start_peer(
    dataset: Path | str, folder: Path, *extra: str, env: dict | None = None
) -> tuple[subprocess.Popen, Path]:
    log = folder.with_suffix(".log")
    command = [TTT, "train", "--dataset", str(dataset), "--run-id", "test-run", *PEER_ARGS]
    command += ["--checkpoint-dir", str(folder), *extra]
    # A session of its own, so that a test can Ctrl-C its whole process group as a terminal would.
    output = log.open("w")
    environment = {**os.environ, **(env or {})}
    return subprocess.Popen(
        command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True, env=environment
    ), log


def wait_for(log: Path, pattern: str, process: subprocess.Popen, timeout: float = 180) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text(), re.M)
        if found:
            return found
        if process.poll() is not None:
            raise AssertionError(f"peer exited before printing {pattern!r}:\n{log.read_text()}")
        time.sleep(0.5)
    raise AssertionError(f"no {pattern!r} within {timeout} s:\n{log.read_text()}")


def weights(folder: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(folder / f"step-{step:06d}" / "model.safetensors"))


@pytest.fixture(scope="module")
def swarm(sample_dataset, tmp_path_factory):
    """Peers A and B start training together; C joins once the run is under way."""
    root = tmp_path_factory.mktemp("swarm")
    first, first_log = start_peer(
        sample_dataset, root / "a", "--max-steps", str(MAX_STEPS), "--name", "peer-a", "--wait-for-peers", "2"
    )
    address = wait_for(first_log, r"^/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+$", first).group(0)
    join = ["--initial-peers", address, "--max-steps", str(MAX_STEPS)]
    second, second_log = start_peer(sample_dataset, root / "b", *join, "--name", "peer-b")
    wait_for(first_log, r"^step\s+1 ", first)
    third, third_log = start_peer(sample_dataset, root / "c", *join, "--name", "peer-c")
    peers = {"a": (first, first_log), "b": (second, second_log), "c": (third, third_log)}
    for process, _ in peers.values():
        process.wait(timeout=300)
    return root, {name: (process.returncode, log.read_text()) for name, (process, log) in peers.items()}


def test_peers_reach_the_same_step_with_the_same_parameters(swarm):
    root, results = swarm
    for code, log in results.values():
        assert code == 0, log
        assert f"finished at global step {MAX_STEPS}" in log and "Goodbye" in log
        assert "Traceback" not in log, log
    a, b, c = (weights(root / name, MAX_STEPS) for name in "abc")
    # The peers read different data orders and trained: equal parameters mean they really averaged
    # (a peer whose last round failed downloads the others' final state before leaving).
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)
    torch.manual_seed(0)
    initial = DalleTransformer(PRESETS["tiny"].model).state_dict()
    assert sum((a[k] - initial[k]).abs().sum() for k in a) > 100


def test_a_late_peer_downloads_the_state_and_continues(swarm):
    _, results = swarm
    log = results["c"][1]
    joined_at = int(re.search(r"synchronised at global step (\d+)", log).group(1))
    assert 0 < joined_at < MAX_STEPS
    assert re.search(rf"^step\s+{MAX_STEPS} ", log, re.M)


def test_progress_lines_and_the_loss_going_down(swarm):
    _, results = swarm
    log = results["a"][1]
    lines = re.findall(r"^step\s+(\d+) \| data epoch \d+ \| loss ([\d.]+) \| peers \d(.*)$", log, re.M)
    steps, losses = [int(step) for step, _, _ in lines], [float(loss) for _, loss, _ in lines]
    assert steps == sorted(set(steps)) and steps[-1] == MAX_STEPS, log
    # On a loaded machine a slow peer may miss a round and download the swarm's state; it says so.
    for previous, (step, _, rest) in zip(steps[:-1], lines[1:], strict=True):
        assert (int(step) == previous + 1) != (f"caught up from step {previous}" in rest), log
    assert len(losses) >= MAX_STEPS // 2 and losses[-1] < losses[0], log
    # --wait-for-peers 2: A's first step waited for B
    assert log.index("waiting until 2 peers") < log.index("2 peers are here: training") < log.index("step     1 ")
    assert re.search(r"^/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+$", log, re.M)  # the join address on a line of its own


def test_checkpoints_hold_config_weights_optimizer_and_stream_state(swarm):
    root, _ = swarm
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
    root, _ = swarm
    folder = tmp_path / "resumed"
    subprocess.run(["cp", "-r", str(root / "a"), str(folder)], check=True)
    process, log = start_peer(sample_dataset, folder, "--resume", "--max-steps", str(MAX_STEPS + 2))
    assert process.wait(timeout=180) == 0, log.read_text()
    text = log.read_text()
    assert f"resumed from {folder / f'step-{MAX_STEPS:06d}'} (global step {MAX_STEPS})" in text
    assert f"finished at global step {MAX_STEPS + 2}" in text


def test_ctrl_c_saves_a_checkpoint_and_says_goodbye(sample_dataset, tmp_path):
    process, log = start_peer(sample_dataset, tmp_path / "ck", "--run-id", "ctrl-c-run")
    wait_for(log, r"^step\s+2 ", process)
    os.killpg(process.pid, signal.SIGINT)  # like a terminal's Ctrl-C: the peer and its hivemind processes
    assert process.wait(timeout=60) == 130
    text = log.read_text()
    assert "checkpoint saved, leaving the swarm" in text and "Goodbye" in text and "Traceback" not in text
    assert json.loads((tmp_path / "ck" / "latest.json").read_text())["step"] >= 2


def test_bad_input_is_one_clear_line(sample_dataset, tmp_path):
    unreachable = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWNru9M8ZVTJHWFDbWiSixRgKEWUWbwo6KR83YU9vAZBEg"
    cases = [
        (["--initial-peers", unreachable], "cannot reach any of --initial-peers"),
        (["--initial-peers", "/ip4/nonsense"], "is not a multiaddress"),
        (["--preset", "small"], "codebook of 512 on a 8x8 grid, but the model expects a codebook of 8192"),
        (["--dataset", str(tmp_path / "missing")], "does not exist; make one with `ttt preprocess`"),
        (["--batch-size", "1000000"], "lower --batch-size or use a GPU"),
    ]
    for args, message in cases:
        dataset = [] if "--dataset" in args else ["--dataset", sample_dataset]
        result = run_ttt("train", *dataset, "--checkpoint-dir", tmp_path / "ck", *args, check=False, timeout=120)
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
    from training.peer import LastGoodState

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
    process, log = start_peer(sample_dataset, tmp_path / "alone", "--run-id", "alone-run", "--wait-for-peers", "2")
    wait_for(log, r"^waiting until 2 peers of run 'alone-run' are here", process)
    time.sleep(5)  # long enough for a lone peer at target batch 32 to take a step if it did not wait
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=60) == 130
    text = log.read_text()
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
    assert "global step 2, tokenizer.json tokenizer" in " ".join(generated.stdout.split())
    refused = run_ttt("train", "--dataset", sample_dataset, "--checkpoint-dir", folder, "--resume", *PEER_ARGS,
                      check=False, timeout=120)  # fmt: skip
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert "was trained with another tokenizer than 'bytes'; resume with --tokenizer" in last, refused.stderr
