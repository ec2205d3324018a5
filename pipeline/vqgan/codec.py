"""Load a taming-transformers VQGAN the ecosystem's way, and turn images into codes and back.

A released VQGAN is an OmegaConf YAML whose `model.target` is
`taming.models.vqgan.VQModel` or `taming.models.vqgan.GumbelVQ` (or a
`Net2NetTransformer` whose `first_stage_config` is one of those), plus a `.ckpt`
holding `state_dict`. The loss module (LPIPS, discriminator) is never needed to
encode or decode, so it is replaced by an identity and its weights are ignored.

The embedded sample's VQGAN is a small VQModel of the same f=8 family, trained on the sample
domain by `ttt vqgan train` and shipped in the released layout (assets/sample_vqgan/).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import sys
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.core.errors import UserError
from pipeline.core.files import sha256_file
from pipeline.core.shard_format import MAX_CODEBOOK_SIZE, VQGANIdentity

# The released layout: a folder holding the architecture and the weights.
RELEASE_CONFIG = Path("configs/model.yaml")
RELEASE_CKPT = Path("checkpoints/last.ckpt")
SAMPLE_VQGAN_DIR = Path(__file__).parent / "assets" / "sample_vqgan"
SAMPLE_VQGAN_CONFIG = SAMPLE_VQGAN_DIR / RELEASE_CONFIG
SAMPLE_VQGAN_CKPT = SAMPLE_VQGAN_DIR / RELEASE_CKPT
SUPPORTED_TARGETS = ("taming.models.vqgan.VQModel", "taming.models.vqgan.GumbelVQ")
FIRST_STAGE_HOLDERS = ("taming.models.cond_transformer.Net2NetTransformer",)


class VQGANError(UserError):
    """The VQGAN config or checkpoint is unusable: reported as one line."""


@dataclass(frozen=True)
class VQGANSpec:
    """Everything the driver knows about a VQGAN without building it."""

    config_path: Path
    ckpt_path: Path
    target: str
    params: dict
    codebook_size: int
    downsample_factor: int
    identity: VQGANIdentity

    def grid_side(self, image_size: int) -> int:
        if image_size % self.downsample_factor:
            raise VQGANError(
                f"--image-size {image_size} is not a multiple of the VQGAN's downsampling factor "
                f"{self.downsample_factor}"
            )
        return image_size // self.downsample_factor


def import_taming() -> types.ModuleType:
    """Import taming.models.vqgan without what only taming's own training script needs.

    taming.models.vqgan imports pytorch_lightning, for the LightningModule its VQGANs derive from, and taming.main,
    for `instantiate_from_config` (taming.main is taming's training script: it imports torchvision and Lightning's
    Trainer). Encoding and decoding call neither: together they cost every process that loads a VQGAN (each Dask
    worker, `ttt generate`) 2.3 CPU-seconds. While taming.models.vqgan is imported, a stand-in of one name holds the
    place of each (`taming_stand_ins`); both leave sys.modules afterwards, so a later `import pytorch_lightning` gets
    the real one. The VQGANs then derive from torch.nn.Module, all of LightningModule that ttt uses: its training
    steps and `self.log` are Lightning's and never called (`ttt vqgan train` has its own loop).
    """
    if "taming.models.vqgan" in sys.modules:
        return sys.modules["taming.models.vqgan"]
    stand_ins = {key: module for key, module in taming_stand_ins().items() if key not in sys.modules}
    sys.modules.update(stand_ins)
    try:
        return importlib.import_module("taming.models.vqgan")
    finally:
        for key in stand_ins:
            del sys.modules[key]


def taming_stand_ins() -> dict[str, types.ModuleType]:
    """What taming.models.vqgan takes from pytorch_lightning and taming.main, and nothing else."""
    lightning = types.ModuleType("pytorch_lightning")
    lightning.LightningModule = torch.nn.Module
    script = types.ModuleType("taming.main")
    script.instantiate_from_config = instantiate_from_config
    return {"pytorch_lightning": lightning, "taming.main": script}


def instantiate_from_config(config: dict) -> object:
    """taming.main's: build `config["target"]` (a dotted class name) with `config["params"]`."""
    module, name = config["target"].rsplit(".", 1)
    return getattr(importlib.import_module(module), name)(**config.get("params", {}))


