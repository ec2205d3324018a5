"""The DALL-E-like model: a decoder-only transformer over [text tokens ; image codes].

As in the paper ("Training Transformers Together", after Ramesh et al. and Wang's
DALLE-pytorch):

- every layer is causal; image tokens additionally see only what their layer's pattern
  allows: "row" (earlier tokens of the same grid row), "column" (earlier tokens of the same
  column) or, in the last layer, "conv" (the causal part of a k x k neighbourhood); every
  image token sees the whole text. The schedule is row, column, row, row repeated, last
  layer conv;
- the repeating "row, column, row, row" groups share their weights (ALBERT-style: the same
  compute with ~10x fewer parameters), and input and output embeddings are tied;
- reversible residual layers (RevNet coupling) recompute activations in the backward pass
  instead of storing them, so memory does not grow with depth;
- rotary position embeddings: 1-D over the text, 2-D (row, column) over the image grid; and, as DALL-E's learned
  image position embeddings, a learned embedding of the grid cell each position predicts, added to its input (the
  last text token predicts cell 0). Rotary angles only tell a query how far a key is; the cell embedding tells a
  position where in the picture it draws, which is what a caption's "above" or "left of" is about.

The sequence is text[0..T) followed by image[0..N); position i predicts token i + 1, so the
input is the first T + N - 1 tokens. The loss is text cross-entropy (pad ignored) plus
image cross-entropy weighted by `image_loss_weight`, normalised by (1 + weight).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from training.config import PATTERNS, ModelConfig

LayerCache = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # one layer's cached keys, values; the new positions


def build_mask(pattern: str, text_len: int, grid: int, conv_kernel: int) -> torch.Tensor:
    """Boolean [L, L] mask (True = may attend) for the input sequence of T + N - 1 tokens.

    Always causal. Text tokens see all earlier text. The image token at grid cell (r, c) sees
    all text and the earlier image tokens its pattern allows.
    """
    length = text_len + grid * grid - 1
    position = torch.arange(length)
    causal = position[None, :] <= position[:, None]
    image = position - text_len  # image index of each position (negative for text)
    row, column = image.div(grid, rounding_mode="floor"), image.remainder(grid)
    is_image = image >= 0
    if pattern == "row":
        allowed = row[:, None] == row[None, :]
    elif pattern == "column":
        allowed = column[:, None] == column[None, :]
    elif pattern == "conv":
        half = conv_kernel // 2
        allowed = ((row[:, None] - row[None, :]).abs() <= half) & ((column[:, None] - column[None, :]).abs() <= half)
    else:
        raise ValueError(f"unknown attention pattern {pattern!r}")
    image_to_image = is_image[:, None] & is_image[None, :]
    return causal & (~image_to_image | allowed)


def rotary_positions(text_len: int, grid: int) -> torch.Tensor:
    """[L, 2] positions on the two rotary axes: (t, t) for text, (T + row, T + column) for image tokens."""
    text = torch.arange(text_len)
    image = torch.arange(grid * grid - 1)
    text_positions = torch.stack([text, text], dim=1)
    image_positions = torch.stack([text_len + image // grid, text_len + image % grid], dim=1)
    return torch.cat([text_positions, image_positions]).float()


def rotary_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [L, head_dim]: half of each head's dims rotate with the first axis, half with the second."""
    quarter = config.head_dim // 4
    frequencies = config.rotary_base ** (-torch.arange(quarter).float() / quarter)
    positions = rotary_positions(config.text_len, config.grid)
    angles = torch.cat([positions[:, :1] * frequencies, positions[:, 1:] * frequencies], dim=1)  # [L, head_dim/2]
    angles = torch.cat([angles, angles], dim=1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class KVCache:
    """Keys and values of every layer for the positions computed so far, for sampling token by token.

    Each layer keeps the keys of *all* earlier positions; its mask row then picks the ones its
    pattern allows (text + same row, same column, or the conv neighbourhood), so a cached step
    attends to exactly the keys the full forward pass would. The positions not yet computed hold
    zeros, so that a step may attend over the whole cache (its mask row hides them) with shapes
    that do not change from one position to the next.
    """

    def __init__(self, config: ModelConfig, batch: int, device: torch.device, dtype: torch.dtype) -> None:
        shape = (config.layers, batch, config.heads, config.input_len, config.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0  # positions cached


class Attention(nn.Module):
    """Pre-norm multi-head self-attention under a fixed mask, with rotary queries and keys."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = config.heads, config.head_dim
        inner = config.heads * config.head_dim
        self.norm = nn.LayerNorm(config.width)
        self.qkv = nn.Linear(config.width, 3 * inner, bias=False)
        self.out = nn.Linear(inner, config.width)

    def forward(self, x, mask, cos, sin, cache: LayerCache | None = None) -> torch.Tensor:
        """x holds n positions; mask is [n, keys]: without a cache x holds positions [0, n) and keys = n.

        With a cache (this layer's keys, values and the positions of x, a tensor), the new keys and
        values are written at those positions and the queries attend over the cache's first `keys`.
        """
        batch, length, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(batch, length, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is not None:
            keys, values, positions = cache
            keys.index_copy_(2, positions, k), values.index_copy_(2, positions, v)
            k, v = keys[:, :, : mask.shape[1]], values[:, :, : mask.shape[1]]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(batch, length, -1))


class FeedForward(nn.Module):
    """Pre-norm GEGLU feed-forward, as in DALLE-pytorch."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.ff_mult * config.width
        self.norm = nn.LayerNorm(config.width)
        self.up = nn.Linear(config.width, 2 * hidden)
        self.down = nn.Linear(hidden, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.up(self.norm(x)).chunk(2, dim=-1)
        return self.down(value * F.gelu(gate))


class Block(nn.Module):
    """One layer as a reversible coupling of two streams: y1 = x1 + attn(x2), y2 = x2 + ff(y1)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)

    def forward(self, x1, x2, mask, cos, sin, cache=None) -> tuple[torch.Tensor, torch.Tensor]:
        y1 = x1 + self.attention(x2, mask, cos, sin, cache)
        return y1, x2 + self.feed_forward(y1)

    def invert(self, y1, y2, dy1, dy2, mask, cos, sin):
        """Recover the inputs from the outputs and push the gradients through (RevNet's backward).

        Each vector-Jacobian product is the backward of a scalar, (f * dy).sum(): the same bits as f.backward(dy)
        (the sum's gradient is exactly 1), without torch's symbolic-shape checks that a given gradient imports
        (sympy: 25-35 MB and 0.3-0.5 CPU-seconds in every training process)."""
        with torch.enable_grad():
            y1 = y1.detach().requires_grad_()
            ff = self.feed_forward(y1)
            (ff * dy2).sum().backward()
        with torch.no_grad():
            x2 = y2 - ff
            dx1 = dy1 + y1.grad
        with torch.enable_grad():
            x2 = x2.detach().requires_grad_()
            attention = self.attention(x2, mask, cos, sin)
            (attention * dx1).sum().backward()
        with torch.no_grad():
            x1 = y1 - attention
            dx2 = dy2 + x2.grad
        return x1.detach(), x2.detach(), dx1, dx2


class ReversibleLayers(torch.autograd.Function):
    """Runs the layers without keeping activations; the backward recomputes them layer by layer."""

    @staticmethod
    def forward(ctx, x1, x2, layers, masks, cos, sin):
        with torch.no_grad():
            for block, mask in zip(layers, masks, strict=True):
                x1, x2 = block(x1, x2, mask, cos, sin)
        ctx.layers, ctx.masks, ctx.cos, ctx.sin = layers, masks, cos, sin
        ctx.save_for_backward(x1, x2)
        return x1, x2

    @staticmethod
    def backward(ctx, dy1, dy2):
        y1, y2 = ctx.saved_tensors
        for block, mask in zip(reversed(ctx.layers), reversed(ctx.masks), strict=True):
            y1, y2, dy1, dy2 = block.invert(y1, y2, dy1, dy2, mask, ctx.cos, ctx.sin)
        return dy1, dy2, None, None, None, None


class DalleTransformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.text_embedding = nn.Embedding(config.text_vocab_size, config.width)
        self.image_embedding = nn.Embedding(config.codebook_size, config.width)
        self.cell_embedding = nn.Embedding(config.image_tokens, config.width)  # the grid cell a position predicts
        # With sharing, layer i of the repeating group uses blocks[i % 4]; the last (conv) layer has its own.
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.distinct_blocks))
        self.norm = nn.LayerNorm(config.width)
        for pattern in PATTERNS:
            mask = build_mask(pattern, config.text_len, config.grid, config.conv_kernel)
            self.register_buffer(f"mask_{pattern}", mask, persistent=False)
        cos, sin = rotary_tables(config)
        self.register_buffer("rotary_cos", cos, persistent=False)
        self.register_buffer("rotary_sin", sin, persistent=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def layer_blocks(self) -> list[Block]:
        """The block each layer runs (shared blocks appear several times)."""
        if not self.config.share_groups:
            return list(self.blocks)
        last = self.config.layers - 1
        return [self.blocks[i % 4 if i < last else len(self.blocks) - 1] for i in range(self.config.layers)]

    def layer_masks(self) -> list[torch.Tensor]:
        return [getattr(self, f"mask_{pattern}") for pattern in self.config.schedule]

    def hidden_states(self, text: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """[B, T] text ids and [B, N] codes -> final hidden states [B, T + N - 1, width]."""
        x = torch.cat([self.text_embedding(text), self.image_embedding(codes[:, :-1])], dim=1)
        return self.run_layers(x)

    def run_layers(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Embedded inputs [B, n, width] -> final hidden states.

        Without a cache x holds positions [0, n); with one, the n positions after those already
        cached, which are then cached too (sampling feeds the text, then one code at a time).
        """
        start = cache.length if cache is not None else 0
        end = start + x.shape[1]
        hidden = self.run_positions(x, torch.arange(start, end, device=x.device), end, cache)
        if cache is not None:
            cache.length = end
        return hidden

    def run_positions(
        self, x: torch.Tensor, positions: torch.Tensor, keys: int, cache: KVCache | None = None
    ) -> torch.Tensor:
        """Embedded inputs [B, n, width] at `positions` ([n], ascending), attending to positions [0, keys) ->
        final hidden states; with a cache, their keys and values are written at `positions` (`cache.length` is
        the caller's). The positions are a tensor so that a CUDA graph of a sampling step replays at any position.
        """
        x = x + self.predicted_cells(positions)
        masks = [mask[positions, :keys] for mask in self.layer_masks()]
        cos, sin = self.rotary_cos[positions], self.rotary_sin[positions]
        if self.config.reversible and torch.is_grad_enabled() and cache is None:
            x1, x2 = ReversibleLayers.apply(x, x, self.layer_blocks(), masks, cos, sin)
        else:
            x1, x2 = x, x
            for layer, (block, mask) in enumerate(zip(self.layer_blocks(), masks, strict=True)):
                layer_cache = (cache.keys[layer], cache.values[layer], positions) if cache is not None else None
                x1, x2 = block(x1, x2, mask, cos, sin, layer_cache)
        return self.norm((x1 + x2) / 2)

    def predicted_cells(self, positions: torch.Tensor) -> torch.Tensor:
        """[n, width]: for each position, the embedding of the grid cell it predicts (position text_len - 1 + i
        predicts cell i); zeros for the text positions before."""
        cells = positions - (self.config.text_len - 1)
        return self.cell_embedding(cells.clamp(min=0)) * (cells >= 0).unsqueeze(-1)

    def text_logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.text_embedding.weight.T  # tied output embeddings

    def image_logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.image_embedding.weight.T

    def forward(self, text: torch.Tensor, codes: torch.Tensor) -> dict[str, torch.Tensor]:
        """Losses for a batch: {"loss", "text_loss", "image_loss"}."""
        config = self.config
        h = self.hidden_states(text, codes)
        text_logits = self.text_logits(h[:, : config.text_len - 1])
        image_logits = self.image_logits(h[:, config.text_len - 1 :])
        text_target = text[:, 1:].masked_fill(text[:, 1:] == config.pad_id, -100)
        text_loss = F.cross_entropy(text_logits.flatten(0, 1), text_target.flatten(), ignore_index=-100)
        # Every caption empty: nothing to learn from the text (NaN otherwise). A tensor choice, not an `if`, so
        # that a GPU step does not wait for the loss to be read back (and the meta device can run the model).
        text_loss = torch.where(torch.isnan(text_loss), text_logits.sum() * 0.0, text_loss)
        image_loss = F.cross_entropy(image_logits.flatten(0, 1), codes.flatten())
        weight = config.image_loss_weight
        loss = (text_loss + weight * image_loss) / (1 + weight)
        return {"loss": loss, "text_loss": text_loss.detach(), "image_loss": image_loss.detach()}


def parameter_count(config: ModelConfig) -> int:
    """Parameters of a model built from `config`, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return sum(p.numel() for p in DalleTransformer(config).parameters())
