"""Sampling image codes from the transformer, one code at a time, with a key/value cache.

The prompt's text tokens go through the model once; after that every step feeds only the
newest code, and each layer attends from it to the cached keys its pattern allows (row,
column or conv neighbourhood, always the whole text). Without the cache every step would
recompute the whole prefix: `use_cache=False` does exactly that and is the reference the
tests and `bench/generate.py` compare against. On CUDA the cached step is replayed as a CUDA
graph (`CachedStep`).

Each step's logits are divided by the temperature, then cut to the top k and to the smallest
set whose probability reaches top p (the paper found top-k 256 or top-p 0.75 much better
than plain sampling); temperature 0 takes the most likely code.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from inference.settings import SamplingSettings
from training.model import DalleTransformer, KVCache


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set every logit outside the top k, or outside the nucleus of probability top_p, to -inf.

    The nucleus is the smallest set of the most likely codes whose probabilities sum to at
    least top_p; the most likely code always stays. Codes tied with the k-th are kept.
    """
    if 0 < top_k < logits.shape[-1]:
        kth_largest = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probabilities = sorted_logits.softmax(dim=-1)
        mass_before = probabilities.cumsum(dim=-1) - probabilities
        outside_sorted = mass_before >= top_p
        outside = torch.zeros_like(outside_sorted).scatter(-1, order, outside_sorted)
        logits = logits.masked_fill(outside, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, settings: SamplingSettings, generator: torch.Generator) -> torch.Tensor:
    """[B, V] logits -> [B] codes."""
    logits = logits.float()
    if settings.temperature == 0:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits / settings.temperature, settings.top_k, settings.top_p)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(1)


# Sampling runs attention at a new key length every step. cuDNN's attention, which PyTorch may pick first on
# recent GPUs, builds and caches a plan per shape; the others handle any length as it comes.
VARYING_LENGTH_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sampling_attention(device: torch.device) -> AbstractContextManager:
    """Where sampling runs: on CUDA, attention without cuDNN's per-shape plans."""
    return sdpa_kernel(VARYING_LENGTH_ATTENTION) if device.type == "cuda" else nullcontext()


class CachedStep:
    """The step sampling repeats after the text: the newest code in (at its position), the next code's logits out,
    its keys and values written to the cache.

    Its shapes are the same at every position (the position is a tensor, and on CUDA the step attends over the
    whole cache, whose mask row hides what is not written yet), so on CUDA it is recorded once as a CUDA graph and
    replayed: a step of the small preset launches ~470 kernels, and launching them one by one took the host
    6.7 ms against 1.4 ms of GPU work (H200, batch 1; bench/generate.py --step-profile). On a CPU it runs as it
    is, attending only over the positions written so far.
    """

    def __init__(self, model: DalleTransformer, cache: KVCache) -> None:
        self.model, self.cache = model, cache
        device = cache.keys.device
        self.code = torch.zeros(cache.keys.shape[1], 1, dtype=torch.long, device=device)
        self.position = torch.full((1,), model.config.text_len, dtype=torch.long, device=device)  # the first code's
        self.graph = self.record() if device.type == "cuda" else None

    def run(self, keys: int) -> torch.Tensor:
        """The step itself, attending over the cache's first `keys` positions."""
        hidden = self.model.run_positions(self.model.image_embedding(self.code), self.position, keys, self.cache)
        return self.model.image_logits(hidden[:, -1])

    def record(self) -> torch.cuda.CUDAGraph:
        """The step's kernels recorded once, after the warm-up runs on a side stream that CUDA graphs need (they
        write the first code's cache slot, which the first real step overwrites)."""
        keys = self.model.config.input_len
        side = torch.cuda.Stream(self.code.device)
        side.wait_stream(torch.cuda.current_stream(self.code.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.run(keys)
        torch.cuda.current_stream(self.code.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self.run(keys)
        return graph

    def __call__(self, code: torch.Tensor, position: int) -> torch.Tensor:
        """Logits [B, codebook] of the code after `code` ([B, 1], at `position`); valid until the next call."""
        self.code.copy_(code)
        self.position.fill_(position)
        if self.graph is None:
            return self.run(keys=position + 1)
        self.graph.replay()
        return self.logits


def recomputed_logits(model: DalleTransformer, text: torch.Tensor, codes: torch.Tensor, position: int) -> torch.Tensor:
    """Logits for code `position` from the whole prefix (text and codes [0, position)): a step without the cache."""
    return model.image_logits(model.hidden_states(text, codes[:, : position + 1])[:, -1])


@torch.no_grad()
def sample_codes(
    model: DalleTransformer,
    text: torch.Tensor,
    settings: SamplingSettings,
    generator: torch.Generator,
    use_cache: bool = True,
    on_code: Callable[[], None] | None = None,
) -> torch.Tensor:
    """[B, T] text ids -> [B, grid * grid] codes in raster order. `on_code` is called after each position."""
    with sampling_attention(text.device):
        return sample_in_raster_order(model, text, settings, generator, use_cache, on_code)


def sample_in_raster_order(
    model: DalleTransformer,
    text: torch.Tensor,
    settings: SamplingSettings,
    generator: torch.Generator,
    use_cache: bool,
    on_code: Callable[[], None] | None,
) -> torch.Tensor:
    """`sample_codes`' loop, inside the attention backends it chose."""
    config = model.config
    batch, device = text.shape[0], text.device
    codes = torch.zeros(batch, config.image_tokens, dtype=torch.long, device=device)
    if use_cache:
        cache = KVCache(config, batch, device, next(model.parameters()).dtype)
        logits = model.image_logits(model.run_layers(model.text_embedding(text), cache)[:, -1])
        step = CachedStep(model, cache)
    for position in range(config.image_tokens):
        if not use_cache:
            logits = recomputed_logits(model, text, codes, position)
        codes[:, position] = sample_next(logits, settings, generator)
        if use_cache and position + 1 < config.image_tokens:
            logits = step(codes[:, position : position + 1], config.text_len + position)
        if on_code is not None:
            on_code()
    return codes
