"""The paper's optimizer pieces on their own: LAMB with 8-bit state and clipping, the optimizer table, the linear
schedule, averaging compression."""

import io
import subprocess
import sys

import pytest
import torch
from hivemind.compression import CompressionInfo, deserialize_torch_tensor, serialize_torch_tensor
from hivemind.optim.state_averager import dump_optimizer_state, load_optimizer_state
from hivemind.proto.runtime_pb2 import CompressionType
from hivemind.utils import MSGPackSerializer, nested_flatten

from training.config import MIN_8BIT_SIZE, OPTIMIZER_STATES, OPTIMIZERS
from training.optimizer import LAMB, linear_schedule, make_optimizer
from training.swarm.compression import BLOCK, COMPRESSION_THRESHOLD, Blockwise8Bit, averaging_compression


def mlp() -> torch.nn.Module:
    """A small model whose two matrices (8,192 values) keep 8-bit state and whose vectors keep 32-bit state."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 32), torch.nn.LayerNorm(32)
    )


def regression_gradients(model: torch.nn.Module, step: int) -> list[torch.Tensor]:
    """The gradients of a fixed regression task at the model's parameters, for batch number `step`."""
    generator = torch.Generator().manual_seed(step)
    inputs, targets = torch.randn(64, 32, generator=generator), torch.randn(64, 32, generator=generator)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    return [p.grad.clone() for p in model.parameters()]


@torch.no_grad()
def reference_lamb_step(params, grads, state: dict, lr: float, weight_decay: float, max_grad_norm: float) -> list:
    """Plain fp32 LAMB, written out: clip, m and v with bias correction, u = m_hat / (sqrt(v_hat) + eps) + wd * w
    (matrices only), then w -= lr * clamp(||w||, 0, 10) / ||u|| * u (ratio 1 when a norm is 0). Returns each
    tensor's trust ratio."""
    total_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    grads = [g * min(1.0, max_grad_norm / (total_norm.item() + 1e-6)) for g in grads]  # torch's clip_grad_norm_
    state["t"] = t = state.get("t", 0) + 1
    ratios = []
    for i, (w, g) in enumerate(zip(params, grads, strict=True)):
        m, v = state.setdefault(i, (torch.zeros_like(w), torch.zeros_like(w)))
        m.mul_(0.9).add_(0.1 * g)
        v.mul_(0.999).add_(0.001 * g * g)
        u = (m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + 1e-6) + (weight_decay * w if w.ndim > 1 else 0)
        w_norm, u_norm = w.norm(), u.norm()
        ratio = (w_norm.clamp(0, 10) / u_norm).item() if w_norm > 0 and u_norm > 0 else 1.0
        w.sub_(lr * ratio * u)
        ratios.append(ratio)
    return ratios


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().flatten() for t in tensors])


def test_lamb_8bit_follows_a_plain_fp32_lamb_over_20_steps():
    reference, model = mlp(), mlp()
    optimizer = LAMB(model.parameters(), lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)
    assert optimizer.state[model[0].weight]["exp_avg_codes"].dtype == torch.uint8  # the 8-bit path is tested
    assert optimizer.state[model[0].bias]["exp_avg"].dtype == torch.float32
    state = {}
    for step in range(20):
        grads = regression_gradients(reference, step)
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g.clone()
        before_reference, before = flat(reference.parameters()), flat(model.parameters())
        ratios = reference_lamb_step(list(reference.parameters()), grads, state, 1e-2, 0.01, 1.0)
        optimizer.step()
        for p, expected in zip(model.parameters(), ratios, strict=True):
            assert optimizer.trust_ratios[p].item() == pytest.approx(expected, rel=0.01), step
        update_reference, update = flat(reference.parameters()) - before_reference, flat(model.parameters()) - before
        assert torch.nn.functional.cosine_similarity(update, update_reference, dim=0) >= 0.99, step


