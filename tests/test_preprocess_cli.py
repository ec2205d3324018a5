"""`ttt preprocess` end to end on the embedded sample, driven through the CLI as a user would."""

import json
import os
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import psutil
import pytest
import torch
from PIL import Image

from pipeline.core.shard_format import binary_to_codes, read_facts
from pipeline.inspect_dataset import first_rows
from pipeline.sample.domain import DEFAULT_SEED, defect_plan, serve_folder, write_sample
from pipeline.sample.judge import judge
from pipeline.vqgan.codec import SAMPLE_VQGAN_CONFIG, decode, load_vqgan, sample_vqgan_spec, tensor_to_images
from pipeline.vqgan.grid import CAPTION_HEIGHT
from tests.support.commands import FAULTHANDLER, SAMPLE_ARGS, TTT, dataset_files, run_ttt
from tests.support.swarm_runs import start_ttt

SAMPLE_ROWS = 200


def card_table(card: str, heading: str) -> dict[str, int]:
    """The `| reason | count |` rows of one table of the card."""
    section = card.split(f"### {heading}\n", 1)[1].split("\n#", 1)[0]
    return {m[0]: int(m[1]) for m in re.findall(r"^\| ([^|]+?) \| (\d+) \|$", section, re.M)}


def test_sample_becomes_a_valid_dataset_with_exactly_the_expected_rows(sample_dataset):
    plan = defect_plan(SAMPLE_ROWS, DEFAULT_SEED)
    expected_keys = [str(1_000_000 + i) for i, defect in enumerate(plan) if defect is None]

    ds = datasets.load_dataset(str(sample_dataset), split="train")
    assert ds["key"] == expected_keys  # filters, failures and shard order all as planned
    facts = read_facts(next((sample_dataset / "data").glob("*.parquet")))
    assert (facts.codebook_size, facts.grid_height, facts.grid_width, facts.image_size) == (512, 8, 8, 64)
    for row in ds.select(range(5)):
        codes = binary_to_codes(row["code"], 8, 8)
        assert codes.min() >= 0 and codes.max() < 512
    assert len(list((sample_dataset / "data").glob("train-*-of-00008.parquet"))) == 8

    parquet_rows = datasets.load_dataset("parquet", data_files=str(sample_dataset / "data/*.parquet"), split="train")
    assert parquet_rows["key"] == expected_keys

    card = (sample_dataset / "README.md").read_text()
    defects = Counter(d for d in plan if d)
    assert card_table(card, "Filters") == {
        "caption too short": defects["short caption"],
        "non-positive width/height": defects["zero size"],
        "extreme aspect ratio": defects["extreme aspect ratio"],
        "NSFW label not allowed": defects["nsfw"],
        "duplicate URL": defects["duplicate url"],
    }
    assert card_table(card, "Download failures") == {
        "HTTP 404": defects["http 404"],
        "undecodable image": defects["corrupt image"],
    }
    assert f"num_examples: {len(expected_keys)}" in card
    assert "ttt preprocess --sample-rows 200 --shards 8" in card
    assert re.search(r"VQGAN checkpoint sha256 \| `[0-9a-f]{64}`", card)


def test_rerun_skips_finished_shards_and_different_settings_are_refused(sample_dataset):
    before = dataset_files(sample_dataset)
    rerun = run_ttt("preprocess", *SAMPLE_ARGS, "--dataset", sample_dataset, "--json")
    assert "resuming: 8 of 8 shards already written" in rerun.stderr
    assert dataset_files(sample_dataset) == before
    summary = json.loads(rerun.stdout)  # --json: the summary alone on stdout
    expected_rows = sum(d is None for d in defect_plan(SAMPLE_ROWS, DEFAULT_SEED))
    assert (summary["shards_written"], summary["shards_this_run"], summary["rows_written"]) == (8, 0, expected_rows)
    assert summary["dataset"] == str(sample_dataset) and summary["rows_in"] == SAMPLE_ROWS

    refused = run_ttt(
        "preprocess", "--sample-rows", SAMPLE_ROWS, "--shards", 4, "--dataset", sample_dataset, check=False
    )
    assert refused.returncode == 1
    assert "Traceback" not in refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("Error:") and "different settings (shards)" in last and "--overwrite" in last
    assert dataset_files(sample_dataset) == before


