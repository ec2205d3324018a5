"""What a peer tells: its signed metrics record in the DHT (for the others, monitors and leaderboards) and a progress
line per global step (for its volunteer), with what happened in that step in words: the round's size or a
download, outliers dropped or clipped, requests refused, batches skipped, steps caught up on."""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from rich.console import Console

from pipeline.core.stream import CodeStream
from training.auth.guard import RunAccess
from training.config import PROTOCOL, AgreedValue, PeerSettings, ttt_version
from training.metrics import MAX_OUTLIER_SENDERS, RECORD_REFRESH, PeerMetrics, publish_metrics, publish_spec
from training.swarm.member import Download, SwarmMember
from training.swarm.optimizer import recent_lineages

if TYPE_CHECKING:
    from training.peer.rounds import Mode

CATCH_UP_WINDOW = 10  # global steps: two catch-up downloads within this many make a peer one that keeps falling behind


def outliers_by_sender(outliers: Counter[tuple[str, str]]) -> Counter[str]:
    """Sender peer id -> its pieces dropped or clipped."""
    by_sender: Counter[str] = Counter()
    for (sender, _), count in outliers.items():
        by_sender[sender] += count
    return by_sender


def outlier_totals(outliers: Counter[tuple[str, str]]) -> dict[str, int]:
    """ "dropped" and "clipped" -> pieces, over all senders."""
    return {kind: sum(n for (_, k), n in outliers.items() if k == kind) for kind in ("dropped", "clipped")}


def download_note(downloads: Sequence[Download]) -> str:
    """For the progress line: whether the state downloads since the last line brought a state."""
    return "state downloaded" if any(d.arrived for d in downloads) else "state download failed (no peer served it)"


IN_PART = "(in part: results lost, own values kept)"


def round_note(size: int, in_part: bool = False, ahead: tuple[int, int] | None = None) -> str:
    """For the progress line: how many peers' gradients (DiLoCo: pseudo-gradients) the step averaged; whether some of
    the round's results were lost here (this peer kept its own values there), or the round was the others' of a later
    step (`ahead`: this peer's step and theirs). Either leaves this peer's parameters apart from the others' until a
    repair. None for a DiLoCo round that failed for all its members, whose local steps go into the next round."""
    if not size:
        return "no round (carried over)"
    note = f"round {size}"
    if ahead:
        own, others = ahead
        note += f" (the others' round of step {others}: this peer was at step {own})"
    return note + (f" {IN_PART}" if in_part else "")


def outliers_note(outliers: Counter[tuple[str, str]]) -> str:
    """For the progress line: the pieces the step's rounds dropped or clipped, and who sent most of them."""
    if not outliers:
        return ""
    counts = outlier_totals(outliers)
    sender, count = outliers_by_sender(outliers).most_common(1)[0]
    done = ", ".join(f"{kind} {n}" for kind, n in counts.items() if n)
    return f" | {done} parts ({count} from ...{sender[-8:]})"


def falling_behind_advice(
    batch_size: int, batch_seconds: float, swarm_step_seconds: float, download_seconds: float = 0.0
) -> str:
    """What a peer that keeps falling behind can do: make its batch fit in one of the swarm's steps, or, when the
    state download itself takes most of a step (a slow link), nothing but ask for longer steps."""
    fitting = int(batch_size * swarm_step_seconds / max(batch_seconds, 1e-9) / 2)
    situation = (
        "this peer keeps falling behind the swarm and downloading its state instead of training (a batch of "
        f"{batch_size} takes {batch_seconds:.1f} s here, a state download {download_seconds:.1f} s, a global step of "
        f"the swarm {swarm_step_seconds:.1f} s)"
    )
    if download_seconds > batch_seconds and download_seconds + batch_seconds >= swarm_step_seconds:
        return (
            f"{situation}; the state arrives too late on this link for steps this short: the run needs longer global "
            "steps (its organiser's --target-batch-size)"
        )
    if fitting >= 1:
        return f"{situation}; use --batch-size {fitting} so that its batches arrive before the swarm's rounds"
    return f"{situation}; even a batch of 1 would arrive late: this device is too slow for this run's global steps"


