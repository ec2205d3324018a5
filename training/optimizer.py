"""The paper's local optimizer and schedule: LAMB with 8-bit state and gradient clipping, linear warm-up and decay.

hivemind runs this optimizer on CPU copies of the parameters (`offload_optimizer=True`), on the gradients
averaged over the swarm, so clipping here clips the global batch's gradient.

bitsandbytes 0.50's `LAMB8bit` is Adam in disguise: its blockwise 8-bit path has no trust ratio (its CPU
backend maps "lamb" to the Adam update, its CUDA backend has no "lamb" kernel). So `LAMB` below computes
LAMB itself and takes only bitsandbytes' blockwise quantisation (`quantize_blockwise` /
`dequantize_blockwise`, which run on CPU and CUDA tensors) for storing the two moments in 8 bits.

`FACTORIES` builds each choice of `--optimizer`; what their state costs is training/config.py's `OPTIMIZER_STATES`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from training.config import BLOCK_SIZE, MIN_8BIT_SIZE

# torch's optimizer methods that import torch's compiler when first called (torch/optim/optimizer.py:699, 899,
# 1047, 1126, `torch._disable_dynamo`)
OPTIMIZER_METHODS = ("state_dict", "load_state_dict", "zero_grad", "add_param_group")


def import_without_torchs_compiler() -> None:
    """Import bitsandbytes, and ready torch's optimizers, without importing torch's compiler (dynamo, inductor).

    ttt never compiles, yet three things would import the compiler into every `ttt train`, `ttt monitor` and
    `ttt demo` process. Measured on the 2-core machine, a peer's modules imported and one step of the 8-bit LAMB
    took 4.5 CPU-seconds and left 463 MB private with it, 2.4 CPU-seconds and 347 MB without:

    - bitsandbytes 0.50 passes four of its default kernels (pure torch, for devices without kernels of their own)
      to `torch.compile` as it is imported (backends/default/ops.py, `_try_torch_compile`): while it is imported,
      `torch.compile` hands the function back, which `_try_torch_compile` then calls as it is, as it does where
      compilation fails;
    - its kernels are registered through wrappers made with `torch._disable_dynamo` (torch/_library/
      custom_ops.py:498), which import dynamo at their first call: while bitsandbytes is imported,
      `torch._disable_dynamo` hands the function back;
    - torch's `Optimizer` methods in OPTIMIZER_METHODS are such wrappers, made when torch was imported; each keeps
      what to call in its function's `__dynamo_disable` after the first call, set here to the function itself.

    Those wrappers only keep dynamo from tracing into the functions, which matters only in a compiled model. What
    changes: bitsandbytes' default kernels run uncompiled (ttt calls its blockwise quantisation, which has CPU and
    CUDA kernels of its own; Adam8bit on CPU, `--optimizer adam-8bit`, uses a default kernel)."""
    for name in OPTIMIZER_METHODS:
        function = getattr(torch.optim.Optimizer, name).__wrapped__
        setattr(function, "__dynamo_disable", function)
    compile_, disable_dynamo = torch.compile, torch._disable_dynamo
    torch.compile = lambda model=None, **options: model if model is not None else (lambda function: function)
    torch._disable_dynamo = lambda fn=None, recursive=True: fn if fn is not None else (lambda function: function)
    try:
        import bitsandbytes  # noqa: F401
    finally:
        torch.compile, torch._disable_dynamo = compile_, disable_dynamo


import_without_torchs_compiler()
import bitsandbytes as bnb  # noqa: E402
import bitsandbytes.functional as bnbf  # noqa: E402

MAX_TRUST_NORM = 10.0  # phi(x) = clamp(x, 0, 10): the weight norm in LAMB's trust ratio is capped here
FP32_MOMENTS = ("exp_avg", "exp_avg_sq")

_MAPS: dict[tuple[bool, torch.device], torch.Tensor] = {}


def dynamic_map(signed: bool, device: torch.device) -> torch.Tensor:
    """bitsandbytes' 256-value dynamic quantisation map on `device`: signed for the first moment, unsigned for
    the second (v >= 0, so all 256 codes go to its magnitudes: finer steps and a wider range than a signed map)."""
    key = (signed, torch.device(device))
    if key not in _MAPS:
        _MAPS[key] = bnbf.create_dynamic_map(signed=signed).to(device)
    return _MAPS[key]


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """A float32 copy of a moment stored as uint8 codes with one float32 absmax per block of BLOCK_SIZE values."""
    qmap = dynamic_map(signed, codes.device)
    return bnbf.dequantize_blockwise(codes, absmax=absmax, code=qmap, blocksize=BLOCK_SIZE)


def quantize_into(values: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> None:
    """Store float32 `values` in place into `codes` and `absmax` (in place: the state tensors keep their storage)."""
    qmap = dynamic_map(signed, values.device)
    new_codes, quant_state = bnbf.quantize_blockwise(values, code=qmap, blocksize=BLOCK_SIZE)
    codes.copy_(new_codes)
    absmax.copy_(quant_state.absmax)


def clip_gradients(param_groups: list[dict], max_grad_norm: float | None) -> None:
    """Clip the gradients of all the groups' parameters together to a global norm of `max_grad_norm` (None:
    leave them)."""
    if max_grad_norm is None:
        return
    grads = [p for group in param_groups for p in group["params"] if p.grad is not None]
    if grads:
        torch.nn.utils.clip_grad_norm_(grads, max_grad_norm)


def trust_ratio(weight: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """LAMB's per-tensor ratio phi(||w||) / ||u|| with phi(x) = clamp(x, 0, MAX_TRUST_NORM); 1 where either norm
    is 0. A 0-d tensor on the weight's device (no host sync, so it also runs as queued GPU work)."""
    weight_norm = torch.linalg.vector_norm(weight.float())
    update_norm = torch.linalg.vector_norm(update)
    ratio = weight_norm.clamp(0.0, MAX_TRUST_NORM) / update_norm
    return torch.where((weight_norm > 0) & (update_norm > 0), ratio, torch.ones_like(ratio))


