"""Averaging compression: gradients and states with 8 bits per value for tensors of >= 2^16 elements (a scale per
block of 64 values), fp16 for the rest; and DiLoCo's pseudo-gradients in 4 bits or 1 bit.

The paper sends large tensors with hivemind's `Uniform8BitQuantization`: 256 levels over the mean +- 3 standard
deviations of each part, every value beyond that clamped to the extreme levels. Gradients are heavy-tailed: on the
tiny preset and the sample that codec lost a median 14.8% of an averaged gradient's norm, 37% at worst (0.51% and
0.80% with blocks, for 1.2% more bytes; bench/compression.py), and moved the audits' sketch of what a peer sent by up
to 1.07 of its length (0.029 with blocks), more than a reducer's check tolerates (training/audit/received.py).
`Blockwise8Bit` instead scales each block of 64 values by its own largest magnitude: nothing is clamped, and each
value is within half a level (1/254 of its block's largest magnitude) of what was sent.

The codecs (`BlockwiseCodec`), every tensor in blocks of BLOCK values with a bfloat16 scale per block:
    Blockwise8Bit   signed levels -127..127 (1.03 bytes per value)
    Blockwise4Bit   signed levels -7..7 (0.53 bytes per value, 1.9x fewer than 8 bits; Streaming DiLoCo measured no
                    loss from 4-bit outer gradients)
    BlockwiseSign   each value's sign times its block's mean magnitude (0.16 bytes per value, as 1-bit SGD and
                    EF-SignSGD send, with the error kept for the next round: training/swarm/diloco.py)
Each is its own fixed point (a decoded tensor compressed again gives the very same bits), so a sender knows exactly
what it sent. Each refuses a tensor that is not floating point (the 8-bit optimizer's codes: training/optimizer.py).

hivemind's wire format names a codec by an enum of its protobuf, to which no name can be added: the codecs travel
under the names of hivemind codecs ttt never uses, 8 bits under `MEANSTD_16BIT`, 4 bits under `QUANTILE_8BIT`, 1 bit
under `BLOCKWISE_8BIT`, and `register_decoders()` registers their decoders for those names. A hivemind peer without
ttt would misread them; it could not join a ttt run anyway (it neither sends ttt's progress records nor passes
`check_same_settings`), nor can a ttt peer of an older protocol (training/config.py's PROTOCOL).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    SizeAdaptiveCompression,
    serialization,
)
from hivemind.proto import runtime_pb2

from training.config import COMPRESSION_THRESHOLD

BLOCK = 64  # values per scale, in every blockwise codec
EIGHT_BIT_LEVELS = 127  # signed levels -127..127 of the 8-bit codec
FOUR_BIT_LEVELS = 7  # signed levels -7..7 around 0 (a nibble holds level + 8)


def register_decoders() -> None:
    """Make hivemind decode tensors sent under `MEANSTD_16BIT` as `Blockwise8Bit`, under `QUANTILE_8BIT` as
    `Blockwise4Bit` and under `BLOCKWISE_8BIT` as `BlockwiseSign` (idempotent): a peer decodes what any other sends,
    whatever it sends with."""
    serialization._BASE_COMPRESSION_TYPES["MEANSTD_16BIT"] = Blockwise8Bit()
    serialization._BASE_COMPRESSION_TYPES["QUANTILE_8BIT"] = Blockwise4Bit()
    serialization._BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"] = BlockwiseSign()


def averaging_compression() -> CompressionBase:
    """What gradients and states are sent with: 8 bits in blocks for large tensors, fp16 for the rest."""
    register_decoders()
    return SizeAdaptiveCompression(
        threshold=COMPRESSION_THRESHOLD, less=Float16Compression(), greater_equal=Blockwise8Bit()
    )


class BlockwiseCodec(CompressionBase):
    """A tensor in blocks of BLOCK values: the blocks' bfloat16 scales, then each value's code (`encode`), which
    `decode` turns back into a multiple of its block's scale. A non-finite value makes its block's scale non-finite,
    so the decoded block is not finite either and the robust reducer drops the part (training/swarm/aggregation.py)."""

    bytes_per_value: float  # of the codes, the scales left out

    def encode(self, blocks: torch.Tensor, count: int) -> tuple[torch.Tensor, np.ndarray]:
        """The blocks' scales (bfloat16) and their values' codes, packed; `count` values, the rest padding."""
        raise NotImplementedError

    def decode(self, packed: np.ndarray, num_blocks: int) -> torch.Tensor:
        """The codes as multiples of their block's scale, one row per block."""
        raise NotImplementedError

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"{type(self).__name__} does not support {tensor.dtype}: it sends floating-point values")
        values = tensor.detach().to("cpu", torch.float32).flatten()
        blocks = F.pad(values, (0, -values.numel() % BLOCK)).view(-1, BLOCK)
        scales, packed = self.encode(blocks, values.numel())
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=scales.view(torch.int16).numpy().tobytes() + packed.tobytes(),
            size=tensor.shape,
            dtype=str(tensor.dtype).replace("torch.", ""),
            requires_grad=tensor.requires_grad,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        shape = tuple(serialized_tensor.size)
        count = int(np.prod(shape))
        num_blocks = -(-count // BLOCK)
        buffer = serialized_tensor.buffer
        scales = torch.from_numpy(np.frombuffer(buffer, count=num_blocks, dtype=np.int16).copy()).view(torch.bfloat16)
        multiples = self.decode(np.frombuffer(buffer, offset=2 * num_blocks, dtype=np.uint8), num_blocks)
        values = (multiples * scales.float()[:, None]).flatten()[:count]
        return values.reshape(shape).to(getattr(torch, serialized_tensor.dtype))

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        """The codes' bytes alone (over the uncompressed bytes, as hivemind wants it), so that hivemind's parts (2^19
        estimated bytes) hold whole blocks and a sender's parts are quantised exactly as `round_trip` quantises the
        whole tensor."""
        return self.bytes_per_value / info.descriptor.dtype.itemsize


class Blockwise8Bit(BlockwiseCodec):
    """8-bit blockwise quantisation: per block of BLOCK values, round(value / scale) in -127..127 with scale = the
    block's largest magnitude / 127, one signed byte per value."""

    compression_type = runtime_pb2.CompressionType.MEANSTD_16BIT  # the wire name it borrows (see the module's doc)
    bytes_per_value = 1.0

    def encode(self, blocks: torch.Tensor, count: int) -> tuple[torch.Tensor, np.ndarray]:
        scales = (blocks.abs().amax(dim=1) / EIGHT_BIT_LEVELS).to(torch.bfloat16)
        divisors = scales.float().where(scales != 0, torch.ones_like(scales, dtype=torch.float32))
        levels = (blocks / divisors[:, None]).round().clamp(-EIGHT_BIT_LEVELS, EIGHT_BIT_LEVELS)
        return scales, levels.nan_to_num(0).to(torch.int8).numpy()

    def decode(self, packed: np.ndarray, num_blocks: int) -> torch.Tensor:
        return torch.from_numpy(packed.view(np.int8).astype(np.float32)).view(num_blocks, BLOCK)


class Blockwise4Bit(BlockwiseCodec):
    """4-bit blockwise quantisation: per block of BLOCK values, round(value / scale) in -7..7 with scale = the block's
    largest magnitude / 7, rounding to the nearest level, packed two to a byte."""

    compression_type = runtime_pb2.CompressionType.QUANTILE_8BIT  # the wire name it borrows (see the module's doc)
    bytes_per_value = 0.5

    def encode(self, blocks: torch.Tensor, count: int) -> tuple[torch.Tensor, np.ndarray]:
        scales = (blocks.abs().amax(dim=1) / FOUR_BIT_LEVELS).to(torch.bfloat16)
        divisors = scales.float().where(scales != 0, torch.ones_like(scales, dtype=torch.float32))
        levels = (blocks / divisors[:, None]).round().clamp(-FOUR_BIT_LEVELS, FOUR_BIT_LEVELS) + 8
        nibbles = levels.nan_to_num(8).to(torch.uint8).view(-1, 2)
        return scales, ((nibbles[:, 0] << 4) | nibbles[:, 1]).numpy()

    def decode(self, packed: np.ndarray, num_blocks: int) -> torch.Tensor:
        nibbles = torch.from_numpy(packed.copy())
        return torch.stack([nibbles >> 4, nibbles & 15], dim=1).view(num_blocks, BLOCK).float() - 8


class BlockwiseSign(BlockwiseCodec):
    """1-bit blockwise quantisation: each value's sign (0 counts as +), times its block's scale, the block's mean
    magnitude (the scale that loses least, in squares, to signs alone), packed eight to a byte."""

    compression_type = runtime_pb2.CompressionType.BLOCKWISE_8BIT  # the wire name it borrows (see the module's doc)
    bytes_per_value = 0.125

    def encode(self, blocks: torch.Tensor, count: int) -> tuple[torch.Tensor, np.ndarray]:
        counts = torch.full((len(blocks),), float(BLOCK))
        counts[-1:] = count - BLOCK * (len(blocks) - 1)  # the last block's padding is not counted
        scales = (blocks.abs().sum(dim=1) / counts).to(torch.bfloat16)
        return scales, np.packbits((blocks >= 0).numpy())

    def decode(self, packed: np.ndarray, num_blocks: int) -> torch.Tensor:
        return torch.from_numpy(np.unpackbits(packed).astype(np.float32) * 2 - 1).view(num_blocks, BLOCK)


def pseudo_gradient_compression(bits: int) -> CompressionBase:
    """What DiLoCo's pseudo-gradients are sent with: 1 or 4 bits, every tensor (the small ones, under 2^16 values:
    the tiny model's attention weights, norms, biases, too: in fp16 they were 26% of its values but 57% of a round's
    bytes); or with 8 bits, as gradients are sent."""
    register_decoders()
    if bits == 1:
        return BlockwiseSign()
    if bits == 4:
        return Blockwise4Bit()
    return averaging_compression()


@torch.no_grad()
def round_trip(compression: CompressionBase, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as a peer receives it when sent with `compression`."""
    return compression.extract(compression.compress(tensor, CompressionInfo.from_tensor(tensor)))
