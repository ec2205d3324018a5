"""The paper's averaging compression: 8-bit quantisation for tensors of >= 2^16 elements, fp16 for the rest.

hivemind 1.1.12's 8-bit decoder calls `int()` on a one-element numpy array, which numpy >= 2.4
refuses: every 8-bit part a peer receives then fails to decode and the round silently averages
only part of the gradient. `fixed_8bit_decoding()` registers a decoder that reads the codebook
size as a scalar; the bytes on the wire are unchanged, so patched and unpatched peers interoperate.
"""

from __future__ import annotations

import numpy as np
import torch
from hivemind.compression import (
    CompressionBase,
    Float16Compression,
    SizeAdaptiveCompression,
    Uniform8BitQuantization,
    serialization,
)
from hivemind.proto import runtime_pb2

from training.config import COMPRESSION_THRESHOLD


class Uniform8BitDecodingFixed(Uniform8BitQuantization):
    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        codebook_size = int(np.frombuffer(serialized_tensor.buffer, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(serialized_tensor.buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
        quantized = np.frombuffer(serialized_tensor.buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        # astype/copy: the received buffer is read-only, which torch warns about when it wraps it
        quantized = torch.from_numpy(quantized.astype(np.int64)).reshape(tuple(serialized_tensor.size))
        codebook = torch.from_numpy(codebook.copy()).to(dtype=getattr(torch, serialized_tensor.dtype))
        return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)


def fixed_8bit_decoding() -> None:
    """Make hivemind decode received 8-bit tensors with the numpy-2.4-safe decoder (idempotent)."""
    serialization._BASE_COMPRESSION_TYPES["UNIFORM_8BIT"] = Uniform8BitDecodingFixed()


def averaging_compression() -> CompressionBase:
    """What gradients and state are sent with, as in the paper."""
    fixed_8bit_decoding()
    return SizeAdaptiveCompression(
        threshold=COMPRESSION_THRESHOLD, less=Float16Compression(), greater_equal=Uniform8BitDecodingFixed()
    )
