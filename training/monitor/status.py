"""`ttt status ADDRESS`: a run at a glance from its swarm, without a monitor. A DHT client of its own reads the run's
spec (training/spec.py) and every peer's record, summarised as the monitor summarises them: the global step, its
loss, the swarm's samples per second, and each peer's name, reachability, speed, step and ttt version.
`--json` prints the same for scripts; `--watch SECONDS` reads and prints again until Ctrl-C."""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pipeline.core.console import ttt_console
from training.config import MonitorSettings, RunSpec
from training.metrics import PeerRecord, metrics_key, parse_records, read_latest, read_spec_values
from training.monitor.aggregate import SwarmSummary, summarize
from training.spec import choose_spec, read_monitor_page, specs_from_records
from training.swarm.dht import dht_client, dht_time, reachable_addresses, refuse_silent_initial_peers
from training.swarm.processes import log_hivemind_to, quiet_hivemind_children

ACTIVE_WINDOW = MonitorSettings.active_window  # seconds a peer's last record counts as active, as on the dashboard


@dataclass(frozen=True)
class RunStatus:
    """What the swarm at `address` said of its run at DHT time `now`."""

    address: str
    spec: RunSpec
    summary: SwarmSummary
    records: list[PeerRecord]
    now: float


def swarm_address(address: str) -> str:
    """A peer's multiaddress to read the swarm through: `address`, or one its monitor (a URL) lists."""
    if not address.startswith(("http://", "https://")):
        refuse_silent_initial_peers([address])
        return address
    addresses, _ = read_monitor_page(address)
    return reachable_addresses(addresses)[0]


def read_status(dht, address: str, run_id: str | None) -> RunStatus:
    """The run's spec and every peer's record, read once through `dht` (a client in the swarm at `address`)."""
    spec = choose_spec(specs_from_records(read_spec_values(dht)), run_id, None, address)
    records, _ = parse_records(read_latest(dht, metrics_key(spec.settings.run_id)))
    now = dht_time()
    return RunStatus(address, spec, summarize(records, now, ACTIVE_WINDOW), records, now)


def status_document(status: RunStatus) -> dict:
    """The status as `--json` prints it."""
    summary = status.summary
    peers = [
        {
            "name": record.metrics.display_name,
            "peer_id": record.metrics.peer_id,
            "reachable": record.metrics.serves_state,
            "samples_per_second": record.metrics.samples_per_second,
            "step": record.metrics.step,
            "total_samples": record.metrics.total_samples,
            "finished": record.metrics.finished,
            "version": record.metrics.version,
            "seconds_since_record": round(status.now - record.published_at, 1),
        }
        for record in sorted(status.records, key=lambda record: record.metrics.display_name)
    ]
    return {
        "address": status.address,
        "run_id": status.spec.settings.run_id,
        "spec": asdict(status.spec.settings),
        "signed": bool(status.spec.signature),
        "global_step": summary.global_step,
        "loss": summary.loss,
        "samples_per_second": summary.samples_per_second,
        "active_peers": summary.active_peers,
        "peers": peers,
    }


def print_status(status: RunStatus, console: Console) -> None:
    """The status as a person reads it: one line for the run, one row per peer."""
    run, summary = status.spec.settings, status.summary
    loss = f"{summary.loss:.4f}" if summary.loss is not None else "-"
    mode = f"DiLoCo every {run.local_steps} local steps" if run.local_steps else "synchronous"
    signed = "signed" if status.spec.signature else "unsigned"
    console.print(
        f"run {run.run_id!r} ({signed} spec: preset {run.preset}, {run.optimizer}, {mode}) | global step "
        f"{summary.global_step} | loss {loss} | {summary.samples_per_second:,.1f} samples/s | "
        f"{summary.active_peers} active peers"
    )
    table = Table("peer", "reachable", "samples/s", "step", "samples", "last record", "version", box=None)
    for peer in status_document(status)["peers"]:
        state = " (finished)" if peer["finished"] else ""
        table.add_row(
            peer["name"] + state, "yes" if peer["reachable"] else "no (client)", f"{peer['samples_per_second']:,.1f}",
            str(peer["step"]), f"{peer['total_samples']:,}", f"{peer['seconds_since_record']:.0f} s ago",
            peer["version"] or "-",
        )  # fmt: skip
    console.print(table)


def show_status(address: str, run_id: str | None, as_json: bool, watch: float | None) -> None:
    """`ttt status`: print the run's status once, or every `watch` seconds until Ctrl-C (JSON: one line each)."""
    log_hivemind_to(Path(tempfile.gettempdir()) / "ttt-status-hivemind.log")
    console = ttt_console()
    with quiet_hivemind_children(), dht_client(swarm_address(address)) as dht:
        while True:
            status = read_status(dht, address, run_id)
            if as_json:
                print(json.dumps(status_document(status)), flush=True)
            else:
                print_status(status, console)
            if watch is None:
                return
            time.sleep(watch)
