"""The paper's optimizer pieces on their own: 8-bit LAMB with clipping, the linear schedule, averaging compression."""

import numpy as np
import pytest
import torch
from hivemind.compression import CompressionInfo, deserialize_torch_tensor, serialization, serialize_torch_tensor
from hivemind.proto.runtime_pb2 import CompressionType

from training.optimizer import ClippedLAMB8bit, linear_schedule
from training.swarm.compression import COMPRESSION_THRESHOLD, Uniform8BitDecodingFixed, averaging_compression


def test_clipped_lamb_clips_the_global_gradient_norm_then_steps():
    torch.manual_seed(0)
    # Large enough for bitsandbytes to keep 8-bit state (tensors under 4096 elements keep 32-bit state).
    weights = [torch.nn.Parameter(torch.randn(64, 80)), torch.nn.Parameter(torch.randn(80))]
    before = [w.detach().clone() for w in weights]
    optimizer = ClippedLAMB8bit(weights, lr=1e-2, max_grad_norm=1.0)
    for weight in weights:
        weight.grad = torch.randn_like(weight) * 100
    optimizer.step()
    clipped_norm = torch.linalg.vector_norm(torch.cat([w.grad.flatten() for w in weights]))
    assert clipped_norm == pytest.approx(1.0, rel=1e-4)  # clipped over all parameters together, in place
    assert all(not torch.equal(w, b) for w, b in zip(weights, before, strict=True))
    assert optimizer.state[weights[0]]["state1"].dtype == torch.uint8  # the 8-bit statistics


def test_a_small_gradient_is_not_clipped():
    weight = torch.nn.Parameter(torch.zeros(4096))
    optimizer = ClippedLAMB8bit([weight], lr=1e-3, max_grad_norm=1.0)
    weight.grad = torch.full_like(weight, 0.001)
    gradient = weight.grad.clone()
    optimizer.step()
    assert torch.equal(weight.grad, gradient)


def test_linear_schedule_warms_up_over_a_tenth_then_decays_to_zero():
    factor = linear_schedule(100)
    assert [factor(step) for step in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert [factor(step) for step in (10, 55, 100, 150)] == pytest.approx([1.0, 0.5, 0.0, 0.0])
    assert linear_schedule(5)(0) == 1.0  # a schedule shorter than 10 steps warms up in one


def test_large_tensors_travel_as_8_bit_and_small_ones_as_fp16():
    compression = averaging_compression()
    torch.manual_seed(0)
    large, small = torch.randn(COMPRESSION_THRESHOLD), torch.randn(COMPRESSION_THRESHOLD - 1)
    sent = {name: compression.compress(t, CompressionInfo.from_tensor(t)) for name, t in (("l", large), ("s", small))}
    assert sent["l"].compression == CompressionType.UNIFORM_8BIT and sent["s"].compression == CompressionType.FLOAT16
    assert len(sent["l"].buffer) < large.numel() * 1.1 and len(sent["s"].buffer) == small.numel() * 2
    received = {name: deserialize_torch_tensor(message) for name, message in sent.items()}
    assert torch.allclose(received["s"], small, atol=1e-2)
    # 8-bit quantisation to 256 levels: each value lands near its bucket's mean.
    assert (received["l"] - large).abs().mean() < 0.05 and received["l"].shape == large.shape


def test_the_fixed_8bit_decoder_reads_what_hivemind_sends_under_this_numpy():
    """hivemind 1.1.12's own decoder calls int() on a one-element array, which numpy >= 2.4 refuses."""
    averaging_compression()  # registers the fixed decoder
    assert isinstance(serialization._BASE_COMPRESSION_TYPES["UNIFORM_8BIT"], Uniform8BitDecodingFixed)
    tensor = torch.linspace(-3, 3, 70_000)
    message = serialize_torch_tensor(tensor, CompressionType.UNIFORM_8BIT)
    decoded = deserialize_torch_tensor(message)
    assert decoded.dtype == tensor.dtype and (decoded - tensor).abs().max() < 0.1
    if tuple(map(int, np.__version__.split(".")[:2])) >= (2, 4):
        from hivemind.compression.quantization import Uniform8BitQuantization

        with pytest.raises(TypeError):
            Uniform8BitQuantization().extract(message)
