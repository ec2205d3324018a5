"""The run spec: every run-wide setting (`RunSettings`), written once by the organiser and read by every peer.

    ttt run init --run-id NAME ... --out-file run.toml   the organiser writes it (signed, with --authority DIR)
    ttt monitor --run run.toml                          starts the run from it; it publishes the spec in the DHT
    ttt train --join ADDRESS                            reads it from the swarm (or the monitor's page): no other
                                                        option of the run is needed

Every peer publishes the spec it joined with (training/metrics.py's `ttt_runs` key), so the spec outlives the
monitor. A signed spec carries the run's public key (run.pub) and the authority's signature of its settings: a peer
given the run's --authority-key takes only a spec signed by it; without the key, a signed spec (whose signature holds)
outranks unsigned ones. An unsigned spec is taken as the swarm holds it, and the peer says so; when the swarm holds
two different specs of one run, the peer stops and asks for the run's key or its file rather than guess.
"""

from __future__ import annotations

import json
import sys
import textwrap
import types
import typing
import urllib.error
import urllib.request
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from pipeline.core.console import ttt_console
from pipeline.core.errors import UserError
from training.auth.keys import AUTHORITY_PUBLIC, AuthorityPublicKey, load_authority, parse_authority_public_key
from training.config import (
    AGGREGATIONS,
    MACHINE_PATHS,
    OPTIMIZERS,
    OUTER_BITS,
    PRESETS,
    AgreedValue,
    RunSettings,
    RunSpec,
    flag,
)

CHOICES = {"preset": tuple(PRESETS), "optimizer": OPTIMIZERS, "aggregation": AGGREGATIONS, "outer_bits": OUTER_BITS}
KINDS = {str: "a string", int: "an integer", float: "a number", type(None): "left out"}  # in a file's words
AUTHORITY_TABLE = "authority"  # the spec file's table of the run's public key and its signature


class SpecError(UserError):
    pass


def signer(spec: RunSpec) -> AuthorityPublicKey | None:
    """The run's public key that signed `spec`; None when it is unsigned or its signature does not hold."""
    if not (spec.authority_key and spec.signature):
        return None
    try:
        key = parse_authority_public_key(spec.authority_key, "the run spec's authority key")
    except ValueError:
        return None
    return key if key.verify(spec.signed_bytes(), spec.signature.encode()) else None


def specs_from_records(records: Sequence[Mapping[str, object]]) -> list[RunSpec]:
    """The specs of the swarm's `ttt_runs` records (training/metrics.py); those that are not a run's are left out."""
    specs = []
    for values in records:
        try:
            specs.append(spec_from_values(values, "a run spec in the DHT"))
        except SpecError:
            continue
    return specs


def spec_from_values(values: Mapping[str, object], source: str) -> RunSpec:
    """A spec from a file's, a record's or a page's values; one line naming `source` for anything not a run's."""
    values = dict(values)
    authority_key, signature = str(values.pop("authority_key", "")), str(values.pop("signature", ""))
    hints = typing.get_type_hints(RunSettings)
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise SpecError(f"{source}: {unknown[0]} is not a run setting; the settings are {', '.join(hints)}")
    if "run_id" not in values:
        raise SpecError(f"{source} names no run_id")
    checked = {name: checked_value(name, value, hints[name], source) for name, value in values.items()}
    return RunSpec(RunSettings(**checked), authority_key, signature)


def checked_value(name: str, value: object, hint: object, source: str) -> object:
    """`value` as field `name` of RunSettings holds it (an integer where a float is due, as TOML writes 1.0)."""
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not (value is None and type(None) in allowed) and (
        isinstance(value, bool) or not isinstance(value, tuple(t for t in allowed if t is not type(None)))
    ):
        kinds = " or ".join(KINDS[kind] for kind in allowed)
        raise SpecError(f"{source}: {name} = {value!r} must be {kinds}; fix it, or write the file with `ttt run init`")
    if name in CHOICES and value not in CHOICES[name]:
        raise SpecError(f"{source}: {name} = {value!r}; choose one of {', '.join(map(str, CHOICES[name]))}")
    return value


def signed_spec(settings: RunSettings, authority_folder: Path | None) -> RunSpec:
    """The spec of `settings`, signed by the authority in `authority_folder` (None: unsigned)."""
    if authority_folder is None:
        return RunSpec(settings)
    authority = load_authority(authority_folder)
    if authority.run_id != settings.run_id:
        raise SpecError(f"--authority {authority_folder} is run {authority.run_id!r}'s, not {settings.run_id!r}'s")
    public = Path(authority.public.source).read_text().strip()
    unsigned = RunSpec(settings, authority_key=public)
    return replace(unsigned, signature=authority.sign(unsigned.signed_bytes()).decode())


def init_spec(
    settings: RunSettings, path: Path, authority_folder: Path | None, overwrite: bool, helps: Mapping[str, str]
) -> None:
    """`ttt run init`: the spec file of `settings`, signed by the authority in `authority_folder` when given."""
    if path.exists() and not overwrite:
        raise SpecError(f"{path} exists; pass --overwrite to replace it, or choose another --out-file")
    spec = signed_spec(settings, authority_folder)
    write_spec(path, spec, helps)
    signed = (
        f"signed by {authority_folder / AUTHORITY_PUBLIC}"
        if spec.signature
        else "unsigned (peers cannot check who wrote it: sign it with --authority DIR)"
    )
    ttt_console().print(
        f"wrote {path}: run {settings.run_id!r}, {signed}; start the run with: ttt monitor --run {path}"
    )


def toml_value(value: AgreedValue) -> str:
    """A TOML value: JSON's strings are TOML's basic strings, and its numbers TOML's."""
    return json.dumps(value)