def first_stage_config(config_path: Path) -> dict:
    """The VQGAN part of a released config, as a plain dict with `target` and `params`."""
    from omegaconf import OmegaConf

    try:
        config = OmegaConf.to_container(OmegaConf.load(config_path), resolve=True)
    except Exception as err:  # OmegaConf raises many YAML/IO error types
        raise VQGANError(f"cannot read VQGAN config {config_path}: {err}") from None
    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model, dict) or "target" not in model:
        raise VQGANError(f"{config_path} has no model.target; expected a taming-transformers VQGAN config")
    if model["target"] in FIRST_STAGE_HOLDERS:
        model = model.get("params", {}).get("first_stage_config", {})
    if model.get("target") not in SUPPORTED_TARGETS:
        raise VQGANError(
            f"{config_path}: model.target {model.get('target')!r} is not a VQGAN "
            f"(expected one of {', '.join(SUPPORTED_TARGETS + FIRST_STAGE_HOLDERS)})"
        )
    return model


def describe_vqgan(config_path: str | Path, ckpt_path: str | Path) -> VQGANSpec:
    """Read a VQGAN's facts (codebook size, factor, identity) and check the files before any work."""
    config_path, ckpt_path = Path(config_path).resolve(), Path(ckpt_path).resolve()
    for path, flag in ((config_path, "--vqgan-config"), (ckpt_path, "--vqgan-ckpt")):
        if not path.is_file():
            raise VQGANError(f"{flag} {path} does not exist")
    model = first_stage_config(config_path)
    params = model.get("params", {})
    try:
        codebook_size = int(params["n_embed"])
        factor = 2 ** (len(params["ddconfig"]["ch_mult"]) - 1)
    except (KeyError, TypeError):
        raise VQGANError(f"{config_path}: params need n_embed and ddconfig.ch_mult") from None
    if codebook_size > MAX_CODEBOOK_SIZE:
        raise VQGANError(f"codebook of {codebook_size} codes does not fit the int16 code format")
    identity = VQGANIdentity(
        target=model["target"],
        config_name=config_path.name,
        config_sha256=sha256_file(config_path),
        ckpt_sha256=sha256_file(ckpt_path),
    )
    return VQGANSpec(config_path, ckpt_path, model["target"], params, codebook_size, factor, identity)


def build_vqgan(target: str, params: dict) -> torch.nn.Module:
    """Instantiate the VQGAN class named by the config, without its training loss."""
    vqgan_module = import_taming()
    cls = getattr(vqgan_module, target.rsplit(".", 1)[1])
    with contextlib.redirect_stdout(io.StringIO()):  # taming prints the latent shape on every build
        return cls(**{**params, "lossconfig": {"target": "torch.nn.Identity"}, "ckpt_path": None})


def read_state_dict(spec: VQGANSpec) -> dict[str, torch.Tensor]:
    """The checkpoint's `state_dict` without the loss module's weights (memory-mapped where possible)."""
    # Only the zip format (torch >= 1.6) can be memory-mapped; older released checkpoints are legacy pickles.
    mmap = zipfile.is_zipfile(spec.ckpt_path)
    try:
        checkpoint = torch.load(spec.ckpt_path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as err:  # torch.load raises pickle, zip and IO errors alike
        raise VQGANError(f"cannot load VQGAN checkpoint {spec.ckpt_path}: {err}") from None
    state = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise VQGANError(f"{spec.ckpt_path} holds no state_dict")
    return {k: v for k, v in state.items() if not k.startswith("loss.")}


def check_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor], spec: VQGANSpec) -> None:
    """Refuse a checkpoint whose tensor names or shapes differ from what the config builds."""
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong_shape = [n for n in expected if n in state and tuple(state[n].shape) != expected[n]]
    if missing or unexpected or wrong_shape:
        example = (
            f"{wrong_shape[0]} is {tuple(state[wrong_shape[0]].shape)} in the checkpoint, "
            f"{expected[wrong_shape[0]]} in the config"
            if wrong_shape
            else f"e.g. missing {missing[:2]}, unexpected {unexpected[:2]}"
        )
        raise VQGANError(
            f"{spec.ckpt_path.name} does not match {spec.config_path.name}: {len(missing)} missing, "
            f"{len(unexpected)} unexpected, {len(wrong_shape)} wrongly shaped tensors ({example})"
        )


def check_checkpoint(spec: VQGANSpec) -> None:
    """Check the checkpoint against the config before any work starts, without allocating the model."""
    with torch.device("meta"):
        model = build_vqgan(spec.target, spec.params)
    check_state_dict(model, read_state_dict(spec), spec)