def test_the_update_of_a_tensor_follows_the_trust_ratio_not_adams_step():
    """lr * min(||w||, 10) per step: 0.003 here, where Adam's first step moves it by lr * sqrt(n) = 0.256 (what
    bitsandbytes' LAMB8bit, the optimizer before this one, did)."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(256, 256))
    with torch.no_grad():
        weight.mul_(3 / weight.norm())
    optimizer = LAMB([weight], lr=1e-3, weight_decay=0.0)
    for _ in range(3):
        before = weight.detach().clone()
        weight.grad = torch.randn_like(weight) * 1e-3
        optimizer.step()
        assert (weight.detach() - before).norm().item() == pytest.approx(1e-3 * before.norm().item(), rel=1e-3)


def test_large_norms_are_clamped_at_10_in_the_trust_ratio():
    weight = torch.nn.Parameter(torch.full((64, 64), 1.0))  # ||w|| = 64
    optimizer = LAMB([weight], lr=1e-3, weight_decay=0.0)
    weight.grad = torch.randn_like(weight)
    optimizer.step()
    assert (weight.detach() - 1.0).norm().item() == pytest.approx(1e-3 * 10, rel=1e-3)


def test_zero_weights_take_the_plain_update_and_zero_updates_leave_the_tensor_alone():
    zero_weight = torch.nn.Parameter(torch.zeros(64, 64))
    no_update = torch.nn.Parameter(torch.randn(64, 64))
    kept = no_update.detach().clone()
    optimizer = LAMB([{"params": [zero_weight]}, {"params": [no_update], "weight_decay": 0.0}], lr=1e-3)
    zero_weight.grad, no_update.grad = torch.randn(64, 64), torch.zeros(64, 64)  # no_update: u = 0
    optimizer.step()
    assert optimizer.trust_ratios[zero_weight].item() == 1.0 and optimizer.trust_ratios[no_update].item() == 1.0
    # u = m_hat / (sqrt(v_hat) + eps) = g / (|g| + eps) ~ sign(g) at the first step: the update is lr * u, Adam's.
    assert zero_weight.detach().abs().mean().item() == pytest.approx(1e-3, rel=0.01)
    assert torch.equal(no_update.detach(), kept)


def test_weight_decay_shrinks_matrices_only():
    """With a zero gradient u = wd * w: the trust ratio makes the step lr * w whatever wd is; vectors (biases,
    norm weights) are not decayed."""
    matrix, vector = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8))
    before_matrix, before_vector = matrix.detach().clone(), vector.detach().clone()
    optimizer = LAMB([matrix, vector], lr=0.1, weight_decay=0.01)
    matrix.grad, vector.grad = torch.zeros(8, 8), torch.zeros(8)
    optimizer.step()
    torch.testing.assert_close(matrix.detach(), 0.9 * before_matrix)
    assert torch.equal(vector.detach(), before_vector)


def test_lamb_clips_the_global_gradient_norm_then_steps():
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(64, 80)), torch.nn.Parameter(torch.randn(80))]
    before = [w.detach().clone() for w in weights]
    optimizer = LAMB(weights, lr=1e-2, max_grad_norm=1.0)
    for weight in weights:
        weight.grad = torch.randn_like(weight) * 100
    optimizer.step()
    clipped_norm = torch.linalg.vector_norm(torch.cat([w.grad.flatten() for w in weights]))
    assert clipped_norm == pytest.approx(1.0, rel=1e-4)  # clipped over all parameters together, in place
    assert all(not torch.equal(w, b) for w, b in zip(weights, before, strict=True))


def test_a_small_gradient_is_not_clipped():
    weight = torch.nn.Parameter(torch.zeros(4096))
    optimizer = LAMB([weight], lr=1e-3, max_grad_norm=1.0)
    weight.grad = torch.full_like(weight, 0.001)
    gradient = weight.grad.clone()
    optimizer.step()
    assert torch.equal(weight.grad, gradient)


def run(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        for p, g in zip(model.parameters(), regression_gradients(model, step), strict=True):
            p.grad = g
        optimizer.step()


def test_a_saved_state_resumes_bit_for_bit():
    model = mlp()
    optimizer = LAMB(model.parameters(), lr=1e-2)
    run(model, optimizer, range(10))
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, saved)
    run(model, optimizer, range(10, 20))

    resumed_model = mlp()
    resumed = LAMB(resumed_model.parameters(), lr=1e-2)
    saved.seek(0)
    checkpoint = torch.load(saved)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed.load_state_dict(checkpoint["optimizer"])
    assert resumed.state[resumed_model[0].weight]["exp_avg_codes"].dtype == torch.uint8  # not cast to float32
    run(resumed_model, resumed, range(10, 20))
    assert torch.equal(flat(model.parameters()), flat(resumed_model.parameters()))
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        for key, value in optimizer.state[p].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(resumed.state[q][key])), key


def test_a_state_of_the_other_precision_is_refused():
    model = mlp()
    state = LAMB(model.parameters(), lr=1e-2, eight_bit=False).state_dict()
    with pytest.raises(ValueError, match="exp_avg"):
        LAMB(model.parameters(), lr=1e-2).load_state_dict(state)


def test_the_8bit_state_survives_hivemind_state_download():
    """A newcomer's download: dump_optimizer_state, each tensor sent as hivemind sends state (no compression by
    default), the metadata through msgpack, then load_optimizer_state into a fresh optimizer."""
    model = mlp()
    optimizer = LAMB(model.parameters(), lr=1e-2)
    run(model, optimizer, range(5))
    metadata, tensors = dump_optimizer_state(optimizer)
    assert {t.dtype for t in tensors} == {torch.uint8, torch.float32}
    received = [deserialize_torch_tensor(serialize_torch_tensor(t, CompressionType.NONE)) for t in tensors]
    metadata = MSGPackSerializer.loads(MSGPackSerializer.dumps(metadata))

    newcomer_model = mlp()
    newcomer_model.load_state_dict(model.state_dict())
    newcomer = LAMB(newcomer_model.parameters(), lr=1e-2)
    load_optimizer_state(newcomer, metadata, received)
    run(model, optimizer, range(5, 10))
    run(newcomer_model, newcomer, range(5, 10))
    assert torch.equal(flat(model.parameters()), flat(newcomer_model.parameters()))


def test_ttts_averaging_compression_refuses_the_8bit_codes():
    """Why the codes must be neither averaged nor downloaded with ttt's averaging compression (see LAMB)."""
    weight = torch.nn.Parameter(torch.randn(COMPRESSION_THRESHOLD))
    codes = LAMB([weight], lr=1e-3).state[weight]["exp_avg_codes"]
    for tensor in (codes, codes[:MIN_8BIT_SIZE]):  # 8-bit quantisation for the large, fp16 for the small
        with pytest.raises(ValueError, match="does not support torch.uint8"):
            averaging_compression().compress(tensor, CompressionInfo.from_tensor(tensor))