def start_run_and_wait_for_first_shard(out: Path) -> tuple[subprocess.Popen, Path]:
    """Start a sample run and return it, with the file its output goes to, once the first shard is recorded (one
    worker: shards finish one by one). Its output goes to a file, not a pipe no one reads until the end: a full pipe
    would stop the run. A run that records no shard in 300 s is stopped with SIGABRT, which makes faulthandler print
    where each of its threads was, and the test fails with that."""
    log = out.parent / f"{out.name}.log"
    args = [*map(str, SAMPLE_ARGS), "--dataset", str(out), "--workers", "1"]
    process = start_ttt("preprocess", args, log, env=FAULTHANDLER)
    manifest = out / "ttt_manifest.json"
    deadline = time.time() + 300
    while process.poll() is None:
        if manifest.exists() and json.loads(manifest.read_text())["shards"]:
            return process, log
        if time.time() >= deadline:
            process.send_signal(signal.SIGABRT)
            time.sleep(5)
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise AssertionError(f"no shard recorded within 300 s:\n{log.read_text()}")
        time.sleep(0.02)
    raise AssertionError(f"the run ended (code {process.returncode}) before the kill:\n{log.read_text()}")


def test_killed_run_resumes_to_the_same_dataset(sample_dataset, tmp_path):
    out = tmp_path / "killed"
    process, _ = start_run_and_wait_for_first_shard(out)
    os.killpg(process.pid, signal.SIGKILL)  # the driver and its Dask workers, no chance to clean up
    process.wait()
    written = len(list((out / "data").glob("train-*.parquet")))
    assert 0 < written < 8, f"the kill should land mid-run, {written} shards were written"

    resumed = run_ttt("preprocess", *SAMPLE_ARGS, "--dataset", out)
    assert re.search(r"resuming: \d of 8 shards already written", resumed.stderr)
    assert dataset_files(out) == dataset_files(sample_dataset)
    assert not list((out / "data").glob(".*"))  # no partial file survives


def test_ctrl_c_stops_cleanly_and_says_how_to_resume(tmp_path):
    out = tmp_path / "interrupted"
    process, log = start_run_and_wait_for_first_shard(out)
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends to the whole process group
    process.wait(timeout=120)
    output = log.read_text()
    assert process.returncode == 130
    assert "Traceback" not in output
    assert re.search(r"interrupted: \d of 8 shards are written; re-run the same command to resume", output)
    manifest = json.loads((out / "ttt_manifest.json").read_text())
    assert sorted(p.name for p in (out / "data").iterdir()) == sorted(
        s["path"].split("/")[1] for s in manifest["shards"].values()
    )


def scheduler_address(scheduler_file: Path, timeout: float = 60.0) -> str:
    """The address in a Dask scheduler file, once the scheduler has written it whole (it writes in place: a loaded
    machine can show the file empty)."""
    deadline = time.time() + timeout
    while True:
        try:
            return json.loads(scheduler_file.read_text())["address"]
        except (FileNotFoundError, json.JSONDecodeError):
            if time.time() >= deadline:
                raise
            time.sleep(0.2)


def cluster_stacks(processes: list[subprocess.Popen], logs: dict[str, Path]) -> list[str]:
    """Each Dask process's log after SIGABRT, which makes faulthandler print where each of its threads was (the
    workers are the nannies' children); only its last lines, so that a CI report keeps them all."""
    for process in processes:
        for child in psutil.Process(process.pid).children(recursive=True):
            child.send_signal(signal.SIGABRT)
    time.sleep(5)
    return [
        f"{path.name}, its last lines:\n" + "\n".join(path.read_text().splitlines()[-150:]) for path in logs.values()
    ]