def check_same_vqgan(spec: VQGANSpec, encoder: VQGANIdentity, subject: str) -> None:
    """Refuse to decode with another VQGAN than the one that made the codes (by checkpoint sha256), naming both.

    `subject` says what holds the codes, e.g. "the dataset was encoded with"."""
    if spec.identity.ckpt_sha256 != encoder.ckpt_sha256:
        raise VQGANError(
            f"{subject} {encoder.config_name} (checkpoint sha256 {encoder.ckpt_sha256[:12]}...), but the VQGAN "
            f"{spec.config_path.name} has sha256 {spec.identity.ckpt_sha256[:12]}...; pass the VQGAN that made "
            "the codes (--vqgan-config/--vqgan-ckpt)"
        )


def load_vqgan(spec: VQGANSpec, device: str | torch.device = "cpu") -> torch.nn.Module:
    """Build the model and load `state_dict` from the checkpoint; refuse a checkpoint that does not fit."""
    model = build_vqgan(spec.target, spec.params)
    state = read_state_dict(spec)
    check_state_dict(model, state, spec)
    model.load_state_dict(state)
    return model.eval().requires_grad_(False).to(device)


_LOADED: dict[tuple[VQGANIdentity, str], torch.nn.Module] = {}


def cached_vqgan(spec: VQGANSpec, device: str) -> torch.nn.Module:
    """One loaded model per worker process and device (Dask calls the encode task many times)."""
    key = (spec.identity, device)
    if key not in _LOADED:
        _LOADED[key] = load_vqgan(spec, device)
    return _LOADED[key]


def images_to_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> float [B, 3, H, W] in [-1, 1], the VQGAN's input range."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def tensor_to_images(images: torch.Tensor) -> np.ndarray:
    """float [B, 3, H, W] in [-1, 1] -> uint8 [B, H, W, 3], the inverse of images_to_tensor."""
    return ((images.permute(0, 2, 3, 1).float().cpu().numpy() + 1.0) * 127.5).round().clip(0, 255).astype(np.uint8)


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@torch.no_grad()
def encode(model: torch.nn.Module, images: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
    """Images [B, 3, H, W] in [-1, 1] -> code indices [B, H/f, W/f].

    GumbelVQ's quantizer samples Gumbel noise even in eval mode; encoding takes the
    argmax of its logits instead, so codes are deterministic. With bf16/fp16 only the
    convolutional encoder runs in reduced precision (autocast); the codebook lookup stays fp32.
    """
    device = next(model.parameters()).device
    images = images.to(device)
    with torch.autocast(device.type, dtype=PRECISIONS[precision], enabled=precision != "fp32"):
        h = model.quant_conv(model.encoder(images))
    h = h.float()
    if hasattr(model.quantize, "proj"):  # GumbelQuantize
        indices = model.quantize.proj(h).argmax(dim=1)
    else:  # VectorQuantizer2: nearest codebook entry
        _, _, (_, _, indices) = model.quantize(h)
        indices = indices.reshape(h.shape[0], h.shape[2], h.shape[3])
    return indices.long().cpu()


@torch.no_grad()
def decode(model: torch.nn.Module, codes: torch.Tensor) -> torch.Tensor:
    """Code indices [B, h, w] -> images [B, 3, H, W] in [-1, 1]."""
    codes = codes.to(next(model.parameters()).device)
    batch, height, width = codes.shape
    embedding_dim = model.quant_conv.out_channels
    quant = model.quantize.get_codebook_entry(codes.reshape(-1), (batch, height, width, embedding_dim))
    return model.decode(quant).clamp(-1.0, 1.0).cpu()


def vqgan_from_flags(config_path: str | Path | None, ckpt_path: str | Path | None) -> VQGANSpec:
    """The VQGAN a command's --vqgan-config/--vqgan-ckpt name, or the embedded sample's when neither is given."""
    if bool(config_path) != bool(ckpt_path):
        raise VQGANError("pass both --vqgan-config and --vqgan-ckpt, or neither (the sample VQGAN)")
    return describe_vqgan(config_path, ckpt_path) if config_path else sample_vqgan_spec()


def sample_vqgan_spec() -> VQGANSpec:
    """The embedded sample's trained VQGAN (see assets/sample_vqgan/README.md), loaded like a released one."""
    return describe_vqgan(SAMPLE_VQGAN_CONFIG, SAMPLE_VQGAN_CKPT)