def test_the_state_exists_before_the_first_step_so_hivemind_runs_no_zero_gradient_step():
    """hivemind's TrainingStateAverager steps an optimizer with zero gradients (at the full learning rate) when its
    state dict holds no tensors; with weight decay, LAMB's trust ratio would turn that into w -= lr * w."""
    optimizer = LAMB(mlp().parameters(), lr=1e-2)
    assert any(isinstance(x, torch.Tensor) for x in nested_flatten(optimizer.state_dict()))


def test_8bit_state_takes_about_2_bytes_per_value_and_the_table_counts_it():
    tensors = [torch.randn(300), torch.randn(MIN_8BIT_SIZE - 1), torch.randn(64, 64), torch.randn(100, 1000)]
    for name, spec in OPTIMIZER_STATES.items():
        params = [torch.nn.Parameter(t.clone()) for t in tensors]
        optimizer = make_optimizer(name, params, lr=1e-3)
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
        for p in params:
            measured = sum(v.numel() * v.element_size() for k, v in optimizer.state[p].items()
                           if isinstance(v, torch.Tensor) and not k.startswith("qmap"))  # fmt: skip
            assert measured == spec.state_bytes(p.numel()), (name, p.shape)
    assert OPTIMIZER_STATES["lamb-8bit"].state_bytes(100 * 1000) / (100 * 1000) < 2.04
    assert OPTIMIZER_STATES["lamb"].bytes_per_value == 8


