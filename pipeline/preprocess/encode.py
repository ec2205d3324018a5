"""Stage 4: encode one shard's images into VQGAN codes, batched, on the GPU when there is one."""

from __future__ import annotations

import contextlib
import io
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

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


@contextlib.contextmanager
def one_encoder_per_gpu(device: str) -> Iterator[None]:
    """On a GPU, hold a machine-wide lock for that GPU while encoding, and give the cached memory back after.

    Every Dask worker process loads its own VQGAN, and a LocalCluster has one worker per core: on an H100
    with 16 workers encoding batches of 32 at 256 px at once (~7.6 GiB per process, CUDA context and cached
    blocks included) ran the 80 GB GPU out of memory. One batch of 32 already keeps the GPU busy, so taking
    turns costs little.
    """
    if not device.startswith("cuda"):
        yield
        return
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, only the cache release
        fcntl = None
    properties = torch.cuda.get_device_properties(torch.device(device))
    gpu = str(getattr(properties, "uuid", "")) or device.replace(":", "")  # the same GPU whatever its local index
    with open(Path(tempfile.gettempdir()) / f"ttt-encode-{gpu}.lock", "a") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            torch.cuda.empty_cache()  # before the next worker's turn: cached blocks are invisible to other processes
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_UN)


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
    with one_encoder_per_gpu(device):
        for begin in range(0, len(pixels), settings.batch_size):
            batch = images_to_tensor(pixels[begin : begin + settings.batch_size])
            codes[begin : begin + len(batch)] = encode(model, batch, settings.precision).numpy()
    return CodeBatch(images=images, codes=codes, seconds=time.perf_counter() - start)
