"""Check the memory calculator (`ttt calc`, training/calc/memory.py) against what ttt's model really allocates.

For ttt's presets (tiny and small on this CPU; ttt-1.1b on fake tensors, which have the CPU's shapes and
dtypes but no memory), shared and unshared, this prints predicted next to measured for
- parameters and gradients (the tensors after a backward pass) and the optimizer state after a step, in
  8 bits (training/optimizer.py's LAMB, as `ttt train` runs it), 32 and 16 bits (torch's AdamW): must be equal;
- the activations kept for backward (saved-tensor hooks), plain and reversible, at two batch sizes, and in
  bf16 and mixed precision: within 10%;
- hivemind's gradient accumulators and host copies in a real `ttt train` optimizer (tiny): must be equal;
- an auditor's second model (parameters and gradients) and its kept parameters (tiny, small): must be equal;
- the peak of a whole training step on the CPU (the profiler's allocation record): at most the prediction.
Fake and real runs must save the same bytes. Exit status 1 when any check fails.

    python -m bench.calc            # ~3 minutes on 2 cores
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from bench.common import save_results
from training.calc.measure import (
    measure_activations,
    measure_audit_snapshots,
    measure_optimizer_state,
    measure_parameters_and_gradients,
    measure_step_peak,
    measure_swarm_buffers,
)
from training.calc.memory import Setup, architecture_of, estimate, train_setup
from training.config import PRESETS, ModelConfig

BATCHES = {"tiny": (1, 8), "small": (1, 4), "ttt-1.1b": (1, 2)}
FAKE = {"ttt-1.1b"}  # its activations do not fit here (plain, batch 2: ~19 GB)
ACTIVATION_TOLERANCE = 0.10
PEAK_RUNS = (("tiny", True, 16), ("tiny", False, 8), ("small", True, 1), ("small", False, 1))


@dataclass
class Check:
    preset: str
    variant: str
    term: str
    predicted: int
    measured: int
    rule: str  # "equal", "within 10%" or "at most"

    @property
    def passed(self) -> bool:
        if self.rule == "equal":
            return self.predicted == self.measured
        if self.rule == "at most":
            return self.measured <= self.predicted
        return abs(self.predicted / self.measured - 1) <= ACTIVATION_TOLERANCE


def variant_config(preset: str, share: bool, reversible: bool = True) -> ModelConfig:
    return ModelConfig(**{**PRESETS[preset].model.to_dict(), "share_groups": share, "reversible": reversible})


def predict(preset: str, config: ModelConfig, **setup) -> dict:
    return estimate(architecture_of(preset, config), Setup(**setup)).to_dict()


def tensor_checks(preset: str, share: bool) -> list[Check]:
    """Parameters, gradients and the optimizer state of one model."""
    config = variant_config(preset, share)
    variant = "shared" if share else "unshared"
    fake = preset in FAKE
    parameters, gradients = measure_parameters_and_gradients(config, fake=fake)
    checks = [
        Check(preset, variant, "parameters", predict(preset, config)["parameters"], parameters, "equal"),
        Check(preset, variant, "gradients", predict(preset, config)["gradients"], gradients, "equal"),
    ]
    if fake and not share:
        return checks  # an optimizer step needs real tensors: 1.08 B parameters with their state do not fit here
    for optimizer in ("lamb-8bit", "lamb", "adam-8bit", "adamw", "adamw-16bit"):
        predicted = predict(preset, config, optimizer=optimizer)["optimizer_state"]
        measured = measure_optimizer_state(config, optimizer)
        checks.append(Check(preset, variant, f"{optimizer} optimizer state", predicted, measured, "equal"))
    return checks


def activation_checks(preset: str, share: bool) -> list[Check]:
    """Activations kept for backward, plain and reversible, at both batch sizes."""
    checks = []
    for reversible in (False, True):
        config = variant_config(preset, share, reversible)
        for batch in BATCHES[preset]:
            variant = f"{'shared' if share else 'unshared'}, {'reversible' if reversible else 'plain'}, batch {batch}"
            predicted = predict(preset, config, batch_size=batch, reversible=reversible)["activations"]
            measured = measure_activations(config, batch, fake=preset in FAKE)
            checks.append(Check(preset, variant, "activations", predicted, measured, "within 10%"))
    return checks


def swarm_checks(preset: str, batch: int) -> list[Check]:
    """What a `ttt train` peer's hivemind optimizer allocates beyond the model, against the calculator's terms."""
    config = PRESETS[preset].model
    predicted = estimate(architecture_of(preset, config), train_setup(config, batch)).to_dict()
    measured = measure_swarm_buffers(config, batch)
    variant = f"ttt train's optimizer, batch {batch}"
    return [Check(preset, variant, term, predicted[term], size, "equal") for term, size in measured.items()]


def audit_checks(preset: str) -> list[Check]:
    """What an auditing `ttt train` peer keeps beyond the model, against the calculator's terms."""
    config = PRESETS[preset].model
    predicted = estimate(architecture_of(preset, config), train_setup(config, 1, audit_rate=0.1)).to_dict()
    measured = {
        "audit_model": sum(measure_parameters_and_gradients(config)),  # the second model, after its backward pass
        "audit_snapshots": measure_audit_snapshots(config),
    }
    return [Check(preset, "an auditor", term, predicted[term], size, "equal") for term, size in measured.items()]