def test_every_optimizer_of_the_table_clips_and_spares_vectors_from_weight_decay():
    for name in OPTIMIZERS:
        matrix, vector = torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64))
        optimizer = make_optimizer(name, [matrix, vector], lr=1e-3, weight_decay=0.1, max_grad_norm=1.0)
        matrix.grad, vector.grad = torch.randn(64, 64) * 100, torch.zeros(64)
        kept = vector.detach().clone()
        optimizer.step()
        assert torch.linalg.vector_norm(matrix.grad).item() == pytest.approx(1.0, rel=1e-4), name
        assert torch.equal(vector.detach(), kept), name


def test_linear_schedule_warms_up_over_a_tenth_then_decays_to_zero():
    factor = linear_schedule(100)
    assert [factor(step) for step in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert [factor(step) for step in (10, 55, 100, 150)] == pytest.approx([1.0, 0.5, 0.0, 0.0])
    assert linear_schedule(5)(0) == 1.0  # a schedule shorter than 10 steps warms up in one


def test_large_tensors_travel_as_8_bit_blocks_and_small_ones_as_fp16():
    compression = averaging_compression()
    torch.manual_seed(0)
    large, small = torch.randn(COMPRESSION_THRESHOLD), torch.randn(COMPRESSION_THRESHOLD - 1)
    large[::1000] *= 50  # a heavy tail, as gradients have: the paper's codec clamped these at 3 standard deviations
    sent = {name: compression.compress(t, CompressionInfo.from_tensor(t)) for name, t in (("l", large), ("s", small))}
    assert sent["l"].compression == Blockwise8Bit.compression_type and sent["s"].compression == CompressionType.FLOAT16
    assert len(sent["l"].buffer) == large.numel() * (1 + 2 / BLOCK) and len(sent["s"].buffer) == small.numel() * 2
    received = {name: deserialize_torch_tensor(message) for name, message in sent.items()}
    assert torch.allclose(received["s"], small, atol=1e-2)
    # Each value within half a level of its block's largest magnitude / 127 (the bfloat16 scale adds 2^-9 of it).
    largest = large.view(-1, BLOCK).abs().amax(dim=1, keepdim=True)
    assert ((received["l"] - large).view(-1, BLOCK).abs() <= largest * (0.5 / 127 + 2**-8)).all()
    assert float((received["l"] - large).norm() / large.norm()) < 0.02 and received["l"].shape == large.shape
    again = compression.compress(received["l"], CompressionInfo.from_tensor(large))
    assert torch.equal(deserialize_torch_tensor(again), received["l"])  # its own fixed point


# A peer's modules, then the model's and the default optimizer's life in a run: a batch's forward and reversible
# backward, then the optimizer made, stepped, saved, loaded, zeroed.
PEER_WITHOUT_COMPILER = """
import sys
import torch
import training.peer.join, training.peer.loop, training.peer.setup
from training.config import ModelConfig
from training.model import DalleTransformer
from training.optimizer import make_optimizer
config = ModelConfig()
model = DalleTransformer(config)
text = torch.randint(0, config.pad_id, (2, config.text_len))
model(text, torch.randint(0, config.codebook_size, (2, config.grid**2)))["loss"].backward()
optimizer = make_optimizer("lamb-8bit", model.parameters(), lr=1e-3, weight_decay=0.01, max_grad_norm=1.0)
optimizer.step()
optimizer.load_state_dict(optimizer.state_dict())
optimizer.zero_grad()
print(sorted(name for name in sys.modules if name.startswith(("torch._dynamo", "torch._inductor", "sympy"))))
"""


def test_a_peer_never_imports_torchs_compiler_or_sympy():
    """bitsandbytes and torch's optimizers would import the compiler (2.1 CPU-seconds and 116 MB in every peer,
    measured); a backward given its gradient, torch's symbolic shapes and sympy (0.3-0.5 CPU-seconds and 25-35 MB)."""
    result = subprocess.run([sys.executable, "-c", PEER_WITHOUT_COMPILER], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
