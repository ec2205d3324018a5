"""The DALL-E-like model: attention patterns, sharing, reversible layers, rotary positions, loss."""

import pytest
import torch

from training.calc.memory import architecture_of, describe_model
from training.config import PRESETS, ModelConfig
from training.model import (
    DalleTransformer,
    build_mask,
    parameter_count,
    rotary_positions,
)

SMALL = dict(width=32, heads=2, head_dim=16, text_len=6, grid=4, codebook_size=16, layers=6)


def allowed_by_definition(pattern: str, text_len: int, grid: int, kernel: int, query: int, key: int) -> bool:
    """The DALL-E patterns stated position by position, independently of build_mask's vectorised form."""
    if key > query:
        return False  # never the future
    if query < text_len or key < text_len:
        return True  # text is causal; image tokens see all earlier text
    (qr, qc), (kr, kc) = divmod(query - text_len, grid), divmod(key - text_len, grid)
    if pattern == "row":
        return qr == kr
    if pattern == "column":
        return qc == kc
    return abs(qr - kr) <= kernel // 2 and abs(qc - kc) <= kernel // 2


@pytest.mark.parametrize("pattern", ["row", "column", "conv"])
@pytest.mark.parametrize("text_len, grid, kernel", [(5, 4, 3), (3, 6, 5), (8, 8, 11)])
def test_each_mask_allows_exactly_the_pattern(pattern, text_len, grid, kernel):
    mask = build_mask(pattern, text_len, grid, kernel)
    length = text_len + grid * grid - 1
    assert mask.shape == (length, length)
    for query in range(length):
        for key in range(length):
            assert mask[query, key].item() == allowed_by_definition(pattern, text_len, grid, kernel, query, key)
    assert not torch.triu(mask, diagonal=1).any()  # exactly causal


def test_the_paper_schedule_and_sharing():
    config = PRESETS["ttt-1.1b"].model
    assert config.schedule[:8] == ["row", "column", "row", "row"] * 2 and config.schedule[-1] == "conv"
    assert len(config.schedule) == 64
    with torch.device("meta"):
        model = DalleTransformer(config)
    blocks = model.layer_blocks()
    assert len(model.blocks) == 5 and len(blocks) == 64
    assert all(blocks[i] is blocks[i % 4] for i in range(63)) and blocks[63] is model.blocks[4]


def test_the_memory_calculator_knows_every_parameter_tensor():
    paper = PRESETS["ttt-1.1b"].model
    unshared = ModelConfig(**{**paper.to_dict(), "share_groups": False})
    for config in [*(preset.model for preset in PRESETS.values()), unshared]:
        with torch.device("meta"):
            shapes = sorted(tuple(p.shape) for p in DalleTransformer(config).parameters())
        assert shapes == sorted(architecture_of("", config).parameter_tensors())
    # ~1.1 B without sharing, as the paper says; sharing the row/column/row/row groups leaves 5 distinct layers.
    assert 1.05e9 < parameter_count(unshared) < 1.15e9
    assert parameter_count(unshared) / parameter_count(paper) > 8
    assert "93.7 M parameters (1,084.4 M without sharing" in describe_model(paper)


def test_reversible_layers_give_the_gradients_of_plain_ones():
    torch.manual_seed(0)
    model = DalleTransformer(ModelConfig(**SMALL)).double()
    text, codes = torch.randint(0, 257, (3, 6)), torch.randint(0, 16, (3, 16))
    gradients = []
    for reversible in (True, False):
        model.config.reversible = reversible
        model.zero_grad()
        loss = model(text, codes)["loss"]
        loss.backward()
        gradients.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in gradients[0]:
        torch.testing.assert_close(gradients[0][name], gradients[1][name], rtol=1e-9, atol=1e-12)


def test_rotary_positions_are_1d_for_text_and_2d_for_the_grid():
    positions = rotary_positions(text_len=3, grid=2)
    assert positions.tolist() == [[0, 0], [1, 1], [2, 2], [3, 3], [3, 4], [4, 3]]


def test_pad_tokens_are_ignored_by_the_text_loss():
    torch.manual_seed(0)
    model = DalleTransformer(ModelConfig(**SMALL)).eval()
    codes = torch.randint(0, 16, (1, 16))
    padded = torch.tensor([[97, 98, 256, 256, 256, 256]])
    other_pad_run = model(padded, codes)["text_loss"]
    # Only the first target (98) counts: the loss equals the cross-entropy of that one prediction.
    with torch.no_grad():
        h = model.hidden_states(padded, codes)
        logits = h[:, :1] @ model.text_embedding.weight.T
    expected = torch.nn.functional.cross_entropy(logits[0], torch.tensor([98]))
    torch.testing.assert_close(other_pad_run, expected)


def test_the_loss_goes_down_when_fitting_a_batch():
    torch.manual_seed(0)
    model = DalleTransformer(ModelConfig(**SMALL))
    text, codes = torch.randint(0, 256, (4, 6)), torch.randint(0, 16, (4, 16))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = model(text, codes)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
