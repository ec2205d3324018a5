"""`ttt monitor`: the run's monitor peer, its history, its checkpoints and its dashboard, in one program.

    DHT (the run's signed metrics records) --every --refresh s--> summarize --> History (SQLite, one transaction)
         |                                                                      --> /api/state, /metrics, W&B
         +-- every --checkpoint-every steps (a thread of its own) --> download the state --> checkpoint
                                                                       --> push to the Hub --> preview images

The monitor joins the run's DHT like a trainer (and can be its first, long-lived node: it prints the addresses
trainers join with), reads every peer's record, and takes no part in averaging unless --assist-averaging.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import FrameType

from rich.console import Console

from pipeline.core.console import ttt_console
from pipeline.core.errors import UserError
from pipeline.core.text import tokenizer_identity
from training.auth.guard import start_access
from training.config import (
    PRESETS,
    AgreedValue,
    MonitorSettings,
    PeerSettings,
    RunSettings,
    RunSpec,
    agreed_values,
    disagreement,
    run_option,
    schedule_steps,
    ttt_version,
)
from training.metrics import (
    RECORD_REFRESH,
    PeerRecord,
    credentials_key,
    make_validators,
    metrics_key,
    parse_records,
    publish_spec,
    read_latest,
)
from training.monitor.aggregate import summarize
from training.monitor.coverage import CoverageWatch
from training.monitor.history import History, verified_total
from training.monitor.report import RunState, prometheus_text, state_json
from training.monitor.revocation import convicted_users, open_revoker
from training.monitor.server import Published, serve
from training.monitor.snapshots import (
    MonitorError,
    SwarmSnapshots,
    check_helper_settings,
    check_push_target,
    write_previews,
)
from training.monitor.verified import AuditWatch
from training.monitor.wheel import WHEEL_FOLDER, RunWheel
from training.swarm.dht import (
    choose_reachability,
    dht_time,
    reachable_addresses,
    refuse_silent_initial_peers,
    start_dht,
)
from training.swarm.processes import HIVEMIND_LOG, STOP_SIGNALS, exit_now, log_hivemind_to, quiet_hivemind_children

DB_NAME = "monitor.sqlite"
PREVIEWS = "previews"
ASSIST_PERIOD = 0.5  # seconds between the keeper's steps: often enough to catch every round's matchmaking


@dataclass
class Snapshot:
    """What the checkpoint thread made of one global step, for the refresh loop to record."""

    step: int
    path: str
    pushed_to: str | None
    previews: dict[str, str] = field(default_factory=dict)


def run_length(run: RunSettings) -> int:
    """The run's length in the steps its peers publish: global steps, or outer steps with DiLoCo, whose schedule
    counts inner steps (of the trainers' default --batch-size, unless --total-steps says)."""
    schedule = run.total_steps or schedule_steps(
        PRESETS[run.preset], run.local_steps, run.target_batch_size, PeerSettings.batch_size
    )
    return -(-schedule // run.local_steps) if run.local_steps else schedule


def join_options(run: RunSettings) -> list[str]:
    """The run's settings that the Join page's command passes to `ttt train`: every one that differs from its default
    (a peer set otherwise is refused), and the run's model; not the run's id, which the page gives on its own."""
    options = ["--preset", run.preset]
    for setting in dataclasses.fields(RunSettings):
        value = getattr(run, setting.name)
        if setting.name not in ("run_id", "preset") and value != setting.default:
            options += [run_option(setting.name), f"{value:g}" if isinstance(value, float) else str(value)]
    return options


def serve_dashboard(settings: MonitorSettings, published: Published, previews: Path) -> ThreadingHTTPServer:
    """The dashboard's server, started; one line when its port cannot be had."""
    try:
        return serve(settings.host, settings.port, published, previews, Path(settings.checkpoint_dir) / WHEEL_FOLDER)
    except OSError as err:
        raise MonitorError(
            f"cannot serve the dashboard on {settings.host}:{settings.port} ({err.strerror}); "
            "pass --port with a free port"
        ) from None


def monitor_agreed_values(settings: MonitorSettings, snapshots: SwarmSnapshots | None) -> dict[str, AgreedValue]:
    """The run's settings as this monitor publishes them for comparison: the dataset only where a helper recomputes
    from it (--audit-rate), since no other monitor reads it."""
    identities = {"tokenizer": tokenizer_identity(settings.run.tokenizer)}
    if snapshots is not None and snapshots.data is not None:
        identities["dataset"] = snapshots.data.index.identity
    return agreed_values(settings.run, identities)


class Monitor:
    def __init__(self, settings: MonitorSettings, console: Console | None = None) -> None:
        self.console = console or ttt_console()
        refuse_silent_initial_peers(settings.initial_peers)
        self.settings = settings = choose_reachability(settings, self.console)
        if settings.run.preset not in PRESETS:
            raise MonitorError(f"--preset {settings.run.preset!r} is unknown; choose one of {', '.join(PRESETS)}")
        self.repo_id = check_push_target(settings)
        check_helper_settings(settings)
        self.revoker = open_revoker(settings, self.console)
        self.total_steps = run_length(settings.run)
        folder = Path(settings.checkpoint_dir)
        self.previews = folder / PREVIEWS
        self.published = Published()
        self.server = serve_dashboard(settings, self.published, self.previews)
        self.history = History(Path(settings.db) if settings.db else folder / DB_NAME)
        log_hivemind_to(folder / HIVEMIND_LOG)
        self.console.print(f"hivemind's own log: {folder / HIVEMIND_LOG}")
        self.rejected = mp.Value("q", 0)  # records the DHT's validators rejected, counted in the DHT's process
        self.dht, self.snapshots, self.access = None, None, None
        try:
            self.access = start_access(settings, self.console)  # the monitor is a peer like any other
            validators, self.public_key = make_validators(settings.run.run_id, self.rejected)
            with quiet_hivemind_children():
                self.dht = start_dht(settings, validators, self.console, self.access)
                if self.access:
                    self.access.start(self.dht)  # before it asks anyone for the state
                # hivemind's averagers start only in the main thread: made here, used by the checkpoint thread.
                if settings.checkpoint_every or settings.assist_averaging:
                    admitted = self.access.admitted_peers if self.access else None
                    self.snapshots = SwarmSnapshots(settings, self.dht, self.public_key, self.console, admitted)
        except BaseException:
            if self.dht is not None:
                self.dht.shutdown()
            if self.access is not None:
                self.access.close()
            self.server.shutdown()
            self.history.close()
            raise
        self.addresses = reachable_addresses([str(address) for address in self.dht.get_visible_maddrs()])
        self.wheel = RunWheel(folder / WHEEL_FOLDER, self.console)  # for the Join page's install line
        self.wandb = start_wandb(settings)
        self.snapshot_due = threading.Event()
        self.made: queue.Queue[Snapshot] = queue.Queue()
        self.stopping = threading.Event()
        self.snapshotted = -1  # the global step of the last checkpoint the checkpoint thread wrote
        self.loss: float | None = None
        self.refreshes = 0
        # The run's settings as this monitor was started with them, and what it said of trainers set otherwise.
        self.agreed = monitor_agreed_values(settings, self.snapshots)
        self.said: set[str] = set()
        # The run's spec, which volunteers joining with --join read: the file's (--run), or this monitor's options.
        self.spec = settings.spec or RunSpec(settings.run)
        self.spec_published_at = -math.inf  # DHT time
        self.coverage = CoverageWatch(self.dht, settings.run.run_id, settings.active_window)
        self.audits = AuditWatch(self.dht, settings.run.run_id)

    def run(self) -> None:
        """Refresh every --refresh seconds until a stop signal; the checkpoint thread works beside it."""
        host, port = self.server.server_address[:2]
        self.console.print(f"monitoring run {self.settings.run.run_id!r}: dashboard on http://{host}:{port}/")
        worker = threading.Thread(target=self.keep_snapshots, name="snapshots", daemon=True)
        worker.start()
        try:
            while not self.stopping.is_set():
                started = time.monotonic()
                self.refresh()
                self.stopping.wait(max(0.0, self.settings.refresh - (time.monotonic() - started)))
        finally:
            self.stopping.set()
            self.snapshot_due.set()
            worker.join(timeout=60)
            self.shutdown()

    def refresh(self) -> RunState:
        """Read every record, record the refresh in one transaction, publish the new state."""
        now = dht_time()
        usernames = None
        if self.access:  # only admitted peers' records count, named by their verified usernames
            self.access.tick()
            usernames = self.access.usernames(read_latest(self.dht, credentials_key(self.settings.run.run_id)))
        records, unparsed = parse_records(read_latest(self.dht, metrics_key(self.settings.run.run_id)), usernames)
        with self.rejected.get_lock():
            rejected, self.rejected.value = self.rejected.value + unparsed, 0
        self.check_settings(records)
        self.tell_snapshots(records)
        if now - self.spec_published_at >= RECORD_REFRESH:
            publish_spec(self.dht, self.public_key, self.spec.values())
            self.spec_published_at = now
        summary = summarize(records, now, self.settings.active_window, self.history.convicted())
        self.coverage.refresh(records, now)
        self.loss = summary.loss if summary.loss is not None else self.loss
        self.history.record_refresh(now, records, summary, rejected, self.audits.read())
        if self.revoker:
            self.revoke_convicted(now)
        while not self.made.empty():
            made = self.made.get()
            self.history.record_checkpoint(made.step, now, self.loss, made.path, made.pushed_to)
            self.history.record_previews(made.step, made.previews)
        every = self.settings.checkpoint_every
        if every and summary.global_step > 0 and summary.global_step // every > self.snapshotted // every:
            self.snapshot_due.set()  # the first refresh takes one at once; a failed one is asked for again
        state = self.state(now, summary, rejected)
        self.published.publish(state_json(state), prometheus_text(state))
        self.log(state)
        self.refreshes += 1
        return state

    def revoke_convicted(self, now: float) -> None:
        """Revoke the users the audits convicted that this monitor never revoked (--revoke-convicted), and relay the
        new list through the DHT at once."""
        revoked = self.history.revoked_users()
        convicted = convicted_users(self.history.votes(), self.history.names())
        convicted = {user: auditors for user, auditors in convicted.items() if user not in revoked}
        if not convicted:
            return
        revocations = self.revoker.revoke(convicted)
        self.history.record_revocations(now, convicted)
        if revocations is not None:
            self.access.relay(revocations)

    def check_settings(self, records: list[PeerRecord]) -> None:
        """Say once if trainers of the run train with other run settings than this monitor was started with: it could
        not read their states for checkpoints, and its join command would get a volunteer refused."""
        for record in records:
            run_settings = record.metrics.run_settings
            differs = disagreement(self.settings.run.run_id, run_settings, self.agreed, we="this monitor")
            if record.metrics.finished or differs is None or differs in self.said:
                continue
            self.said.add(differs)
            self.console.print(f"[yellow]{differs}: restart it with the run's setting[/]")

    def tell_snapshots(self, records: list[PeerRecord]) -> None:
        """What the trainers' records tell the monitor's model: a helper that recomputes hears which data they read,
        a keeper whether it holds their lineage (the convicted ones' left out)."""
        if self.snapshots is None:
            return
        self.snapshots.trainers_read([record.metrics.run_settings.get("dataset") for record in records])
        convicted = self.history.convicted()
        self.snapshots.compare_lineages(
            [record.metrics.lineages_held() for record in records if record.key not in convicted]
        )

    def state(self, now: float, summary, rejected: int) -> RunState:
        speed = self.history.steps_per_second(now)
        steps_left = max(0, self.total_steps - summary.global_step)
        leaderboard = self.history.leaderboard(now, self.settings.active_window)
        return RunState(
            run_id=self.settings.run.run_id,
            updated_at=time.time(),
            refresh_seconds=self.settings.refresh,
            summary=summary,
            total_steps=self.total_steps,
            time_left_seconds=steps_left / speed if speed else None,
            total_samples=self.history.total_samples(),
            rejected_records=rejected,
            leaderboard=leaderboard,
            curves=self.history.curves(),
            previews=self.history.latest_previews(),
            checkpoint=self.history.latest_checkpoint(),
            addresses=self.addresses,
            join_options=join_options(self.settings.run),
            spec=self.spec.values(),
            local_steps=self.settings.run.local_steps,
            wheel=self.wheel.name,
            version=ttt_version(),
            coverage=self.coverage.coverage,
            verified_samples=verified_total(leaderboard),
        )

    def log(self, state: RunState) -> None:
        summary = state.summary
        loss = f"{summary.loss:.4f}" if summary.loss is not None else "-"
        local_steps = self.settings.run.local_steps
        step = f"outer step {summary.global_step:>4}" if local_steps else f"step {summary.global_step:>5}"
        self.console.print(
            f"{step} | loss {loss} | peers {summary.active_peers} | "
            f"{summary.samples_per_second:,.1f} samples/s | {state.total_samples:,} samples in all"
            + (f" | rejected {state.rejected_records} records" if state.rejected_records else "")
            + (f" | refused {refused} unadmitted requests in all" if (refused := self.refused_requests()) else "")
        )
        if self.wandb is not None:
            self.wandb.log(
                {
                    "global_step": summary.global_step,
                    "loss": summary.loss,
                    "samples_per_second": summary.samples_per_second,
                    "active_peers": summary.active_peers,
                    "total_samples": state.total_samples,
                }
            )

    def refused_requests(self) -> int:
        return sum(self.access.refused_counts().values()) if self.access else 0

    def keep_snapshots(self) -> None:
        """The checkpoint thread: with --assist-averaging it steps the keeper in between."""
        while not self.stopping.is_set():
            if self.snapshot_due.wait(ASSIST_PERIOD if self.settings.assist_averaging else None):
                self.snapshot_due.clear()
                if self.stopping.is_set():
                    break
                try:
                    self.take_snapshot()
                except Exception as err:  # a checkpoint is never worth the monitor: say so, retry at the next refresh
                    self.console.print(f"[yellow]checkpoint failed ({type(err).__name__}: {err}); retrying later[/]")
            elif self.settings.assist_averaging:
                self.snapshots.assist()

    def take_snapshot(self) -> None:
        """Download, write, push, draw; a failure is reported in one line and tried again at the next refresh."""
        snapshots = self.snapshots
        if not snapshots.download():
            return
        step_dir = snapshots.save()
        self.snapshotted = snapshots.step
        pushed = self.repo_id is not None and snapshots.push(step_dir, self.loss)
        made = Snapshot(snapshots.step, str(step_dir), f"hf://{self.repo_id}" if pushed else None)
        try:
            made.previews = write_previews(step_dir, self.settings, self.previews)
        except UserError as err:
            self.console.print(f"[yellow]no previews for step {snapshots.step}: {err}[/]")
        self.made.put(made)

    def ask_to_stop(self, signum: int, frame: FrameType | None) -> None:
        """A stop signal ends the refresh loop at its next wake-up. A flag, not Python's KeyboardInterrupt: raised
        inside a destructor (torch's, in a test run), the interrupt was dropped and the monitor ran on for good. A
        second signal ends the process at once."""
        if self.stopping.is_set():
            exit_now(128 + signum)
        self.stopping.set()

    def shutdown(self) -> None:
        self.server.shutdown()
        if self.snapshots is not None:
            self.snapshots.shutdown()
        self.dht.shutdown()
        if self.access is not None:
            self.access.close()
        self.history.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.console.print(f"monitor stopped after {self.refreshes} refreshes; history in {self.history.path}")


def start_wandb(settings: MonitorSettings):
    """A Weights & Biases run for --wandb PROJECT (WANDB_MODE=offline works without a network); else None."""
    if settings.wandb_project is None:
        return None
    try:
        import wandb
    except ImportError:
        raise MonitorError("--wandb needs the wandb package: pip install wandb") from None
    try:
        run_id = settings.run.run_id
        return wandb.init(project=settings.wandb_project, name=run_id, config=dataclasses.asdict(settings.run))
    except Exception as err:  # wandb raises its own errors for auth and network problems
        raise MonitorError(
            f"cannot start Weights & Biases ({str(err).splitlines()[0]}); try WANDB_MODE=offline"
        ) from None


def monitor(settings: MonitorSettings) -> None:
    """Run the monitor until Ctrl-C, SIGTERM (as a service manager stops it) or SIGHUP (a closed terminal): each ends
    it cleanly."""
    monitor = Monitor(settings)
    # After the monitor's hivemind processes are forked: they must keep SIGTERM's default, which hivemind's own
    # shutdown sends them.
    for signum in STOP_SIGNALS:
        signal.signal(signum, monitor.ask_to_stop)
    monitor.run()
