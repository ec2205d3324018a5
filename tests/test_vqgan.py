"""Loading VQGANs the way released checkpoints are loaded: OmegaConf YAML + .ckpt with state_dict."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from pipeline.sample.domain import defect_plan, serve_folder, write_sample
from pipeline.vqgan.codec import (
    SAMPLE_VQGAN_CONFIG,
    VQGANError,
    build_vqgan,
    decode,
    describe_vqgan,
    encode,
    first_stage_config,
    load_vqgan,
)
from tests.support.commands import run_ttt

GUMBEL_F8 = Path(__file__).parent / "data" / "vqgan_gumbel_f8_8192.yaml"
# Loads the sample VQGAN in a fresh process; prints what of Lightning and torchvision that imported, then whether a
# later `import pytorch_lightning` is the real one.
LOAD_WITHOUT_LIGHTNING = """
import sys
from pipeline.vqgan.codec import load_vqgan, sample_vqgan_spec
load_vqgan(sample_vqgan_spec())
print(sorted(name for name in sys.modules if name.startswith(("pytorch_lightning", "torchvision", "taming.main"))))
import pytorch_lightning
print(hasattr(pytorch_lightning, "Trainer"))
"""


def random_checkpoint(config: Path, path: Path, seed: int = 0) -> Path:
    model = first_stage_config(config)
    torch.manual_seed(seed)
    state = build_vqgan(model["target"], model["params"]).state_dict()
    torch.save({"state_dict": state, "global_step": 0}, path)
    return path


@pytest.fixture(scope="module")
def gumbel_ckpt(tmp_path_factory) -> Path:
    return random_checkpoint(GUMBEL_F8, tmp_path_factory.mktemp("gumbel") / "last.ckpt")


def test_released_gumbel_f8_layout_encodes_256px_to_32x32(gumbel_ckpt):
    spec = describe_vqgan(GUMBEL_F8, gumbel_ckpt)
    assert (spec.target, spec.codebook_size, spec.downsample_factor) == ("taming.models.vqgan.GumbelVQ", 8192, 8)
    assert spec.grid_side(256) == 32
    model = load_vqgan(spec)
    images = torch.rand(2, 3, 256, 256) * 2 - 1
    codes = encode(model, images)
    assert codes.shape == (2, 32, 32)
    assert codes.min() >= 0 and codes.max() < 8192
    assert torch.equal(codes, encode(model, images))  # argmax of the logits: no Gumbel noise
    assert decode(model, codes[:1]).shape == (1, 3, 256, 256)


def test_net2net_transformer_config_yields_its_first_stage(tmp_path, gumbel_ckpt):
    first_stage = yaml.safe_load(GUMBEL_F8.read_text())["model"]
    wrapper = {
        "model": {
            "target": "taming.models.cond_transformer.Net2NetTransformer",
            "params": {"first_stage_config": first_stage, "cond_stage_config": "__is_unconditional__"},
        }
    }
    config = tmp_path / "transformer.yaml"
    config.write_text(yaml.safe_dump(wrapper))
    spec = describe_vqgan(config, gumbel_ckpt)
    assert spec.target == "taming.models.vqgan.GumbelVQ" and spec.codebook_size == 8192


def test_mismatched_or_broken_files_are_clear_errors(tmp_path, gumbel_ckpt):
    small = random_checkpoint(SAMPLE_VQGAN_CONFIG, tmp_path / "small.ckpt")
    with pytest.raises(VQGANError, match="does not match"):
        load_vqgan(describe_vqgan(GUMBEL_F8, small))
    (tmp_path / "junk.ckpt").write_bytes(b"junk")
    with pytest.raises(VQGANError, match="cannot load"):
        load_vqgan(describe_vqgan(GUMBEL_F8, tmp_path / "junk.ckpt"))
    (tmp_path / "other.yaml").write_text("model:\n  target: some.Model\n")
    with pytest.raises(VQGANError, match="is not a VQGAN"):
        describe_vqgan(tmp_path / "other.yaml", gumbel_ckpt)
    with pytest.raises(VQGANError, match="does not exist"):
        describe_vqgan(GUMBEL_F8, tmp_path / "missing.ckpt")
    with pytest.raises(VQGANError, match="not a multiple"):
        describe_vqgan(GUMBEL_F8, gumbel_ckpt).grid_side(100)


def test_cli_encodes_csv_metadata_with_a_released_layout_vqgan(tmp_path, gumbel_ckpt):
    """The user's path: CSV metadata, --vqgan-config/--vqgan-ckpt, 256 px -> 1024 codes per row."""
    served = tmp_path / "served"
    with serve_folder(served, port=18761) as base_url:
        write_sample(served, base_url, num_rows=100)
        clean = [i for i, defect in enumerate(defect_plan(100)) if defect is None][:4]
        metadata = pd.read_parquet(served / "metadata.parquet").iloc[clean]
        metadata.to_csv(tmp_path / "meta.csv", index=False)
        out = tmp_path / "out"
        run_ttt(
            "preprocess",
            "--input",
            tmp_path / "meta.csv",
            "--dataset",
            out,
            "--shards",
            1,
            "--workers",
            1,
            "--image-size",
            256,
            "--vqgan-config",
            GUMBEL_F8,
            "--vqgan-ckpt",
            gumbel_ckpt,
        )
    table = pd.read_parquet(out / "data" / "train-00000-of-00001.parquet")
    assert table["key"].tolist() == metadata["SAMPLE_ID"].astype(str).tolist()
    assert {len(code) for code in table["code"]} == {2048}
    codes = np.frombuffer(b"".join(table["code"]), dtype="<i2")
    assert codes.max() < 8192
    card = (out / "README.md").read_text()
    assert "taming.models.vqgan.GumbelVQ" in card and "32 x 32" in card
    assert describe_vqgan(GUMBEL_F8, gumbel_ckpt).identity.ckpt_sha256 in card


def test_cli_refuses_a_mismatched_checkpoint_before_any_work(tmp_path, gumbel_ckpt):
    result = run_ttt(
        "preprocess",
        "--dataset",
        tmp_path / "out",
        "--vqgan-config",
        SAMPLE_VQGAN_CONFIG,
        "--vqgan-ckpt",
        gumbel_ckpt,
        check=False,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: last.ckpt does not match model.yaml") and "wrongly shaped" in last
    assert not (tmp_path / "out").exists()


def test_legacy_pickle_checkpoints_load_too(tmp_path):
    """Checkpoints saved before torch's zip format cannot be memory-mapped; they still load."""
    model = first_stage_config(SAMPLE_VQGAN_CONFIG)
    state = build_vqgan(model["target"], model["params"]).state_dict()
    legacy = tmp_path / "legacy.ckpt"
    torch.save({"state_dict": state}, legacy, _use_new_zipfile_serialization=False)
    loaded = load_vqgan(describe_vqgan(SAMPLE_VQGAN_CONFIG, legacy))
    assert torch.equal(loaded.state_dict()["quantize.embedding.weight"], state["quantize.embedding.weight"])


def test_loading_a_vqgan_imports_neither_lightning_nor_torchvision():
    """taming imports Lightning (for a base class) and its training script (torchvision, Lightning's Trainer): 2.3
    CPU-seconds in every Dask worker and `ttt generate`, measured, for nothing encoding or decoding calls. Stand-ins
    take their place while taming is imported, and only then."""
    result = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_LIGHTNING], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["[]", "True"], result.stdout