class ProgressReport:
    """This peer's contribution so far (samples, the time a batch takes, bytes sent, outliers seen), published as its
    record and printed as its progress lines. It also remembers the lineage it published at each recent step
    (training/peer/health.py compares it with the others')."""

    def __init__(
        self,
        settings: PeerSettings,
        console: Console,
        dht,
        public_key: bytes,
        member: SwarmMember,
        access: RunAccess | None,
        stream: CodeStream,
        agreed: Mapping[str, AgreedValue],
    ) -> None:
        self.settings, self.console, self.dht, self.public_key = settings, console, dht, public_key
        self.member, self.access, self.stream, self.agreed = member, access, stream, dict(agreed)
        self.peer_id = dht.peer_id.to_base58()
        self.display_name = settings.display_name or self.peer_id[-8:]
        self.joining_until = 0.0  # published: the swarm holds its step for this peer until then (DHT time)
        self.lineages: dict[int, str] = {}  # global step -> the lineage this peer published at it (a few)
        self.states_loaded = 0  # state downloads that arrived, as of the last record (each restarts `lineages`)
        self.total_samples = 0
        self.batch_seconds = 0.0  # moving average of one batch's forward + backward here
        self.sent_bytes = 0  # what this peer's averagers sent to other peers, as of the last global step
        self.outliers: Counter[tuple[str, str]] = Counter()  # (sender, "dropped" | "clipped") -> pieces, so far
        self.last_outliers: Counter[tuple[str, str]] = Counter()  # those of the last global step
        self.downloads_reported = 0
        self.refusals_reported = 0
        self.step_seen_at = time.monotonic()  # when this peer last saw the global step change
        self.catch_ups: list[int] = []  # global steps at which this peer caught up by downloading the state
        self.advised_at = -CATCH_UP_WINDOW
        self.published_at = -math.inf  # time.monotonic() of this peer's last published record
        self.spec_published_at = -math.inf  # and of the run's spec (training/spec.py), which it publishes too

    def batch_done(self, samples: int, seconds: float) -> None:
        self.total_samples += samples
        self.batch_seconds = 0.8 * self.batch_seconds + 0.2 * seconds if self.batch_seconds else seconds

    def publish(self, losses: Sequence[float] = (), finished: bool = False) -> PeerMetrics:
        """Publish this peer's signed metrics record (on joining, after each global step, when finished); returns it."""
        member, step = self.member, self.member.step
        loaded = sum(download.arrived for download in member.downloads)
        self.lineages = recent_lineages(self.lineages, step, member.lineage, restart=loaded != self.states_loaded)
        self.states_loaded = loaded
        metrics = PeerMetrics(
            step=step,
            samples_per_second=0.0 if finished else member.samples_per_second,
            samples_accumulated=len(losses) * self.settings.batch_size,
            total_samples=self.total_samples,
            loss=sum(losses) / len(losses) if losses else 0.0,
            mini_steps=len(losses),
            display_name=self.display_name,
            finished=finished,
            parameters_hash=member.parameters_hash(),
            serves_state=member.serves_state,
            joining_until=self.joining_until,
            rounds_together=member.rounds_together,
            round_size=member.last_round_size,
            username=self.access.username if self.access else "",
            peer_id=self.peer_id,
            lineage=member.lineage,
            recent_lineages=sorted(self.lineages.items()),
            run_settings=self.agreed,
            protocol=PROTOCOL,
            version=ttt_version(),
            inner_steps=member.inner_steps,
            sent_bytes=self.sent_bytes,
            data_epoch=self.stream.epoch,
            epoch_blocks=self.stream.blocks_per_epoch,
            **outlier_totals(self.last_outliers),
            outliers=dict(outliers_by_sender(self.outliers).most_common(MAX_OUTLIER_SENDERS)),
        )
        publish_metrics(self.dht, self.settings.run.run_id, self.public_key, metrics)
        if self.settings.spec is not None and time.monotonic() - self.spec_published_at >= RECORD_REFRESH:
            publish_spec(self.dht, self.public_key, self.settings.spec.values())  # the run's spec, as it joined with it
            self.spec_published_at = time.monotonic()
        self.published_at = time.monotonic()
        return metrics

    def keep_record(self, losses: Sequence[float] = ()) -> None:
        """Publish this peer's record again once it is old (RECORD_REFRESH), within a global step too: an outer step
        or a wait for the run's first peers can outlast a record."""
        if self.record_due():
            self.publish(losses)

    def record_due(self) -> bool:
        """Whether this peer's record is old enough to publish again, global step or not (RECORD_REFRESH)."""
        return time.monotonic() - self.published_at >= RECORD_REFRESH

    def count_outliers(self) -> None:
        """What this peer's averagers dropped or clipped in the step's rounds, and since it started (asked only when
        there are others to average with: each question is a round trip to two processes)."""
        if self.member.peers <= 1:
            self.last_outliers = Counter()
            return
        self.sent_bytes = sum(self.member.sent_bytes().values())
        counts = Counter(self.member.outlier_counts())
        self.last_outliers, self.outliers = counts - self.outliers, counts

    def print_step(
        self, mode: Mode, previous_step: int, losses: Sequence[float], skipped: int, published: PeerMetrics
    ) -> None:
        """The progress line of a new global step. A peer that fell more than a step behind (a slow machine, a lost
        round) downloads the swarm's state and jumps ahead; the line says so instead of silently skipping."""
        step = self.member.step
        mean_loss = sum(losses) / len(losses) if losses else math.nan
        downloads = self.new_downloads()
        download_seconds = sum(d.seconds for d in downloads)
        if downloads:
            together = download_note(downloads)
        else:
            member = self.member
            together = round_note(member.last_round_size, member.last_round_in_part, member.last_round_ahead)
        jumped = step > previous_step + 1
        self.console.print(
            f"{mode.step_label(step)} | data epoch {self.stream.epoch} | loss {mean_loss:.4f} | peers "
            f"{self.member.peers} | {together}{mode.mode_note(published)} | {self.member.samples_per_second:,.1f} "
            "samples/s"
            + (f" | skipped {skipped} non-finite batches" if skipped else "")
            + outliers_note(self.last_outliers)
            + (f" | caught up from step {previous_step}" if jumped else "")
            + (f" in {download_seconds:.1f} s" if downloads and jumped else "")
            + mode.skip_note(previous_step, step)
            + self.refusals_note()
        )
        if downloads and jumped:
            self.on_catch_up(step, previous_step, download_seconds)
        self.step_seen_at = time.monotonic()

    def new_downloads(self) -> list[Download]:
        """The state downloads tried since the last line."""
        downloads = self.member.downloads[self.downloads_reported :]
        self.downloads_reported += len(downloads)
        return downloads

    def print_join(self) -> None:
        """The line of a peer's first download, on joining a run."""
        step = self.member.step
        downloads = self.new_downloads()
        seconds = sum(d.seconds for d in downloads)
        if any(d.arrived for d in downloads):
            self.console.print(f"synchronised at global step {step} (state downloaded in {seconds:.1f} s)")
        elif step == 0:  # peers serve their state from their first global step on (SwarmOptimizer)
            self.console.print("the run is at global step 0: this peer starts from the run's seed, as every peer does")
        else:
            self.console.print(
                f"[yellow]no peer served the run's state (tried for {seconds:.1f} s): this peer starts at global step "
                f"{step} from its own parameters[/]"
            )

    def refusals_note(self) -> str:
        """For the progress line: requests from unadmitted peers refused since the last line (each is logged)."""
        if self.access is None:
            return ""
        refused = sum(self.access.refused_counts().values())
        new, self.refusals_reported = refused - self.refusals_reported, refused
        return f" | refused {new} unadmitted requests" if new else ""

    def on_catch_up(self, step: int, previous_step: int, download_seconds: float) -> None:
        """A peer that keeps catching up is told, once in a while, how to keep up instead."""
        swarm_step_seconds = (time.monotonic() - self.step_seen_at) / (step - previous_step)
        self.catch_ups = [s for s in self.catch_ups if s > step - CATCH_UP_WINDOW] + [step]
        if len(self.catch_ups) >= 2 and step >= self.advised_at + CATCH_UP_WINDOW:
            self.advised_at = step
            advice = falling_behind_advice(
                self.settings.batch_size, self.batch_seconds, swarm_step_seconds, download_seconds
            )
            self.console.print(f"[yellow]{advice}[/]")

    def final_line(self, step_noun: str, seconds: float, shares: tuple[float, float]) -> None:
        """The last line of a peer that finished its run."""
        self.console.print(
            f"finished at {step_noun} step {self.member.step}: {self.contribution(seconds, shares)}; checkpoint in "
            f"{self.settings.checkpoint_dir}"
        )

    def contribution(self, seconds: float, shares: tuple[float, float]) -> str:
        """What this peer contributed and sent, and how much of its training time went to computing: forward and
        backward, and optimizer steps (`shares`, from `ComputeTime`)."""
        sent = self.member.sent_bytes()
        self.sent_bytes = sum(sent.values())
        per_sample = self.sent_bytes / max(1, self.total_samples)
        forward_backward, optimizer_steps = shares
        return (
            f"contributed {self.total_samples:,} samples in {seconds:.0f} s (computing "
            f"{forward_backward + optimizer_steps:.0%} of the time: forward and backward {forward_backward:.0%}, "
            f"optimizer steps {optimizer_steps:.0%}) and sent {self.sent_bytes:,} bytes to other peers (averaging "
            f"{sent.get('allreduce', 0):,}, states served {sent.get('state', 0):,}: {per_sample:,.0f} per sample)"
        )
