"""The paper's local optimizer and schedule: 8-bit LAMB with gradient clipping, linear warm-up and decay.

hivemind runs this optimizer on CPU copies of the parameters (`offload_optimizer=True`), on
the gradients averaged over the swarm, so clipping here clips the global batch's gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import bitsandbytes as bnb
import torch


def register_cuda_lamb_8bit() -> None:
    """Let bitsandbytes' CUDA backend run LAMB8bit's 8-bit tensors as its CPU backend does.

    bitsandbytes 0.50 updates every 8-bit state blockwise; its CPU backend runs the name "lamb" with the
    Adam update (`name2optimizer_id["lamb"] = ADAM`), but its CUDA backend's table of blockwise kernels has
    no "lamb" entry, so the first step on a GPU raised `ValueError: Unsupported optimizer name: lamb`
    (seen on an H100). The Adam kernels are what the CPU path computes, so both devices now agree.
    """
    if not torch.cuda.is_available():
        return
    try:
        from bitsandbytes.backends.cuda import ops as cuda_ops
    except Exception:  # a bitsandbytes without this backend layout (or without its CUDA library)
        return
    kernels = getattr(cuda_ops, "str2optimizer8bit_blockwise", None)
    if isinstance(kernels, dict) and "lamb" not in kernels and "adam" in kernels:
        kernels["lamb"] = kernels["adam"]


class ClippedLAMB8bit(bnb.optim.LAMB8bit):
    """bitsandbytes' 8-bit LAMB whose step first clips the global gradient norm to `max_grad_norm`."""

    def __init__(self, params: Iterable, lr: float, weight_decay: float = 0.01, max_grad_norm: float = 1.0) -> None:
        register_cuda_lamb_8bit()
        super().__init__(params, lr=lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=weight_decay)
        self.max_grad_norm = max_grad_norm

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(grads, self.max_grad_norm)
        return super().step(closure)


def linear_schedule(total_steps: int, warmup_fraction: float = 0.1) -> Callable[[int], float]:
    """The paper's schedule as a LambdaLR factor: linear warm-up over the first 10%, then linear decay to 0."""
    warmup = max(1, int(total_steps * warmup_fraction))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return factor
