"""`ttt train --stream`: one volunteer's peer in a collaborative (hivemind) training run.

The peer joins the run's DHT, downloads the current state from the other peers, then loops:
a batch from the streaming loader -> forward/backward -> `hivemind.Optimizer.step()`, which
accumulates samples until the swarm reaches `--target-batch-size`, averages the gradients
(8-bit for large tensors, fp16 for the rest), and applies 8-bit LAMB on the CPU (with --local-steps,
DiLoCo's outer rounds instead: training/peer/rounds.py). Each new global step publishes this peer's
signed metrics to the DHT and prints a progress line; every N steps (and on Ctrl-C) it writes a local
checkpoint.

`Peer` is the loop; what happens around it belongs to its collaborators, each in its own module:
    view.RunView              the others' records, read in the background; token renewal; pings
    rounds.GlobalSteps | OuterRounds   how this peer averages, chosen once
    joining.JoinHold          the hold this peer asks of the swarm while it downloads the state
    health.Health             rollback of non-finite parameters, lineage repair; the final agreement
    report.ProgressReport     the published record and the progress lines
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from rich.console import Console
from safetensors.torch import load_file

from pipeline.core.devices import pick_device
from pipeline.core.sources import local_copy
from pipeline.core.stream import index_dataset
from training.auth.guard import start_access
from training.calc.memory import describe_model
from training.checkpoint import STREAM_STATE, TRAINING_STATE, WEIGHTS, latest_checkpoint, read_config, save_checkpoint
from training.config import PeerSettings, model_config
from training.metrics import PeerMetrics, make_validators
from training.model import DalleTransformer
from training.peer.compute_time import ComputeTime
from training.peer.health import Health, agree_on_final_parameters
from training.peer.joining import JoinHold
from training.peer.overlap import OverlappedOuterRounds
from training.peer.report import ProgressReport
from training.peer.rounds import GlobalSteps, Mode, OuterRounds
from training.peer.setup import TrainError, check_resumable, checkpoint_info, choose_batch_size, make_stream
from training.peer.stopping import LEAVE_MARGIN, StopSignals
from training.peer.view import RunView, check_same_settings
from training.swarm.dht import choose_reachability, refuse_silent_initial_peers, start_dht
from training.swarm.processes import HIVEMIND_LOG, log_hivemind_to, quiet_hivemind_children
from training.swarm.wiring import make_optimizer


class Peer:
    """The training loop of one peer, with its checkpoints and clean exit."""

    def __init__(self, settings: PeerSettings, console: Console | None = None) -> None:
        self.console = console or Console(soft_wrap=True)  # progress lines stay whole for logs and scripts
        refuse_silent_initial_peers(settings.initial_peers)
        self.stop = StopSignals(self.console, settings.averaging_timeout + LEAVE_MARGIN)
        self.access = start_access(settings, self.console)  # a volunteer who is not admitted hears so at once
        if settings.threads:
            torch.set_num_threads(settings.threads)
        self.device = torch.device(pick_device(settings.device))
        self.config = model_config(settings.preset, settings.tokenizer)
        self.dataset = settings.dataset if settings.stream else local_copy(settings.dataset)
        if self.dataset != settings.dataset:
            self.console.print(f"training from a local copy of {settings.dataset}: {self.dataset}")
        # Refuse a dataset made for another model (codebook, grid) before joining anyone.
        self.index = index_dataset(self.dataset, self.config.codebook_size, (self.config.grid, self.config.grid))
        batch_size = choose_batch_size(settings, self.config, self.device, self.console)
        self.settings = settings = dataclasses.replace(settings, batch_size=batch_size)
        if settings.resume:
            check_resumable(settings, self.config)
        validators, public_key = make_validators(settings.run_id)
        log_hivemind_to(Path(settings.checkpoint_dir) / HIVEMIND_LOG)
        self.console.print(f"hivemind's own log: {Path(settings.checkpoint_dir) / HIVEMIND_LOG}")
        self.settings = settings = choose_reachability(settings, self.console)
        with quiet_hivemind_children():
            self.dht = start_dht(settings, validators, self.console, self.access)
        try:
            self.join_the_swarm(public_key)
        except BaseException:  # leave the swarm before reporting why we could not join it
            self.dht.shutdown()
            if self.access:
                self.access.close()
            raise

    def join_the_swarm(self, public_key: bytes) -> None:
        """The model, its hivemind optimizer and the collaborators of the loop."""
        settings = self.settings
        self.peer_id = self.dht.peer_id.to_base58()
        self.stream = make_stream(settings, self.config, self.dataset, self.index, self.peer_id, self.device)
        torch.manual_seed(settings.seed)
        self.model = DalleTransformer(self.config).to(self.device)
        self.console.print(f"model: {describe_model(self.config)}")
        admitted = self.access.admitted_peers if self.access else None
        with quiet_hivemind_children():
            self.optimizer = make_optimizer(settings, self.dht, self.model, admitted=admitted)
        self.view = RunView(self.dht, settings, self.optimizer.tracker, self.access, lambda: self.step)
        self.join_hold = JoinHold(self.view, self.publish, settings.join_timeout)
        self.mode = self.make_mode()
        self.report = ProgressReport(
            settings, self.console, self.dht, public_key, self.optimizer, self.mode, self.access,
            lambda: self.stream.epoch,  # the data epoch, of the stream a resume may replace
        )  # fmt: skip
        self.health = Health(self.model, self.optimizer, self.view, self.console, self.publish)
        self.compute_time = ComputeTime(self.optimizer.local_optimizers)

    def make_mode(self) -> Mode:
        if not self.settings.local_steps:
            return GlobalSteps(self.model, self.optimizer)
        rounds = OverlappedOuterRounds if self.settings.outer_overlap else OuterRounds
        return rounds(
            self.settings, self.optimizer, self.view, self.console, self.publish, self.catch_up, self.stopping
        )

    def stopping(self) -> bool:
        return self.stop.received is not None

    @property
    def step(self) -> int:
        return self.optimizer.local_epoch

    def resume_or_join(self) -> None:
        """Continue from our own checkpoint (--resume), then catch up with the swarm's current state."""
        settings = self.settings
        if settings.resume:
            self.resume(latest_checkpoint(Path(settings.checkpoint_dir)))
        if self.access:
            # Before anything else: the others answer this peer's averaging requests only once they can read it.
            self.access.start(self.dht)
        if settings.initial_peers:
            check_same_settings(self.view.read_now(), settings, self.report.aggregation, self.peer_id)
            self.join_hold.download_during_hold(self.download_to_join, self.mode.holds_step_for_first_batch)
            self.report.print_join(self.step)
        self.health.keep()

    def resume(self, step_dir: Path) -> None:
        """The model, optimizer and stream of our own checkpoint."""
        self.model.load_state_dict(load_file(str(step_dir / WEIGHTS)))
        if (step_dir / TRAINING_STATE).is_file():
            self.optimizer.load_state_dict(torch.load(step_dir / TRAINING_STATE, weights_only=False))
        if (step_dir / STREAM_STATE).is_file():
            state = json.loads((step_dir / STREAM_STATE).read_text())
            # Continue the data order this checkpoint was reading, whatever our peer id is now.
            seed = state["fingerprint"]["seed"]
            self.stream = make_stream(
                self.settings, self.config, self.dataset, self.index, self.peer_id, self.device, seed
            )
            self.stream.load_state_dict(state)
        self.console.print(f"resumed from {step_dir} (global step {read_config(step_dir)['step']})")

    def download_to_join(self) -> None:
        self.console.print("downloading the current state from peers")
        self.optimizer.load_state_from_peers()

    def run(self) -> None:
        """Train until --max-steps, or until a stop signal (training/peer/stopping.py): save and leave; on any failure
        leave the swarm before raising. Ctrl-C ends as an interrupt (exit 130), SIGTERM and SIGHUP as a clean exit."""
        started = time.perf_counter()
        # A stop signal only asks the loop to stop after the current batch: hivemind's background work must not be
        # cut mid-round, and the checkpoint must be written from a consistent state.
        with self.stop:
            try:
                self.resume_or_join()
                self.publish()  # monitors see the peer at once; --wait-for-peers counts it
                self.view.wait_for_peers(self.report.aggregation, self.console, self.stopping, self.keep_record)
                self.train_until_done()
                self.mode.settle()  # a round in flight ends before the checkpoint
                trained_until = time.monotonic()
            except BaseException:
                self.shutdown()
                raise
            if not self.stopping():
                self.mode.end_run()
            self.save()
            if not self.stopping():
                self.finish(time.perf_counter() - started, self.compute_time.shares(trained_until))
                return
            name = self.stop.received.name
            self.console.print(f"stopped by {name} at global step {self.step}: checkpoint saved, leaving the swarm")
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
            self.keep_record(losses)
            self.health.repair_if_split()
            if not self.reached_max_steps():  # a repair's download may bring the run's last step: none alone past it
                self.optimizer.step()
                self.optimizer.zero_grad()
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
            self.optimizer.zero_grad()
            self.health.restore_if_broken()  # the parameters themselves, rather than this batch, may be broken
            return None
        loss.backward()
        seconds = time.monotonic() - started
        self.report.batch_done(len(text), seconds)
        self.compute_time.batch_done(seconds)
        return loss.item()

    def training_done(self) -> bool:
        return self.stopping() or self.reached_max_steps()

    def reached_max_steps(self) -> bool:
        return self.settings.max_steps is not None and self.step >= self.settings.max_steps

    def catch_up(self) -> None:
        """DiLoCo: download the swarm's state during a hold, then show up at its outer step with H inner steps to
        take, which the others wait for."""
        self.join_hold.download_during_hold(self.optimizer.load_state_from_peers, until_first_batch=False)
        self.publish()

    def on_new_step(self, losses: list[float], skipped: int, previous_step: int) -> None:
        """A global step happened: guard against a poisoned state, report, publish, checkpoint."""
        if self.health.restore_if_broken():
            return
        self.health.keep()
        self.report.count_outliers()
        published = self.publish(losses)
        self.report.print_step(self.step, previous_step, losses, skipped, published)
        if self.step % self.settings.checkpoint_every == 0:
            self.save()

    def publish(self, losses: Sequence[float] = (), finished: bool = False) -> PeerMetrics:
        """Publish this peer's signed metrics record (on joining, after each global step, when finished); returns it."""
        self.health.remember_lineage(self.step)
        return self.report.publish(self.step, losses, finished, self.join_hold.until)

    def keep_record(self, losses: Sequence[float] = ()) -> None:
        """Publish this peer's record again once it is old (RECORD_REFRESH), within a global step too: an outer step
        or a wait for the run's first peers can outlast a record."""
        if self.report.record_due():
            self.publish(losses)

    def save(self) -> Path:
        return save_checkpoint(
            Path(self.settings.checkpoint_dir),
            self.model,
            self.step,
            checkpoint_info(self.settings, self.index),
            training_state=self.optimizer.state_dict(),
            stream_state=self.stream.state_dict(),
            tokenizer=self.settings.tokenizer,
        )

    def finish(self, seconds: float, compute_shares: tuple[float, float]) -> None:
        """Tell the swarm we are done, agree with the other finished peers on the final parameters, leave."""
        self.publish(finished=True)
        agree_on_final_parameters(self.step, self.view, self.mode, self.download_final_state)
        self.report.final_line(self.step, seconds, compute_shares)
        self.shutdown()

    def download_final_state(self, first: bool) -> None:
        """One try at the others' final state (the agreement tries every second); the console hears of the first."""
        if first:
            self.console.print("this peer ends with other parameters than the others: downloading their final state")
        self.optimizer.load_state_from_peers(then_train=False)
        if self.optimizer.downloads[-1].arrived:
            self.save()
            self.publish(finished=True)
        elif first:
            self.console.print("[yellow]no peer served the final state: trying again while the others wait[/]")

    def shutdown(self) -> None:
        self.optimizer.shutdown()
        self.dht.shutdown()
        if self.access:
            self.access.close()
        self.console.print("left the swarm. Goodbye!")


def train(settings: PeerSettings) -> None:
    """Run one peer until --max-steps global steps (or forever), checkpointing as it goes."""
    if not Path(settings.dataset).exists() and "://" not in settings.dataset:
        raise TrainError(f"--dataset {settings.dataset} does not exist; make one with `ttt preprocess`")
    Peer(settings).run()