def write_spec(path: Path, spec: RunSpec, helps: Mapping[str, str]) -> None:
    """The spec as a commented TOML file (each setting with its option's help), written whole or not at all."""
    lines = [
        f"# The settings every peer of run {spec.settings.run_id!r} shares (`ttt run init`).",
        f"# Start the run: ttt monitor --run {path.name}; volunteers join with: ttt train --join ADDRESS",
    ]
    for name, value in asdict(spec.settings).items():
        lines += ["", *textwrap.wrap(helps[name], width=100, initial_indent="# ", subsequent_indent="# ")]
        lines.append(f"# {name} =  (unset)" if value is None else f"{name} = {toml_value(value)}")
    if spec.signature:
        lines += ["", f"[{AUTHORITY_TABLE}]", "# The run's run.pub and its signature of the settings above."]
        lines += [f"public_key = {toml_value(spec.authority_key)}", f"signature = {toml_value(spec.signature)}"]
    partial = path.with_name(path.name + ".partial")
    partial.write_text("\n".join(lines) + "\n")
    partial.replace(path)


def read_spec(path: Path) -> RunSpec:
    """A spec file of `ttt run init` (or written by hand); one line for anything wrong with it."""
    source = f"--run {path}"
    try:
        values = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SpecError(f"{source} does not exist; write one with `ttt run init`") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise SpecError(f"{source} is not TOML ({err}); fix it or write it again with `ttt run init`") from None
    authority = values.pop(AUTHORITY_TABLE, {})
    if not isinstance(authority, dict):
        raise SpecError(f"{source}: [{AUTHORITY_TABLE}] must be a table with public_key and signature")
    values |= {"authority_key": authority.get("public_key", ""), "signature": authority.get("signature", "")}
    spec = spec_from_values(values, source)
    if spec.signature and signer(spec) is None:
        raise SpecError(f"{source}: its signature does not hold (edited after `ttt run init --authority`?)")
    return spec


def read_monitor_page(url: str, timeout: float = 10.0) -> tuple[list[str], RunSpec]:
    """The addresses and the spec of the run whose monitor serves `url` (its dashboard or Join page), from its
    /api/state."""
    base = url.split("?")[0].rstrip("/").removesuffix("/join")
    try:
        with urllib.request.urlopen(f"{base}/api/state", timeout=timeout) as answer:
            join = json.loads(answer.read())["join"]
        addresses, values = list(join["addresses"]), join["spec"]
    except (urllib.error.URLError, OSError) as err:
        raise SpecError(f"--join {url}: no monitor answers there ({err}); check the address") from None
    except (ValueError, KeyError, TypeError):
        raise SpecError(f"--join {url}: no ttt monitor of this version answers there; check the address") from None
    if not isinstance(values, dict):
        raise SpecError(f"--join {url}: the monitor publishes no run spec; ask the organiser to upgrade ttt")
    return addresses, spec_from_values(values, f"the run spec of {url}")


def adopt(spec: RunSpec, run: RunSettings, given: Collection[str]) -> RunSettings:
    """The run's settings for a peer of the run of `spec`: the spec's, except those given on the command line
    (`given`, with their values in `run`). A dataset or tokenizer given is this machine's copy of the run's (the peers
    compare what the files hold); any other must be the spec's, or the peer stops with one line."""
    settings = spec.settings
    for name in given:
        ours, theirs = getattr(run, name), getattr(settings, name)
        if name in MACHINE_PATHS:
            settings = replace(settings, **{name: ours})
        elif ours != theirs:
            raise SpecError(
                f"{flag(name, ours)} contradicts run {settings.run_id!r}, which trains with {flag(name, theirs)}; "
                "leave the option out to train with the run's"
            )
    return settings


def choose_spec(
    specs: Sequence[RunSpec], run_id: str | None, authority: AuthorityPublicKey | None, where: str
) -> RunSpec:
    """The spec a joining peer takes among those the swarm at `where` holds: that of its run (--run-id, or the only
    run there), signed by the run's key when the peer knows it; one line when there is none, or no telling."""
    runs = sorted({spec.settings.run_id for spec in specs})
    if run_id is None and len(runs) > 1:
        raise SpecError(f"several runs share the swarm at {where} ({', '.join(runs)}); add --run-id NAME")
    candidates = [spec for spec in specs if run_id in (None, spec.settings.run_id)]
    if not candidates:
        what = f"run {run_id!r}" if run_id else "any run"
        raise SpecError(f"no peer at {where} has published the spec of {what}; check the address, or ask the organiser")
    name = candidates[0].settings.run_id
    if authority is not None:
        candidates = [spec for spec in candidates if signer_matches(spec, authority)]
        if not candidates:
            raise SpecError(f"no spec at {where} is signed by --authority-key {authority.source}; check the address")
    else:
        candidates = [spec for spec in candidates if not spec.signature or signer(spec) is not None]
    signed = [spec for spec in candidates if spec.signature]
    distinct = {spec.signed_bytes(): spec for spec in signed or candidates}  # a signed spec outranks unsigned ones
    if len(distinct) != 1:
        raise SpecError(
            f"the swarm at {where} holds {len(distinct)} different specs of run {name!r} (signed ones whose "
            "signature does not hold are left out); ask the organiser for the run's run.pub (--authority-key) or its "
            "run.toml (--run)"
        )
    return next(iter(distinct.values()))


def signer_matches(spec: RunSpec, authority: AuthorityPublicKey) -> bool:
    key = signer(spec)
    return key is not None and key.key.to_bytes() == authority.key.to_bytes()