def test_existing_dask_cluster_gives_the_same_dataset(sample_dataset, tmp_path):
    scheduler_file = tmp_path / "scheduler.json"
    dask = str(os.path.join(os.path.dirname(TTT), "dask"))
    logs = {name: tmp_path / f"dask-{name}.log" for name in ("scheduler", "worker-1", "worker-2")}

    def start(name: str, *args: str) -> subprocess.Popen:
        with open(logs[name], "w") as log:
            return subprocess.Popen([dask, *args, "--no-dashboard"], stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, **FAULTHANDLER})  # fmt: skip

    processes = [start("scheduler", "scheduler", "--host", "127.0.0.1", "--port", "0", "--scheduler-file",
                       str(scheduler_file))]  # fmt: skip
    try:
        address = scheduler_address(scheduler_file)
        processes += [start(name, "worker", address, "--nthreads", "1", "--host", "127.0.0.1") for name in
                      ("worker-1", "worker-2")]  # fmt: skip
        out = tmp_path / "on-cluster"
        try:
            result = run_ttt("preprocess", *SAMPLE_ARGS, "--dataset", out, "--scheduler", address)
        except AssertionError as failed:  # where the cluster's processes were, then what ttt said
            raise AssertionError("\n".join([*cluster_stacks(processes, logs), str(failed)])) from None
        assert "dask dashboard" in result.stderr
        assert dataset_files(out) == dataset_files(sample_dataset)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)


def test_images_served_at_web_latency_give_the_same_dataset(sample_dataset, tmp_path):
    """Each image 0.3 s late: downloads overlap other shards' encoding, and rows, order and failures stay the same."""
    out = tmp_path / "latency"
    run_ttt("preprocess", *SAMPLE_ARGS, "--sample-latency", "0.3", "--dataset", out)
    assert dataset_files(out) == dataset_files(sample_dataset)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--input", "/nonexistent/part-*.parquet"], "matches no file"),
        (["--vqgan-config", "tests/data/vqgan_gumbel_f8_8192.yaml"], "pass both --vqgan-config and --vqgan-ckpt"),
        (["--sample-rows", "20"], "--sample-rows must be at least"),
        (["--shards", "0"], "--shards must be at least 1"),
        (["--dataset", "hf://models/x/y"], "hf://datasets/ORG/NAME"),
        (["--dry-run"], "needs an hf://datasets/ORG/NAME --dataset"),
        (
            ["--scheduler", "tcp://127.0.0.1:1", "--sample-rows", "100", "--shards", "2"],
            "cannot reach the Dask scheduler",
        ),
    ],
)
def test_user_mistakes_are_one_line(tmp_path, args, message):
    result = run_ttt("preprocess", "--dataset", tmp_path / "out", *args, check=False)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("Error:") and message in last
    assert not (tmp_path / "out" / "data").exists()


def test_missing_columns_are_refused_before_any_work(tmp_path):
    csv = tmp_path / "meta.csv"
    csv.write_text("URL,TEXT\nhttp://x/1,a caption\n")
    result = run_ttt("preprocess", "--input", csv, "--dataset", tmp_path / "out", check=False)
    assert result.returncode == 1
    assert "no column 'WIDTH'" in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()


