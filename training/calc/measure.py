"""What ttt's model really allocates, from the tensors themselves: the check of the memory calculator.

`python -m bench.calc` prints these next to `training.calc.memory.estimate`'s predictions, and the tests hold them
to it:

- parameters and gradients: the bytes of every distinct parameter and of its `.grad` after a backward pass;
- optimizer state: the bytes of every tensor in the optimizer's state after a step (bitsandbytes' 8-bit state,
  its block maxima and quantisation maps included), each storage counted once;
- activations: every tensor autograd saves for the backward pass during the forward pass (a saved-tensor
  hook), counted once per storage, leaving out the parameters and buffers themselves;
- an auditor's copies of its last steps' parameters (training/audit/'s `Recomputer.keep`, once per global step; its
  second model is one more model: parameters and gradients as above);
- hivemind's own buffers in a real peer's optimizer (`ttt train`'s, alone on a local DHT): its gradient
  accumulators and its shared host copies of the parameters and gradients, on which the offloaded optimizer steps;
- the peak of a whole training step (forward, backward, 8-bit LAMB step) on the CPU: torch's profiler records
  every allocation and free with its size (`profile_memory`), whose running sum peaks there.

With `fake=True` the model runs on fake tensors (`FakeTensorMode`): shapes and dtypes as on the CPU, nothing
allocated, so ttt-1.1b's activations are measured on a machine where they would not fit; the tests check that
fake and real runs save the same bytes.
"""

from __future__ import annotations

import json
import tempfile
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.profiler import ProfilerActivity, profile

from training.audit.auditor import Recomputer
from training.audit.sketch import Sketcher, run_seed
from training.config import DEFAULT_OPTIMIZER, OPTIMIZER_STATES, ModelConfig, RunSettings
from training.model import DalleTransformer
from training.optimizer import make_optimizer as make_local_optimizer
from training.swarm.dht import start_local_dht
from training.swarm.processes import quiet_hivemind_children
from training.swarm.wiring import Membership, join_swarm


def storage_bytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()


