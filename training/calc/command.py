"""`ttt calc` and the Join page's calculator: options -> the model and setup -> the estimate, as a table or JSON.

Both take the same options (`CALC_OPTIONS`): the CLI as click flags, the monitor's /api/calc as a query
string, so the page shows the numbers `ttt calc --json` prints for the same inputs.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table

from pipeline.core.console import ttt_console
from training.calc.memory import GIB, Architecture, CalcError, Estimate, Setup, estimate, find_model, gpt, largest_batch

SHAPE_OPTIONS = ("layers", "width", "heads", "seq_len", "vocab", "ff_hidden")  # a custom model's shape
SETUP_OPTIONS = tuple(field.name for field in dataclasses.fields(Setup))
CALC_OPTIONS = ("preset", *SHAPE_OPTIONS, *SETUP_OPTIONS, "fit_gib")


def custom_model(layers: int, width: int, heads: int, seq_len: int, vocab: int, ff_hidden: int | None) -> Architecture:
    """A GPT-like model of the given shape (learned positions, 4x feed-forward unless given, tied output)."""
    if heads < 1 or width % heads:
        raise CalcError(f"width {width} is not divisible by {heads} heads; choose a width that is a multiple of them")
    model = gpt("custom", layers, width, heads, seq_len, vocab)
    return dataclasses.replace(model, ff_hidden=ff_hidden) if ff_hidden is not None else model


def with_sequence(model: Architecture, seq_len: int) -> Architecture:
    """A preset at another sequence length: the logits (and learned positions) follow it."""
    if model.pattern_masks:
        raise CalcError(
            f"{model.name}'s sequence is fixed by its text length and code grid ({model.seq_len} tokens); "
            "leave --seq-len out"
        )
    (_, classes), *_ = model.logits
    positions = seq_len if model.positions else 0
    return dataclasses.replace(model, seq_len=seq_len, logits=((seq_len, classes),), positions=positions)


def calculate(options: Mapping[str, Any]) -> Estimate:
    """The estimate for `options` (names of CALC_OPTIONS; missing ones take Setup's defaults)."""
    shape = {name: options.get(name) for name in SHAPE_OPTIONS}
    if options.get("preset"):
        model = find_model(options["preset"])
        if any(shape[name] is not None for name in ("layers", "width", "heads", "vocab", "ff_hidden")):
            raise CalcError("give either --preset or a custom shape (--layers, --width, ...), not both")
        if shape["seq_len"] is not None:
            model = with_sequence(model, shape["seq_len"])
    else:
        missing = [f"--{name.replace('_', '-')}" for name in SHAPE_OPTIONS[:-1] if shape[name] is None]
        if missing:
            raise CalcError(f"give --preset NAME, or a custom shape: {', '.join(missing)} missing")
        for name, value in shape.items():
            if value is not None and value < 1:
                raise CalcError(f"--{name.replace('_', '-')} must be a positive number, got {value}")
        model = custom_model(**shape)
    setup = Setup(**{name: options[name] for name in SETUP_OPTIONS if options.get(name) is not None})
    result = estimate(model, setup)
    if options.get("fit_gib") is not None:
        if not 0 < options["fit_gib"] < math.inf:
            raise CalcError(f"--fit must be a positive number of GiB, got {options['fit_gib']}")
        result.largest_batch_size = largest_batch(model, setup, round(options["fit_gib"] * GIB), on_gpu=True)
    return result


def parse_query(query: Mapping[str, list[str]]) -> dict[str, Any]:
    """A query string's values (as urllib.parse.parse_qs gives them) typed like `ttt calc`'s flags."""
    unknown = sorted(set(query) - set(CALC_OPTIONS))
    if unknown:
        raise CalcError(f"unknown option {unknown[0]!r}; the calculator takes {', '.join(CALC_OPTIONS)}")
    types = {field.name: field.type for field in dataclasses.fields(Setup)}
    options: dict[str, Any] = {}
    for name, (value, *_) in query.items():
        kind = types.get(name, {"preset": "str", "fit_gib": "float"}.get(name, "int"))
        try:
            if kind in ("bool", "bool | None"):
                options[name] = None if value == "" else value in ("1", "true", "yes", "on")
            elif kind == "int":
                options[name] = int(value)
            elif kind == "float":
                options[name] = float(value)
            else:
                options[name] = value
        except ValueError:
            raise CalcError(f"{name} must be a number, got {value!r}") from None
    return options


def gib(size: int) -> str:
    return f"{size / GIB:,.2f} GiB"


def render(result: Estimate, console: Console, fit_gib: float | None = None) -> None:
    """The estimate as a table: where each term lives, then the totals and the traffic."""
    setup = result.setup
    flags = [f"batch {setup['batch_size']}", f"{setup['optimizer']} optimizer state", setup["precision"]]
    flags += [name for name in ("offload", "checkpointing", "reversible") if setup[name]]
    if setup["share"] is not None:
        flags.append("shared groups" if setup["share"] else "no sharing")
    flags.append(("as an auditing swarm peer" if setup["audits"] else "as a swarm peer") if setup["swarm"] else "alone")
    table = Table(title=f"{result.model}: {result.parameters_count / 1e6:,.1f} M parameters; {', '.join(flags)}")
    table.add_column("term")
    table.add_column("where")
    table.add_column("memory", justify="right")
    optimizer_place = "host" if setup["offload"] else "device"
    rows = [
        ("parameters", "device", result.parameters),
        ("gradients", "device", result.gradients),
        ("optimizer state", optimizer_place, result.optimizer_state),
        ("activations kept for backward", "device", result.activations),
        ("working memory at the peak", "device", result.transient),
        ("gradient accumulators (hivemind)", "device", result.accumulators),
        ("fp32 copies of parameters + gradients", "host", result.host_copies),
        ("auditing: a second model + its gradients", "device", result.audit_model),
        ("auditing: parameters of the last steps", "host", result.audit_snapshots),
        ("GPU allocator margin", "device", result.margin),
    ]
    for name, place, size in rows:
        if size:
            table.add_row(name, place, gib(size))
    table.add_section()
    table.add_row("GPU memory", "device", gib(result.device_total), style="bold")
    table.add_row("host RAM", "host", gib(result.host_total), style="bold")
    table.add_row("RAM on a CPU-only machine", "both", gib(result.cpu_total))
    console.print(table)
    if result.transfer_per_step:
        console.print(
            f"offloading copies {result.transfer_per_step / 1e9:,.2f} GB between host and GPU per global step: "
            f"{result.transfer_seconds:,.2f} s at {setup['pcie_gbyte']:g} GB/s"
        )
    if result.largest_batch_size is not None:
        fit = f"{fit_gib:g} GiB of GPU memory"
        if result.largest_batch_size:
            console.print(f"the largest --batch-size that fits {fit}: {result.largest_batch_size}", style="bold")
        else:
            console.print(f"not even --batch-size 1 fits {fit}", style="bold red")
    if setup["swarm"]:
        console.print(
            f"averaging sends {result.averaging_per_step / 1e6:,.1f} MB per global step in a group of {setup['peers']} "
            f"(8-bit gradients, parameters every 10 steps): {result.averaging_seconds:,.1f} s at "
            f"{setup['uplink_mbit']:g} Mbit/s up"
        )


def run_calc(options: Mapping[str, Any], as_json: bool) -> None:
    """`ttt calc`: print the estimate for `options`."""
    result = calculate(options)
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        render(result, ttt_console(), options.get("fit_gib"))
