"""Stage 4: encode one shard's images into VQGAN codes, batched, on the GPU when there is one."""

from __future__ import annotations

import io
import time
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from pipeline.core.devices import pick_device
from pipeline.preprocess.download import ImageBatch
from pipeline.vqgan.codec import VQGANSpec, cached_vqgan, encode, images_to_tensor


@dataclass(frozen=True)
class EncodeSettings:
    image_size: int
    batch_size: int = 32
    device: str = "auto"
    precision: str = "fp32"
    torch_threads: int = 1


@dataclass
class CodeBatch:
    """A shard's encoded rows: the plan columns of the rows with images, and their code grids."""

    images: ImageBatch
    codes: np.ndarray  # int64 [N, H/f, W/f]
    seconds: float


def decode_jpegs(jpegs: list[bytes], image_size: int) -> np.ndarray:
    """JPEG bytes -> uint8 [N, S, S, 3]; every image must already be S x S (the resize stage's job)."""
    arrays = []
    for data in jpegs:
        with Image.open(io.BytesIO(data)) as image:
            array = np.asarray(image.convert("RGB"))
        if array.shape[:2] != (image_size, image_size):
            raise ValueError(f"image of {array.shape[1]}x{array.shape[0]} reached the encoder; expected {image_size}")
        arrays.append(array)
    return np.stack(arrays) if arrays else np.zeros((0, image_size, image_size, 3), np.uint8)


def encode_shard(images: ImageBatch, spec: VQGANSpec, settings: EncodeSettings) -> CodeBatch:
    """Encode all images of the shard in fixed-size batches (codebook and grid are checked when written)."""
    device = pick_device(settings.device)  # resolved on the worker: the driver may have no GPU
    if device == "cpu":
        torch.set_num_threads(settings.torch_threads)
    model = cached_vqgan(spec, device)  # loaded once per worker, so not part of the stage's time
    start = time.perf_counter()
    side = spec.grid_side(settings.image_size)
    pixels = decode_jpegs(images.jpegs, settings.image_size)
    codes = np.zeros((len(pixels), side, side), dtype=np.int64)
    for begin in range(0, len(pixels), settings.batch_size):
        batch = images_to_tensor(pixels[begin : begin + settings.batch_size])
        codes[begin : begin + len(batch)] = encode(model, batch, settings.precision).numpy()
    return CodeBatch(images=images, codes=codes, seconds=time.perf_counter() - start)