def root_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage a view shares (q, k and v are views of one qkv output)."""
    return tensor._base if tensor._base is not None else tensor


def random_batch(config: ModelConfig, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    text = torch.randint(0, config.text_vocab_size, (batch, config.text_len), generator=generator)
    codes = torch.randint(0, config.codebook_size, (batch, config.image_tokens), generator=generator)
    return text, codes


def saved_activation_bytes(model: DalleTransformer, text: torch.Tensor, codes: torch.Tensor) -> int:
    """Bytes autograd keeps for the backward pass of one forward pass of `model`."""
    own = {id(tensor) for tensor in (*model.parameters(), *model.buffers())}
    saved: dict[int, tuple[torch.Tensor, int]] = {}  # id of the root -> (the root, kept alive: no id reuse, bytes)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        root = root_of(tensor)
        if id(root) not in own:
            saved[id(root)] = (root, storage_bytes(root))
        # Detached: a saved output packed as itself would hold its own graph node, a cycle no collector breaks.
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(text, codes)
    total = sum(size for _, size in saved.values())
    saved.clear()  # the roots hold the graph, whose hooks hold `pack` and with it `saved`: let them go
    return total


def measure_activations(config: ModelConfig, batch: int, fake: bool = False, precision: str = "fp32") -> int:
    """Activations kept for backward by one forward pass of `batch` samples; precision fp32, bf16 (the model in
    bfloat16) or mixed (bfloat16 autocast, the CPU's)."""
    with FakeTensorMode() if fake else nullcontext():
        model = DalleTransformer(config)
        if precision == "bf16":
            model = model.to(torch.bfloat16)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "mixed" else nullcontext()
        with autocast:
            return saved_activation_bytes(model, *random_batch(config, batch))


def measure_parameters_and_gradients(config: ModelConfig, fake: bool = False) -> tuple[int, int]:
    """(parameter bytes, gradient bytes after a backward pass of one sample)."""
    with FakeTensorMode() if fake else nullcontext():
        model = DalleTransformer(config)
        model(*random_batch(config, 1))["loss"].backward()
        parameters = list(model.parameters())  # shared blocks are the same Parameter objects: counted once
        return (
            sum(storage_bytes(p) for p in parameters),
            sum(storage_bytes(p.grad) for p in parameters if p.grad is not None),
        )


def local_optimizer(name: str, parameters: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer of one of the calculator's choices: ttt train's (--optimizer), or torch's AdamW on 16-bit
    parameters (adamw-16bit)."""
    if name in OPTIMIZER_STATES:
        return make_local_optimizer(name, parameters, lr=1e-3)
    return torch.optim.AdamW(parameters, lr=1e-3, foreach=False)


def measure_optimizer_state(config: ModelConfig, optimizer_name: str) -> int:
    """Bytes of the optimizer's state after one step on the model's (real) parameters with zero gradients;
    adamw-16bit: the parameters in bfloat16, whose moments AdamW keeps in bfloat16 too."""
    model = DalleTransformer(config)
    if optimizer_name == "adamw-16bit":
        model = model.to(torch.bfloat16)
    parameters = list(model.parameters())
    for parameter in parameters:
        parameter.grad = torch.zeros_like(parameter)
    optimizer = local_optimizer(optimizer_name, parameters)
    optimizer.step()
    return state_bytes(optimizer)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in an optimizer's state, each storage once (bitsandbytes shares its maps)."""
    storages = {}
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(storages.values())


def allocation_peak(work) -> int:
    """The most bytes `work()` had allocated at once on the CPU beyond what was allocated before it."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        work()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:  # the trace is where each event's size is kept
        profiler.export_chrome_trace(trace.name)
        events = json.loads(Path(trace.name).read_text())["traceEvents"]
    changes = sorted((event["ts"], event["args"]["Bytes"]) for event in events if event.get("name") == "[memory]")
    allocated = peak = 0
    for _, change in changes:
        allocated += change
        peak = max(peak, allocated)
    return peak


def measure_step_peak(config: ModelConfig, batch: int) -> int:
    """Peak bytes of one training step on the CPU (8-bit LAMB, no offloading), the parameters and the optimizer
    state included: the step after the first, when the state exists and the gradients are made anew."""
    model = DalleTransformer(config)
    optimizer = local_optimizer(DEFAULT_OPTIMIZER, list(model.parameters()))
    text, codes = random_batch(config, batch)

    def step() -> None:
        model(text, codes)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    parameters = sum(storage_bytes(p) for p in model.parameters())
    return parameters + state_bytes(optimizer) + allocation_peak(step)


def measure_audit_snapshots(config: ModelConfig, steps: int = 8) -> int:
    """The most bytes an auditor's kept parameters hold over STEPS global steps (a copy kept at each)."""
    model = DalleTransformer(config)
    no_data = SimpleNamespace(index=None, settings=None, tokenizer=None)  # keeping parameters reads no rows
    sketcher = Sketcher.for_run([parameter.numel() for parameter in model.parameters()], run_seed("memory-check"))
    recomputer = Recomputer(model, model, no_data, sketcher)
    most = 0
    for step in range(steps):
        recomputer.keep(step, lineage="memory-check")
        kept = [tensor for snapshot in recomputer.snapshots.values() for tensor in snapshot.state.values()]
        most = max(most, sum(storage_bytes(tensor) for tensor in kept))
    return most


def measure_swarm_buffers(config: ModelConfig, batch: int) -> dict[str, int]:
    """Bytes of the tensors a `ttt train` peer's hivemind optimizer adds to the model's parameters and gradients,
    each storage counted once, after one step: {"accumulators", "host_copies", "optimizer_state"}."""
    run = RunSettings(run_id="memory-check", target_batch_size=batch)
    dht = start_local_dht()
    model = DalleTransformer(config)
    with quiet_hivemind_children():  # hivemind's averagers would leave this process ignoring Ctrl-C
        member = join_swarm(run, dht, model, Membership(batch_size=batch))
    try:
        model(*random_batch(config, batch))["loss"].backward()
        member.optimizer_step()
        counted = {p.untyped_storage().data_ptr() for p in model.parameters()}
        counted |= {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}

        def new_bytes(tensors) -> int:
            total = 0
            for tensor in tensors:
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in counted:
                    counted.add(storage.data_ptr())
                    total += storage.nbytes()
            return total

        buffers = member.memory_buffers()
        return {
            "host_copies": new_bytes(buffers.host_copies),
            "accumulators": new_bytes(buffers.accumulators),
            "optimizer_state": state_bytes(buffers.optimizer),
        }
    finally:
        member.shutdown()
        dht.shutdown()
