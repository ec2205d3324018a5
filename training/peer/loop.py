"""`ttt train --stream`: one volunteer's peer in a collaborative (hivemind) training run.

The peer joins the run's DHT, downloads the current state from the other peers, then loops:
a batch from the streaming loader -> forward/backward -> `hivemind.Optimizer.step()`, which
accumulates samples until the swarm reaches `--target-batch-size`, averages the gradients
(8-bit for large tensors, fp16 for the rest), and applies 8-bit LAMB on the CPU (with --local-steps,
DiLoCo's outer rounds instead: training/peer/rounds.py). Each new global step publishes this peer's
signed metrics to the DHT and prints a progress line; every N steps (and on Ctrl-C) it writes a local
checkpoint.

`Peer` is the loop, built by training/peer/join.py (the join, step by step); what happens around it belongs to
its collaborators, each in its own module:
    swarm.member.SwarmMember  this peer's part in the swarm: hivemind's optimizer, behind ttt's interface
    view.RunView              the others' records, read in the background; token renewal; pings
    rounds.GlobalSteps | OuterRounds   how this peer averages, as its part in the swarm was made
    joining.JoinHold          the hold this peer asks of the swarm while it downloads the state
    health.Health             rollback of non-finite parameters, lineage repair; the final agreement
    report.ProgressReport     the published record and the progress lines
    audit.auditor.Audits      its commitments, and its audits of the others' (training/audit/)
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from pipeline.core.stream import CodeStream, DatasetIndex
from training.audit.auditor import Audits
from training.auth.guard import RunAccess
from training.checkpoint import save_checkpoint
from training.config import PeerSettings
from training.peer.compute_time import ComputeTime
from training.peer.health import Health, agree_on_final_parameters, finish_wait
from training.peer.joining import JoinHold
from training.peer.report import ProgressReport
from training.peer.rounds import Mode
from training.peer.setup import checkpoint_info
from training.peer.stopping import StopSignals
from training.peer.view import RunView, check_same_settings
from training.swarm.member import SwarmMember


@dataclass
class Peer:
    """The training loop of one peer, with its checkpoints and clean exit."""

    settings: PeerSettings
    console: Console
    stop: StopSignals
    access: RunAccess | None
    dht: object  # hivemind.DHT, started by training/swarm/dht.py
    member: SwarmMember
    model: torch.nn.Module
    device: torch.device
    index: DatasetIndex
    stream: CodeStream
    view: RunView
    report: ProgressReport
    join_hold: JoinHold
    mode: Mode
    health: Health
    compute_time: ComputeTime
    audits: Audits | None = None  # commitments and audits (training/audit/); None: DiLoCo, or --audit-rate 0

    @property
    def step(self) -> int:
        return self.member.step

    def catch_up_with_the_swarm(self) -> None:
        """An admitted peer's credential, the run's settings checked against the others', then the swarm's current
        state, downloaded while the swarm holds its step for this peer."""
        if self.access:
            # Before anything else: the others answer this peer's averaging requests only once they can read it.
            self.access.start(self.dht)
        if self.settings.initial_peers:
            check_same_settings(self.view.read_now(), self.report.agreed, self.settings.run.run_id, self.view.peer_id)
            self.join_hold.join(self.mode.holds_step_for_first_batch)
            self.report.print_join()
        self.health.keep()

    def run(self) -> None:
        """Train until --max-steps, or until a stop signal (training/peer/stopping.py): save and leave; on any failure
        leave the swarm before raising. Ctrl-C ends as an interrupt (exit 130), SIGTERM and SIGHUP as a clean exit."""
        started = time.perf_counter()
        # A stop signal only asks the loop to stop after the current batch: hivemind's background work must not be
        # cut mid-round, and the checkpoint must be written from a consistent state.
        with self.stop:
            try:
                self.catch_up_with_the_swarm()
                self.report.publish()  # monitors see the peer at once; --wait-for-peers counts it
                self.view.wait_for_peers(
                    self.settings.wait_for_peers, self.report.agreed, self.console, self.stop.requested,
                    self.report.keep_record,
                )  # fmt: skip
                self.train_until_done()
                self.mode.settle()  # a round in flight ends before the checkpoint
                trained_until = time.monotonic()
            except BaseException:
                self.shutdown()
                raise
            if not self.stop.requested():
                self.mode.end_run()
            self.save()
            self.stop.checkpoint_saved = True
            if not self.stop.requested():
                self.finish(time.perf_counter() - started, self.compute_time.shares(trained_until))
                return
            name = self.stop.received.name
            self.console.print(f"stopped by {name} at global step {self.step}: checkpoint saved, leaving the swarm")
            seconds, shares = time.perf_counter() - started, self.compute_time.shares(trained_until)
            self.console.print(f"until then: {self.report.contribution(seconds, shares)}")
            self.shutdown()
        if self.stop.received == signal.SIGINT:
            raise KeyboardInterrupt

    def train_until_done(self) -> None:
        """Batches until --max-steps or Ctrl-C, checked before drawing the next batch: a checkpoint's stream position
        is then that of the last batch trained on."""
        last_step, losses, skipped = self.step, [], 0
        self.mode.after_step(losses)  # resumed from a checkpoint saved while waiting for a DiLoCo round: take it
        if self.step != last_step:
            self.on_new_step(losses, skipped, last_step)
            last_step = self.step
        if self.training_done():
            return
        for batch in self.stream:
            loss = self.train_on(batch)
            if loss is None:  # never feed a non-finite gradient to the swarm
                skipped += 1
                continue
            losses.append(loss)
            if self.join_hold.pending:
                self.join_hold.release()
            self.view.tick()
            if self.audits:
                self.audits.between_steps()
            self.report.keep_record(losses)
            # A repair's download drops this batch's gradients, of the parameters it replaced: no step on them. It may
            # also bring the run's last step: none alone past it.
            if not self.health.repair_if_split() and not self.reached_max_steps():
                self.member.optimizer_step()
                self.mode.after_step(losses)
            if self.step != last_step:
                self.on_new_step(losses, skipped, last_step)
                last_step, losses, skipped = self.step, [], 0
            if self.training_done():
                return

    def train_on(self, batch: dict) -> float | None:
        """Forward and backward on one batch; its loss, or None when the loss was not finite (nothing to step on)."""
        started = time.monotonic()
        text, codes = batch["text"].to(self.device), batch["codes"].to(self.device)
        loss = self.model(text, codes)["loss"]
        if not torch.isfinite(loss):
            self.member.zero_grad()
            self.health.restore_if_broken()  # the parameters themselves, rather than this batch, may be broken
            return None
        loss.backward()
        if self.audits:
            self.audits.microbatch_done(self.step, batch)
        seconds = time.monotonic() - started
        self.report.batch_done(len(text), seconds)
        self.compute_time.batch_done(seconds)
        return loss.item()

    def training_done(self) -> bool:
        return self.stop.requested() or self.reached_max_steps()

    def reached_max_steps(self) -> bool:
        return self.settings.max_steps is not None and self.step >= self.settings.max_steps

    def on_new_step(self, losses: list[float], skipped: int, previous_step: int) -> None:
        """A global step happened: commit what its round took, guard against a poisoned state, report, publish,
        checkpoint."""
        if self.audits:
            self.audits.commit_sent()
        if self.health.restore_if_broken():
            return
        self.health.keep()
        if self.audits:
            self.audits.step_done(self.step)
        self.report.count_outliers()
        published = self.report.publish(losses)
        self.report.print_step(self.mode, previous_step, losses, skipped, published)
        if self.step % self.settings.checkpoint_every == 0:
            self.save()

    def save(self) -> Path:
        return save_checkpoint(
            Path(self.settings.checkpoint_dir),
            self.model,
            self.step,
            checkpoint_info(self.settings, self.index),
            training_state=self.member.state_dict(),
            stream_state=self.stream.state_dict(),
            tokenizer=self.settings.run.tokenizer,
        )

    def finish(self, seconds: float, compute_shares: tuple[float, float]) -> None:
        """Tell the swarm we are done, agree with the other finished peers on the final parameters, leave."""
        self.report.publish(finished=True)
        wait = finish_wait(self.settings.run.averaging_timeout)
        if not agree_on_final_parameters(self.step, self.view, self.member, self.mode, self.download_final_state, wait):
            self.console.print(f"[yellow]the peers did not agree on the final parameters within {wait:.0f} s: "
                               "this peer's checkpoint holds its own[/]")  # fmt: skip
        self.report.final_line(self.mode.step_noun, seconds, compute_shares)
        self.shutdown()

    def download_final_state(self, first: bool) -> bool:
        """One try at the others' final state (the agreement tries every second), whether it arrived; the console
        hears of the first."""
        if first:
            self.console.print("this peer ends with other parameters than the others: downloading their final state")
        arrived = self.member.download_state(then_train=False).arrived
        if arrived:
            self.save()
            self.report.publish(finished=True)
        elif first:
            self.console.print("[yellow]no peer served the final state: trying again while the others wait[/]")
        return arrived

    def shutdown(self) -> None:
        self.stream.close()  # its unfinished blocks go back to the swarm while the DHT is still there
        self.member.shutdown()
        self.dht.shutdown()
        if self.access:
            self.access.close()
        self.console.print("left the swarm. Goodbye!")