def precision_checks(preset: str) -> list[Check]:
    """Activations of the plain model in bfloat16 and under bfloat16 autocast, at the larger batch."""
    batch = BATCHES[preset][-1]
    config = variant_config(preset, True, reversible=False)
    checks = []
    for precision in ("bf16", "mixed"):
        predicted = predict(preset, config, batch_size=batch, precision=precision)["activations"]
        measured = measure_activations(config, batch, fake=preset in FAKE, precision=precision)
        variant = f"plain, batch {batch}, {precision}"
        checks.append(Check(preset, variant, "activations", predicted, measured, "within 10%"))
    return checks


def fake_equals_real(preset: str) -> list[Check]:
    """The fake tensors that measure ttt-1.1b save exactly what real ones do (on a model that fits)."""
    batch = BATCHES[preset][-1]
    config = variant_config(preset, True, reversible=False)
    real, fake = measure_activations(config, batch), measure_activations(config, batch, fake=True)
    return [Check(preset, f"plain, batch {batch}", "activations: fake vs real", real, fake, "equal")]


def peak_checks() -> list[Check]:
    """The peak of a training step on the CPU against the calculator's total for it (alone, not offloaded)."""
    checks = []
    for preset, reversible, batch in PEAK_RUNS:
        config = variant_config(preset, True, reversible)
        predicted = predict(preset, config, batch_size=batch, reversible=reversible, swarm=False)["cpu_total"]
        variant = f"{'reversible' if reversible else 'plain'}, batch {batch}"
        checks.append(Check(preset, variant, "peak of a step", predicted, measure_step_peak(config, batch), "at most"))
    return checks


def show(checks: list[Check], console: Console) -> None:
    table = Table(title="memory calculator: predicted vs measured (bytes)")
    for column in ("preset", "variant", "term", "predicted", "measured", "predicted / measured", "rule", ""):
        table.add_column(column, justify="right" if column in ("predicted", "measured") else "left")
    for check in checks:
        table.add_row(
            check.preset,
            check.variant,
            check.term,
            f"{check.predicted:,}",
            f"{check.measured:,}",
            f"{check.predicted / check.measured:.4f}",
            check.rule,
            "ok" if check.passed else "[bold red]FAILED[/]",
        )
    console.print(table)


def main() -> int:
    started = time.perf_counter()
    torch.set_num_threads(2)
    console = Console(width=160)
    checks: list[Check] = []
    for preset in BATCHES:
        for share in (True, False):
            console.print(f"{preset}, {'shared' if share else 'unshared'} ...")
            checks += tensor_checks(preset, share) + activation_checks(preset, share)
        if preset not in FAKE:  # a fake model cannot be cast to bfloat16 (nor needs to: the shapes are the same)
            checks += precision_checks(preset)
    checks += fake_equals_real("tiny") + fake_equals_real("small")
    checks += swarm_checks("tiny", 8) + audit_checks("tiny") + audit_checks("small")
    console.print("peaks of training steps ...")
    checks += peak_checks()
    show(checks, console)
    failed = [check for check in checks if not check.passed]
    console.print(f"{len(checks) - len(failed)} of {len(checks)} checks passed")
    save_results("calc", {"checks": [{**vars(c), "passed": c.passed} for c in checks]}, started, console)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