class LAMB(torch.optim.Optimizer):
    """LAMB (You et al., 2020) with its two moments in blockwise 8 bits (Dettmers et al., 2021), clipping first.

    For every parameter tensor w with gradient g (after clipping all gradients to a global norm of
    `max_grad_norm`):

        m <- beta1 m + (1 - beta1) g            v <- beta2 v + (1 - beta2) g^2   (t: the tensor's steps)
        u  = m_hat / (sqrt(v_hat) + eps) + lambda w,  m_hat = m / (1 - beta1^t), v_hat = v / (1 - beta2^t)
                                                 (lambda: decoupled weight decay; 0 for tensors with ndim <= 1,
                                                  i.e. biases and norm weights, unless the group has
                                                  decay_vectors=True)
        w <- w - lr * phi(||w||) / ||u|| * u     phi(x) = clamp(x, 0, 10); the ratio is 1 where a norm is 0

    so every tensor moves by lr * min(||w||, 10) per step whatever its gradient's scale: the trust ratio, which
    Adam (and bitsandbytes' `LAMB8bit`) lacks.

    Bias correction (m / (1 - beta1^t), v / (1 - beta2^t), as the LAMB paper's algorithm; the original project's
    CPU LAMB had none) is on by default, by measurement (bench/optimizer.py: tiny preset on the sample, batch 64,
    30 steps of the paper's schedule, fp32 LAMB): final loss 4.590 with it and 5.146 without at lr 3e-2, the best
    rate with it; the best without, 4.955 at lr 1e-1, is still 8% worse (at 40 steps: 3.902 against 4.454 at
    3e-2). The trust ratio removes any scalar factor of u, so the correction acts only through eps (and the
    weight of weight decay): without it, sqrt(v) of the many small gradient values (a median |g| of ~3e-5 in the
    attention's qkv weights) is sqrt(1 - beta2^t) ~ 0.03-0.2 times |g| in the first hundreds of steps, the size of
    eps = 1e-6, and u turns from Adam's normalised step into m / eps for those values. After a few thousand
    steps both agree.

    State. With `eight_bit` (and for tensors of >= MIN_8BIT_SIZE values) m and v are uint8 codes of
    bitsandbytes' dynamic map (signed for m, unsigned for v) with a float32 absmax per block of BLOCK_SIZE values:
    `exp_avg_codes`, `exp_avg_absmax`, `exp_avg_sq_codes`, `exp_avg_sq_absmax`, 2 + 8/256 bytes per value.
    Otherwise they are float32 `exp_avg`, `exp_avg_sq`. `step` counts the steps. Each step dequantises a
    tensor's moments to float32, updates them and quantises them back, as bitsandbytes' CPU backend does for
    its own 8-bit Adam. The state is allocated when the optimizer is made, so `state_dict()` has the same
    structure before and after the first step (hivemind packs a downloaded state into the receiver's structure)
    and hivemind does not run its zero-gradient "initialisation" step, which with weight decay would move every
    matrix by lr * ||w||.

    Averaging. The codes are indices into a nonlinear map, scaled by each peer's own absmax per block: their mean
    is no meaningful moment (the mean of two peers' codes decodes to neither peer's m or v, nor their mean), and
    hivemind treats them as plain numbers: in ttt's setup (offloaded optimizer, so hivemind averages the state
    tensors in place) its averaging compression refuses integer tensors (Float16Compression and
    Blockwise8Bit raise ValueError), and without compression its reducer would average the codes as
    float32 numbers. So ttt averages no optimizer statistics (`average_opt_statistics=()`, hivemind's default,
    as training/swarm/wiring.py makes it): in a synchronous swarm every peer applies the same averaged gradient, so the
    moments agree up to the averaging's compression noise; with DiLoCo each peer's inner moments are its own by
    design. A newcomer downloads the state whole: `dump_optimizer_state` / `load_optimizer_state` carry the codes
    and absmax unchanged (hivemind sends a downloaded state uncompressed unless `load_state_compression` says
    otherwise; that must stay so for these tensors). Should peers ever average moments, they must dequantise,
    average the float32 values and quantise the mean. The 8-bit and 32-bit tensors have different key names, so
    a name in `average_opt_statistics` cannot silently cover both.

    Device-agnostic (the trust ratio stays on the device). On CUDA (an H200, bench/optimizer.py --device cuda) it
    trains as fp32 LAMB does and as it does on the CPU, at 2.4-4.2x the step time of bitsandbytes' fused Adam8bit
    (docs/performance.md); a `ttt train` peer steps it on the CPU.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        max_grad_norm: float | None = 1.0,
        eight_bit: bool = True,
        bias_correction: bool = True,
        decay_vectors: bool = False,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decay_vectors=decay_vectors)
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.eight_bit = eight_bit
        self.bias_correction = bias_correction
        self.trust_ratios: dict[torch.Tensor, torch.Tensor] = {}  # each tensor's ratio at the last step
        for group in self.param_groups:
            for param in group["params"]:
                self.init_state(param)

    def quantized(self, param: torch.Tensor) -> bool:
        """Whether this tensor's moments are stored in 8 bits."""
        return self.eight_bit and param.numel() >= MIN_8BIT_SIZE

    @torch.no_grad()
    def init_state(self, param: torch.Tensor) -> None:
        """Zero moments for `param`, in 8 bits or 32 (codes of 0 with an absmax of 0 dequantise to 0)."""
        state = self.state[param]
        state["step"] = 0
        if not self.quantized(param):
            for key in FP32_MOMENTS:
                state[key] = torch.zeros_like(param, dtype=torch.float32, memory_format=torch.preserve_format)
            return
        blocks = math.ceil(param.numel() / BLOCK_SIZE)
        for name in FP32_MOMENTS:
            state[f"{name}_codes"] = torch.zeros(param.shape, dtype=torch.uint8, device=param.device)
            state[f"{name}_absmax"] = torch.zeros(blocks, dtype=torch.float32, device=param.device)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Clip all gradients together, then one LAMB step for every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        clip_gradients(self.param_groups, self.max_grad_norm)
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self.update(param, group)
        return loss

    def update(self, param: torch.Tensor, group: dict) -> None:
        """One LAMB step for one tensor (see the class docstring)."""
        state = self.state[param]
        if not state:  # a parameter group added after construction
            self.init_state(param)
        beta1, beta2 = group["betas"]
        grad = param.grad.float()
        exp_avg, exp_avg_sq = self.moments(state)
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        state["step"] += 1
        # m_hat / (sqrt(v_hat) + eps) = sqrt(c2) / c1 * m / (sqrt(v) + eps sqrt(c2)): Adam's usual arrangement,
        # which takes fewer passes over the tensor (c1 = 1 - beta1^t, c2 = 1 - beta2^t; 1 without correction).
        c1, c2 = (1 - beta1 ** state["step"], 1 - beta2 ** state["step"]) if self.bias_correction else (1.0, 1.0)
        denominator = exp_avg_sq.sqrt().add_(group["eps"] * math.sqrt(c2))
        if group["weight_decay"] and (param.ndim > 1 or group["decay_vectors"]):
            decay = param.float().mul(group["weight_decay"])
        else:
            decay = torch.zeros_like(exp_avg)
        update = decay.addcdiv_(exp_avg, denominator, value=math.sqrt(c2) / c1)
        ratio = trust_ratio(param, update)
        param.addcmul_(update, ratio, value=-group["lr"])
        self.trust_ratios[param] = ratio
        if self.quantized(param):
            quantize_into(exp_avg, state["exp_avg_codes"], state["exp_avg_absmax"], signed=True)
            quantize_into(exp_avg_sq, state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"], signed=False)

    @staticmethod
    def moments(state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """m and v as float32 tensors to update: the state's own tensors, or dequantised copies of 8-bit ones."""
        if "exp_avg" in state:
            return state["exp_avg"], state["exp_avg_sq"]
        return (
            dequantize(state["exp_avg_codes"], state["exp_avg_absmax"], signed=True),
            dequantize(state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"], signed=False),
        )

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loading, then every state tensor exactly as saved (on its parameter's device).

        torch casts each state tensor to its parameter's dtype: the uint8 codes would become float32 (and for
        16-bit parameters, float32 moments and absmax would lose precision), so they are put back from
        `state_dict`. A state with other tensors (saved with another `eight_bit`) is refused.
        """
        saved_ids = [index for group in state_dict["param_groups"] for index in group["params"]]
        params = [param for group in self.param_groups for param in group["params"]]
        saved = [state_dict["state"].get(index, {}) for index in saved_ids]
        for param, state in zip(params, saved, strict=True):
            if set(state) != set(self.state[param]):
                keeps = sorted(self.state[param])
                raise ValueError(f"a LAMB state with {sorted(state)} for a tensor that keeps {keeps}")
        super().load_state_dict(state_dict)
        for param, state in zip(params, saved, strict=True):
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    self.state[param][key] = value.to(param.device, copy=True)


class ClipsFirst:
    """Adam with ttt's settings (betas 0.9 / 0.999, eps 1e-6, decoupled weight decay) whose step first clips the
    global gradient norm: mixed in before a torch optimizer class."""

    def __init__(self, params: Iterable, lr: float, weight_decay: float = 0.0, max_grad_norm: float | None = 1.0):
        super().__init__(params, lr=lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=weight_decay)
        self.max_grad_norm = max_grad_norm

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        clip_gradients(self.param_groups, self.max_grad_norm)
        super().step()
        return loss


class ClippedAdam8bit(ClipsFirst, bnb.optim.Adam8bit):
    """bitsandbytes' 8-bit Adam (decoupled weight decay) whose step first clips the global gradient norm."""


class ClippedAdamW(ClipsFirst, torch.optim.AdamW):
    """torch's AdamW whose step first clips the global gradient norm."""


def decay_groups(params: Iterable, weight_decay: float) -> list[dict]:
    """Adam's parameter groups with LAMB's rule: weight decay on matrices, none on biases and norm weights."""
    params = list(params)
    groups = [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


Factory = Callable[[Iterable, float, float, float | None], torch.optim.Optimizer]

# (params, lr, weight_decay, max_grad_norm) -> optimizer, for each choice of --optimizer (what their state costs:
# training/config.py's OPTIMIZER_STATES, which the memory calculator reads without torch).
FACTORIES: dict[str, Factory] = {
    "lamb-8bit": lambda params, lr, weight_decay, max_grad_norm: LAMB(
        params, lr=lr, weight_decay=weight_decay, max_grad_norm=max_grad_norm, eight_bit=True
    ),
    "lamb": lambda params, lr, weight_decay, max_grad_norm: LAMB(
        params, lr=lr, weight_decay=weight_decay, max_grad_norm=max_grad_norm, eight_bit=False
    ),
    "adam-8bit": lambda params, lr, weight_decay, max_grad_norm: ClippedAdam8bit(
        decay_groups(params, weight_decay), lr=lr, max_grad_norm=max_grad_norm
    ),
    "adamw": lambda params, lr, weight_decay, max_grad_norm: ClippedAdamW(
        decay_groups(params, weight_decay), lr=lr, max_grad_norm=max_grad_norm
    ),
}


def make_optimizer(
    name: str, params: Iterable, lr: float, weight_decay: float = 0.01, max_grad_norm: float | None = 1.0
) -> torch.optim.Optimizer:
    """The optimizer `name` (one of training/config.py's OPTIMIZERS) on `params`."""
    return FACTORIES[name](params, lr, weight_decay, max_grad_norm)


def linear_schedule(total_steps: int, warmup_fraction: float = 0.1) -> Callable[[int], float]:
    """The paper's schedule as a LambdaLR factor: linear warm-up over the first 10%, then linear decay to 0."""
    warmup = max(1, int(total_steps * warmup_fraction))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return factor