def test_from_images_reads_an_img2dataset_output(sample_dataset, tmp_path):
    """Images downloaded beforehand by the img2dataset CLI: the same rows survive as with the download stage."""
    served = tmp_path / "served"
    with serve_folder(served, port=18762) as base_url:
        write_sample(served, base_url, num_rows=SAMPLE_ROWS)
        img2dataset = os.path.join(os.path.dirname(TTT), "img2dataset")
        subprocess.run(
            [
                img2dataset,
                "--url_list",
                str(served / "metadata.parquet"),
                "--input_format",
                "parquet",
                "--url_col",
                "URL",
                "--caption_col",
                "TEXT",
                "--output_format",
                "webdataset",
                "--save_additional_columns",
                '["SAMPLE_ID","NSFW","similarity","LICENSE"]',
                "--output_folder",
                str(tmp_path / "images"),
                "--image_size",
                "64",
                "--resize_mode",
                "center_crop",
                "--processes_count",
                "1",
                "--thread_count",
                "8",
                "--enable_wandb",
                "False",
            ],
            check=True,
            capture_output=True,
            env={**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1"},
        )
    out = tmp_path / "out"
    run_ttt("preprocess", "--from-images", tmp_path / "images", "--shards", 2, "--dataset", out)
    ds = datasets.load_dataset(str(out), split="train")
    expected = datasets.load_dataset(str(sample_dataset), split="train")
    assert sorted(ds["key"]) == sorted(expected["key"])
    assert dict(zip(ds["key"], ds["caption"], strict=True)) == dict(
        zip(expected["key"], expected["caption"], strict=True)
    )
    assert "img2dataset output in" in (out / "README.md").read_text()


def test_hub_output_is_staged_locally_and_dry_run_lists_the_upload(tmp_path):
    """No test can reach the Hub: everything up to the network call, with huggingface_hub offline."""
    staged = tmp_path / "staged"
    result = run_ttt(
        "preprocess",
        *SAMPLE_ARGS,
        "--dataset",
        "hf://datasets/my-org/sample-codes",
        "--local-dir",
        staged,
        "--dry-run",
        env={"HF_HUB_OFFLINE": "1", "HF_TOKEN": ""},
    )
    assert (staged / "README.md").is_file() and len(list((staged / "data").glob("*.parquet"))) == 8
    assert 'load_dataset("my-org/sample-codes"' in (staged / "README.md").read_text()
    output = result.stdout + result.stderr
    for name in ["data/train-00000-of-00008.parquet", "README.md", "ttt_manifest.json"]:
        assert f"would send {name}" in output
    assert "dry run: would send 10 files" in output


def test_hub_output_without_token_is_refused_before_any_work(tmp_path):
    result = run_ttt(
        "preprocess",
        "--dataset",
        "hf://datasets/my-org/sample-codes",
        "--local-dir",
        tmp_path / "staged",
        env={"HF_TOKEN": ""},
        check=False,
    )
    assert result.returncode == 1
    assert "HF_TOKEN" in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "staged").exists()


def test_inspect_prints_the_facts_and_decodes_a_grid(sample_dataset, tmp_path):
    out = tmp_path / "grid.png"
    result = run_ttt("inspect", "--dataset", sample_dataset, "--show", 8, "--out-file", out)
    expected_rows = sum(d is None for d in defect_plan(SAMPLE_ROWS, DEFAULT_SEED))
    assert f"{expected_rows} in 8 shards" in result.stdout
    assert "8 x 8, codebook 512" in result.stdout
    # Two rows of four tiles; each tile is the caption's scene and the decoded codes, 64 px each.
    assert Image.open(out).size == (4 * 2 * 64, 2 * (64 + CAPTION_HEIGHT))
    facts = json.loads(run_ttt("inspect", "--dataset", sample_dataset, "--show", 0, "--json").stdout)
    assert (facts["rows"], facts["grid"], facts["codebook_size"]) == (expected_rows, [8, 8], 512)
    assert facts["decoded"] is None
    assert len(facts["shards"]) == 8 and re.fullmatch(r"[0-9a-f]{64}", facts["vqgan"]["ckpt_sha256"])


def test_the_stored_codes_decode_to_what_their_captions_say(sample_dataset):
    """The codes carry the images: decoded with the shipped sample VQGAN, the judge accepts them."""
    captions, blobs = first_rows(sample_dataset, 32)
    codes = torch.from_numpy(np.stack([binary_to_codes(blob, 8, 8) for blob in blobs]))
    images = tensor_to_images(decode(load_vqgan(sample_vqgan_spec()), codes))
    verdicts = [judge(Image.fromarray(image), caption) for image, caption in zip(images, captions, strict=True)]
    assert sum(v.match for v in verdicts) >= 31, [v.reasons for v in verdicts if not v.match]


def test_inspect_refuses_another_vqgan_and_a_folder_that_is_no_dataset(sample_dataset, tmp_path):
    other_ckpt = tmp_path / "other.ckpt"
    other_ckpt.write_bytes(b"not the checkpoint that encoded the dataset")
    result = run_ttt(
        "inspect", "--dataset", sample_dataset, "--vqgan-config", SAMPLE_VQGAN_CONFIG, "--vqgan-ckpt", other_ckpt,
        check=False,
    )  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "the dataset was encoded with model.yaml" in result.stderr.strip().splitlines()[-1]
    result = run_ttt("inspect", "--dataset", tmp_path, check=False)
    assert result.returncode == 1 and "holds no data/*.parquet shards" in result.stderr
