"""`ttt status ADDRESS`: a run at a glance from its swarm, without a monitor. A DHT client of its own reads the run's
spec (training/spec.py), every peer's record and the audits' verdicts, summarised as the monitor summarises them:
the global step, its loss, the swarm's samples per second (the peers the audits convicted left out, as the monitor
leaves them out), and each peer's name, reachability, speed, step, audits and ttt version. The verdicts are those the
auditors' records hold now (each auditor's last 16 passed and 16 failed), where the monitor keeps every one it read:
a peer convicted long ago may show fewer audits here, though the failures that convicted it stay in the records until
each accuser has failed 16 newer microbatches (or its record expired). `--json` prints the same for scripts;
`--watch SECONDS` reads and prints again until Ctrl-C."""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pipeline.core.console import ttt_console
from training.audit.records import read_verdicts
from training.config import MonitorSettings, RunSpec
from training.metrics import PeerRecord, metrics_key, parse_records, read_latest, read_spec_values
from training.monitor.aggregate import SwarmSummary, summarize
from training.monitor.verified import Standing, convicted_keys, standings, verdict_rows, votes_of
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
    audits: dict[str, Standing]  # signing key -> what the audits say of its work (none: never audited)
    now: float


def swarm_address(address: str) -> str:
    """A peer's multiaddress to read the swarm through: `address`, or one its monitor (a URL) lists."""
    if not address.startswith(("http://", "https://")):
        refuse_silent_initial_peers([address])
        return address
    addresses, _ = read_monitor_page(address)
    return reachable_addresses(addresses)[0]


def read_status(dht, address: str, run_id: str | None) -> RunStatus:
    """The run's spec, every peer's record and the audits' verdicts, read once through `dht` (a client in the swarm at
    `address`)."""
    spec = choose_spec(specs_from_records(read_spec_values(dht)), run_id, None, address)
    records, _ = parse_records(read_latest(dht, metrics_key(spec.settings.run_id)))
    passed, failed = read_verdicts(dht, spec.settings.run_id)
    audits = standings(votes_of(verdict_rows(passed) + verdict_rows(failed)))
    now = dht_time()
    summary = summarize(records, now, ACTIVE_WINDOW, convicted_keys(audits))
    return RunStatus(address, spec, summary, records, audits, now)


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
            "audits": {"passed": standing.passed, "failed": standing.failed},
            "convicted": standing.convicted,
            "version": record.metrics.version,
            "seconds_since_record": round(status.now - record.published_at, 1),
        }
        for record, standing in sorted(
            ((record, status.audits.get(record.key, Standing())) for record in status.records),
            key=lambda pair: pair[0].metrics.display_name,
        )
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
    table = Table("peer", "reachable", "samples/s", "step", "samples", "audits", "last record", "version", box=None)
    for peer in status_document(status)["peers"]:
        state = " (convicted)" if peer["convicted"] else " (finished)" if peer["finished"] else ""
        table.add_row(
            peer["name"] + state, "yes" if peer["reachable"] else "no (client)", f"{peer['samples_per_second']:,.1f}",
            str(peer["step"]), f"{peer['total_samples']:,}", audits_cell(**peer["audits"]),
            f"{peer['seconds_since_record']:.0f} s ago", peer["version"] or "-",
        )  # fmt: skip
    console.print(table)


def audits_cell(passed: int, failed: int) -> str:
    """A peer's audits as the table shows them: "-" before any, else how many passed and failed."""
    if passed + failed == 0:
        return "-"
    return f"{passed} passed" + (f", {failed} failed" if failed else "")


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
