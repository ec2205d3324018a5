"""The shipped sample VQGAN and `ttt vqgan train`."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.sample import domain as sample
from pipeline.sample.judge import judge, parse_caption
from pipeline.vqgan.codec import (
    SAMPLE_VQGAN_CKPT,
    SAMPLE_VQGAN_CONFIG,
    SAMPLE_VQGAN_DIR,
    build_vqgan,
    check_checkpoint,
    decode,
    describe_vqgan,
    encode,
    first_stage_config,
    images_to_tensor,
    load_vqgan,
    sample_vqgan_spec,
    tensor_to_images,
)
from pipeline.vqgan.train import SampleImages, codebook_statistics, evaluate
from tests.support.commands import run_ttt

SHORT_RUN = ["--steps", 12, "--batch-size", 8, "--heldout", 24, "--threads", 2]


def test_the_shipped_vqgan_is_a_small_released_layout_checkpoint():
    assert SAMPLE_VQGAN_CKPT.stat().st_size < 10_000_000
    spec = sample_vqgan_spec()
    assert spec.target == "taming.models.vqgan.VQModel" and spec.downsample_factor == 8
    assert spec.codebook_size == 512 and spec.grid_side(64) == 8
    check_checkpoint(spec)
    assert set(torch.load(SAMPLE_VQGAN_CKPT, map_location="cpu", weights_only=True)) >= {"state_dict"}


def test_the_shipped_card_reports_the_measured_quality():
    metrics = json.loads((SAMPLE_VQGAN_DIR / "metrics.json").read_text())
    heldout = metrics["heldout"]
    assert heldout["judged_correct"] >= 0.95 and heldout["images"] >= 400
    card = (SAMPLE_VQGAN_DIR / "README.md").read_text()
    assert f"{heldout['psnr_db']:.2f} dB" in card and f"{heldout['judged_correct']:.1%}" in card
    assert f"{heldout['codes_used']} of 512 codes used" in card
    assert "no LPIPS perceptual loss" in card


def fixed_scenes() -> list[sample.Scene]:
    """Two of each kind: one shape, each relation; every colour and shape appears."""
    s = sample.Shape
    return [
        sample.Scene(s("red", "circle")),
        sample.Scene(s("white", "triangle")),
        sample.Scene(s("green", "square"), s("purple", "triangle"), "above"),
        sample.Scene(s("yellow", "triangle"), s("blue", "circle"), "below"),
        sample.Scene(s("blue", "square"), s("red", "square"), "left of"),
        sample.Scene(s("purple", "circle"), s("yellow", "square"), "right of"),
        sample.Scene(s("white", "circle"), s("green", "triangle"), "left of"),
        sample.Scene(s("red", "triangle"), s("white", "square"), "above"),
    ]


def test_encode_decode_round_trip_shows_the_caption():
    model = load_vqgan(sample_vqgan_spec())
    scenes = fixed_scenes()
    images = np.stack([np.asarray(sample.render_stored(scene, 96 + 9 * i, 64)) for i, scene in enumerate(scenes)])
    codes = encode(model, images_to_tensor(images))
    assert codes.shape == (len(scenes), 8, 8)
    reconstructions = tensor_to_images(decode(model, codes))
    for scene, image, original in zip(scenes, reconstructions, images, strict=True):
        verdict = judge(Image.fromarray(image), scene.caption)
        assert verdict.match, (scene.caption, verdict.reasons)
        assert np.abs(image.astype(int) - original.astype(int)).mean() < 6  # of 255


def test_heldout_layouts_are_a_tenth_and_a_layout_said_two_ways_is_one_layout():
    s = sample.Shape
    above = sample.Scene(s("red", "circle"), s("blue", "square"), "above")
    below = sample.Scene(s("blue", "square"), s("red", "circle"), "below")
    assert sample.is_heldout_layout(above) == sample.is_heldout_layout(below)
    rng = np.random.default_rng(0)
    share = np.mean([sample.is_heldout_layout(sample.random_scene(rng)) for _ in range(4000)])
    assert 0.05 < share < 0.15
    _, captions = SampleImages(64, seed=0).heldout_set(20)
    assert all(sample.is_heldout_layout(parse_caption(caption)) for caption in captions)


def test_codebook_statistics():
    used, perplexity = codebook_statistics(torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]), 16)
    assert used == 4 and perplexity == pytest.approx(4.0)
    used, perplexity = codebook_statistics(torch.tensor([5] * 10), 16)
    assert used == 1 and perplexity == pytest.approx(1.0)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("vqgan") / "run"
    result = run_ttt("vqgan", "train", "--out", out, *SHORT_RUN)
    return out, result


def test_a_short_run_lowers_the_loss_and_writes_a_loadable_checkpoint(short_run):
    out, result = short_run
    assert "judged correct" in result.stdout and "Traceback" not in result.stderr
    spec = describe_vqgan(out / "configs" / "model.yaml", out / "checkpoints" / "last.ckpt")
    trained = load_vqgan(spec)
    config = first_stage_config(SAMPLE_VQGAN_CONFIG)
    torch.manual_seed(0)  # the initialisation the run started from
    untrained = build_vqgan(config["target"], config["params"])
    images, captions = SampleImages(64, seed=0).heldout_set(24)
    assert evaluate(trained, images, captions).l1 < 0.7 * evaluate(untrained, images, captions).l1
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["training"]["steps"] == 12 and metrics["heldout"]["images"] == 24
    assert (out / "README.md").read_text().startswith("---\nlicense: mit")


def test_the_same_seed_gives_the_same_weights(short_run, tmp_path):
    out, _ = short_run
    run_ttt("vqgan", "train", "--out", tmp_path / "again", *SHORT_RUN)
    first = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    second = torch.load(tmp_path / "again" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_an_existing_checkpoint_is_kept_unless_overwrite(short_run):
    out, _ = short_run
    before = (out / "checkpoints" / "last.ckpt").read_bytes()
    result = run_ttt("vqgan", "train", "--out", out, *SHORT_RUN, check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "exists; pass --overwrite" in result.stderr.strip().splitlines()[-1]
    assert (out / "checkpoints" / "last.ckpt").read_bytes() == before


def test_training_on_a_folder_of_images(tmp_path):
    folder = tmp_path / "mine" / "nested"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(3)
    for index in range(20):
        sample.render_scene(sample.random_scene(rng), 80, 100).save(folder / f"{index}.png")
    (folder / "broken.jpg").write_bytes(b"not an image")
    result = run_ttt("vqgan", "train", "--images", tmp_path / "mine", "--out", tmp_path / "out", *SHORT_RUN)
    assert "skipped 1 unreadable image(s)" in result.stdout + result.stderr
    heldout = json.loads((tmp_path / "out" / "metrics.json").read_text())["heldout"]
    assert heldout["images"] == 2 and heldout["judged_correct"] is None


def test_bad_inputs_are_one_line_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    gumbel = "tests/data/vqgan_gumbel_f8_8192.yaml"
    cases = [
        (["--images", tmp_path / "empty"], "holds no images"),
        (["--config", gumbel], "only taming.models.vqgan.VQModel can be trained"),
        (["--steps", 0], "Invalid value for '--steps'"),
    ]
    for args, message in cases:
        result = run_ttt("vqgan", "train", "--out", tmp_path / "out", *args, check=False)
        assert result.returncode != 0 and "Traceback" not in result.stderr, args
        assert message in result.stderr, (args, result.stderr)
    assert not (tmp_path / "out").exists()
