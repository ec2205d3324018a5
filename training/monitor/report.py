"""What the monitor tells the world after each refresh: the dashboard's JSON and the Prometheus text."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass

from training.monitor.aggregate import SwarmSummary
from training.monitor.history import Contributor

INSTALL = "pip install 'ttt[train]'"  # what the Join page says until the run's wheel is built, or when it cannot be


@dataclass(frozen=True)
class RunState:
    """Everything the dashboard shows, at one refresh."""

    run_id: str
    updated_at: float
    refresh_seconds: float
    summary: SwarmSummary
    total_steps: int
    time_left_seconds: float | None
    total_samples: int
    rejected_records: int
    leaderboard: list[Contributor]
    curves: dict[str, list]
    previews: dict | None
    checkpoint: dict | None
    addresses: list[str]
    join_options: list[str]  # what every trainer of this run passes besides --initial-peers
    local_steps: int = 0  # DiLoCo's H: the run's steps are outer steps of H local steps each; 0: synchronous
    wheel: str | None = None  # the file name of this ttt's wheel, served at /wheel/NAME (training/monitor/wheel.py)
    version: str = ""  # this ttt's version
    spec: dict | None = None  # the run's spec (training/spec.py), which `ttt train --join URL` reads
    coverage: dict | None = None  # the swarm's data epoch as its leases say (training/monitor/coverage.py)
    verified_samples: tuple[int, int, int] = (0, 0, 0)  # estimate and 95% interval (training/monitor/verified.py)


def join_command(state: RunState) -> str:
    """What a volunteer types to join: the run's settings come from its spec (the Join page puts its own URL in
    place of the address)."""
    return shlex.join(["ttt", "train", "--join", state.addresses[0]]) if state.addresses else ""


def join_preset(state: RunState) -> str | None:
    """The model every trainer of this run passes with --preset, which the Join page's calculator starts from."""
    options = state.join_options
    return options[options.index("--preset") + 1] if "--preset" in options else None


def state_json(state: RunState) -> bytes:
    summary = state.summary
    document = {
        "run_id": state.run_id,
        "updated_at": state.updated_at,
        "refresh_seconds": state.refresh_seconds,
        "global_step": summary.global_step,
        "total_steps": state.total_steps,
        "local_steps": state.local_steps,
        "time_left_seconds": state.time_left_seconds,
        "loss": summary.loss,
        "samples_per_second": summary.samples_per_second,
        "total_samples": state.total_samples,
        "verified_samples": dict(zip(("estimate", "low", "high"), state.verified_samples, strict=True)),
        "active_peers": summary.active_peers,
        "rejected_records": state.rejected_records,
        "coverage": state.coverage,
        "outliers": {"step": summary.global_step, "dropped": summary.dropped, "clipped": summary.clipped},
        "hashes": {
            "step": summary.global_step,
            "distinct": summary.distinct_hashes,
            "agree": summary.distinct_hashes == 1,
        },
        "peers": [
            {"rank": rank, **asdict(row), "claims_capped": row.name in summary.claims_capped}
            for rank, row in enumerate(state.leaderboard, start=1)
        ],
        "history": state.curves,
        "previews": state.previews,
        "checkpoint": state.checkpoint,
        "join": {
            "run_id": state.run_id,
            "addresses": state.addresses,
            "install": INSTALL,
            "wheel": state.wheel,
            "version": state.version,
            "command": join_command(state),
            "preset": join_preset(state),
            "spec": state.spec,
        },
    }
    return json.dumps(document, allow_nan=False, default=str).encode()


def label(value: str) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(state: RunState) -> bytes:
    run = f'run_id="{label(state.run_id)}"'
    summary = state.summary
    gauges = [
        ("ttt_global_step", "The swarm's global step (with DiLoCo: outer step).", summary.global_step),
        ("ttt_loss", "Loss of the last step, weighted by each peer's samples.", summary.loss),
        ("ttt_samples_per_second", "The swarm's training throughput.", summary.samples_per_second),
        ("ttt_active_peers", "Peers that published a record recently and have not finished.", summary.active_peers),
        ("ttt_samples_total", "Samples the peers claim since the run began, a convicted peer's left out.",
         state.total_samples),
        ("ttt_verified_samples", "Samples the audits verified (an estimate: the dashboard shows its interval).",
         state.verified_samples[0]),
        (
            "ttt_rejected_records",
            "Metrics records that failed validation since the last refresh.",
            state.rejected_records,
        ),
        (
            "ttt_parameter_hashes",
            "Distinct parameter hashes among active peers at the global step.",
            summary.distinct_hashes,
        ),
        ("ttt_dropped", "Contributions the global step's reducers dropped as poisoned.", summary.dropped),
        ("ttt_clipped", "Contributions the global step's reducers clipped (CenteredClip).", summary.clipped),
    ]
    lines = []
    for name, help_text, value in gauges:
        if value is None:
            continue
        kind = "counter" if name.endswith("_total") else "gauge"
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{{{run}}} {value}"]
    lines += [
        "# HELP ttt_peer_samples_total Samples contributed, per display name.",
        "# TYPE ttt_peer_samples_total counter",
    ]
    lines += [f'ttt_peer_samples_total{{{run},name="{label(row.name)}"}} {row.samples}' for row in state.leaderboard]
    lines += [
        "# HELP ttt_peer_verified_samples Samples the audits verified, per display name (an estimate).",
        "# TYPE ttt_peer_verified_samples gauge",
    ]
    lines += [
        f'ttt_peer_verified_samples{{{run},name="{label(row.name)}"}} {row.verified[0]}' for row in state.leaderboard
    ]
    lines += ["# HELP ttt_peer_online Whether a display name has an active peer now.", "# TYPE ttt_peer_online gauge"]
    lines += [f'ttt_peer_online{{{run},name="{label(row.name)}"}} {int(row.online)}' for row in state.leaderboard]
    lines += [
        "# HELP ttt_peer_probation Whether an active peer of a display name committed work no audit has passed yet.",
        "# TYPE ttt_peer_probation gauge",
    ]
    lines += [f'ttt_peer_probation{{{run},name="{label(row.name)}"}} {int(row.probation)}' for row in state.leaderboard]
    lines += [
        "# HELP ttt_peer_outliers_total Contributions the other peers dropped or clipped, per display name.",
        "# TYPE ttt_peer_outliers_total counter",
    ]
    lines += [f'ttt_peer_outliers_total{{{run},name="{label(row.name)}"}} {row.outliers}' for row in state.leaderboard]
    return ("\n".join(lines) + "\n").encode()
