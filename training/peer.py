"""`ttt train --stream`: one volunteer's peer in a collaborative (hivemind) training run.

The peer joins the run's DHT, downloads the current state from the other peers, then loops:
a batch from the streaming loader -> forward/backward -> `hivemind.Optimizer.step()`, which
accumulates samples until the swarm reaches `--target-batch-size`, averages the gradients
(8-bit for large tensors, fp16 for the rest), and applies 8-bit LAMB on the CPU. Each new
global step publishes this peer's signed metrics to the DHT and prints a progress line;
every N steps (and on Ctrl-C) it writes a local checkpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path

import torch
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr
from rich.console import Console
from rich.markup import escape

from pipeline.core.devices import pick_device
from pipeline.core.errors import UserError
from pipeline.core.files import sha256_file
from pipeline.core.sources import local_copy
from pipeline.core.stream import CodeStream, index_dataset
from pipeline.core.text import load_tokenizer
from training.auth.guard import AdmittedPeers, RunAccess
from training.checkpoint import (
    STREAM_STATE,
    TOKENIZER,
    TRAINING_STATE,
    WEIGHTS,
    latest_checkpoint,
    read_config,
    save_checkpoint,
)
from training.compression import averaging_compression
from training.config import (
    AUTO,
    AVERAGE_STATE_EVERY,
    MAX_JOIN_HOLD,
    PRESETS,
    ModelConfig,
    MonitorSettings,
    PeerSettings,
    Preset,
    schedule_steps,
)
from training.diloco import DiLoCoOptimizer
from training.memory import GIB, architecture_of, estimate, largest_batch, needed_bytes, train_setup
from training.metrics import MAX_OUTLIER_SENDERS, PeerMetrics, make_validators, publish_metrics, read_metrics
from training.model import DalleTransformer, describe
from training.optimizer import ClippedLAMB8bit, linear_schedule
from training.robust import Aggregation
from training.swarm import ANNOUNCE_WAIT, RELEASE_DELAY, JoinHolds, SwarmOptimizer, fingerprint

REJOIN_EVERY = 10.0  # seconds between pings of --initial-peers, which put this peer back into their DHT tables
LATE_ROUND_WAIT = 3.0  # seconds a DiLoCo peer whose round found nobody looks whether the others went on without it
CATCH_UP_WINDOW = 10  # global steps: two catch-up downloads within this many make a peer one that keeps falling behind
LINEAGE_STEPS = 4  # global steps back that a peer compares its lineage with the others' (records arrive late)
FINISH_WAIT = 60.0  # seconds a finished peer waits for the others to finish their last step
AUTO_SHARE = 0.9  # --batch-size auto fills this share of the free memory: the rest is for everything else


class TrainError(UserError):
    pass


def parse_initial_peers(addresses: list[str]) -> list[str]:
    for address in addresses:
        try:
            Multiaddr(address)
        except Exception as err:  # multiaddr raises several error types for malformed addresses
            raise TrainError(
                f"--initial-peers {address!r} is not a multiaddress ({err}); copy one the first peer printed"
            ) from None
    return addresses


async def ping_peers(peer_ids: Sequence[str], dht, node) -> None:
    """Inside the DHT's process: ping these peers, which adds them to this node's routing table and this node to
    theirs (`DHT.run_coroutine`)."""
    from hivemind.p2p import PeerID

    await asyncio.gather(*(node.protocol.call_ping(PeerID.from_base58(peer_id)) for peer_id in peer_ids))


def thread_error_in_one_line(args: threading.ExceptHookArgs) -> None:
    print(f"hivemind {args.thread.name}: {args.exc_type.__name__}: {args.exc_value}", file=sys.stderr, flush=True)


@contextmanager
def quiet_hivemind_children() -> Iterator[None]:
    """Processes forked inside (hivemind's DHT and averagers) ignore Ctrl-C and report thread errors in one line.

    A terminal's Ctrl-C reaches the whole process group: only the main process acts on it, then shuts
    the children down in order. The Ctrl-C also stops hivemind's p2p daemon (Go turns an ignored SIGINT
    back on), so an averager leaving afterwards cannot unregister from it; by then the checkpoint is saved.
    """
    previous_handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    previous_hook, threading.excepthook = threading.excepthook, thread_error_in_one_line
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous_handler)
        threading.excepthook = previous_hook


def quiet_hivemind_logs() -> None:
    """hivemind's background processes log cancelled matchmaking futures and teardown noise that says nothing
    about the run; our own progress lines and errors say what matters."""
    hivemind_logger = logging.getLogger("hivemind")
    hivemind_logger.setLevel(logging.ERROR)
    for handler in hivemind_logger.handlers:
        handler.addFilter(without_traceback)
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)


def start_access(settings: PeerSettings | MonitorSettings, console: Console) -> RunAccess | None:
    """An authenticated run's key, token and checks (before anything of hivemind's reads the process key)."""
    if settings.auth is None:
        return None
    access = RunAccess(settings.auth, settings.run_id, settings.identity_path, console)
    console.print(
        f"admitted to run {settings.run_id!r} as {access.username} (token valid until "
        f"{access.state.token().expiration_time})"
    )
    return access


def start_dht(settings: PeerSettings | MonitorSettings, validators: list, console: Console, access: RunAccess | None):
    import hivemind

    initial_peers = parse_initial_peers(settings.initial_peers)
    try:
        with access.identity_file() if access else nullcontext(settings.identity_path) as identity_path:
            dht = hivemind.DHT(
                start=True,
                initial_peers=initial_peers,
                host_maddrs=settings.host_maddrs,
                announce_maddrs=settings.announce_maddrs or None,
                client_mode=settings.client_mode,
                identity_path=identity_path,
                record_validators=validators,
                authorizer=access.authorizer if access else None,
            )
    except Exception as err:  # hivemind surfaces p2pd failures as several exception types
        if initial_peers:
            admission = (
                "that those peers run with the same --authority-key"
                if access
                else "whether the run needs authentication (--authority-key with --token or --auth-server)"
            )
            raise TrainError(
                f"cannot reach any of --initial-peers ({err}); check the addresses, that those peers are running, "
                f"and {admission}"
            ) from None
        raise TrainError(f"cannot start the DHT on {settings.host_maddrs}: {err}") from None
    if settings.client_mode:
        console.print(f"joined as a client-mode peer {dht.peer_id} (others cannot dial it)")
    else:
        console.print("other peers can join with --initial-peers and one of:")
        for address in dht.get_visible_maddrs():
            print(address, flush=True)  # each on a line of its own, for scripts
    return dht


def find_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise TrainError(f"--preset {name!r} is unknown; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def model_config(settings: PeerSettings) -> ModelConfig:
    """The preset's model, with the tokenizer's vocabulary and pad id."""
    tokenizer = load_tokenizer(settings.tokenizer)
    preset = find_preset(settings.preset).model.to_dict()
    return ModelConfig(**{**preset, "text_vocab_size": tokenizer.vocab_size, "pad_id": tokenizer.pad_id})


def check_resumable(settings: PeerSettings, config: ModelConfig) -> None:
    """--resume continues the checkpoint's model with the tokenizer it was trained with; refuse anything else."""
    step_dir = latest_checkpoint(Path(settings.checkpoint_dir))
    info = read_config(step_dir)
    saved = step_dir / TOKENIZER if info.get("tokenizer") == TOKENIZER else None
    given = settings.tokenizer
    same_tokenizer = saved is None and given is None
    if saved is not None and given is not None:
        same_tokenizer = sha256_file(saved) == sha256_file(given)
    if not same_tokenizer:
        remedy = f"resume with --tokenizer {saved}" if saved else "resume without --tokenizer"
        raise TrainError(f"{step_dir} was trained with another tokenizer than {given or 'bytes'!r}; {remedy}")
    if info["model"] != config.to_dict():
        raise TrainError(f"{step_dir} holds a different model than --preset {settings.preset}")
    if info.get("local_steps", 0) != settings.local_steps:
        raise TrainError(
            f"{step_dir} was trained with {mode_flags(info.get('local_steps', 0))}; resume with the same "
            "(its optimizer state is of that mode)"
        )


def free_memory(device: torch.device) -> int:
    """Bytes this device can still give: the GPU's free memory, or the RAM the kernel can hand out (MemAvailable)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def choose_batch_size(settings: PeerSettings, config: ModelConfig, device: torch.device, console: Console) -> int:
    """The batch this peer trains with: --batch-size if the memory calculator says it fits this device, or with
    --batch-size auto the largest that fits in AUTO_SHARE of its free memory (at most --target-batch-size)."""
    model = architecture_of(settings.preset, config)
    setup = partial(train_setup, config, local_steps=settings.local_steps)  # the setup at a batch size
    on_gpu = device.type == "cuda"
    budget = free_memory(device)
    if settings.max_memory is not None:
        budget = min(budget, round(settings.max_memory * GIB))
    if settings.batch_size == AUTO:
        usable = int(AUTO_SHARE * budget)
        batch = largest_batch(model, setup(1), usable, on_gpu, limit=settings.target_batch_size)
        if batch == 0:
            needed = needed_bytes(estimate(model, setup(1)), on_gpu)
            raise TrainError(
                f"--preset {settings.preset} needs about {needed / GIB:.2f} GiB on {device} even at batch 1, and "
                f"{usable / GIB:.2f} GiB can be used; use a smaller preset, or a device with more memory"
            )
        needed = needed_bytes(estimate(model, setup(batch)), on_gpu)
        console.print(
            f"--batch-size auto: {batch} (needs about {needed / GIB:.2f} GiB of the {budget / GIB:.2f} GiB "
            f"free on {device}, keeping {1 - AUTO_SHARE:.0%} spare)"
        )
        return batch
    result = estimate(model, setup(settings.batch_size))
    needed = needed_bytes(result, on_gpu)
    if needed > budget:
        raise TrainError(
            f"--preset {settings.preset} with --batch-size {settings.batch_size} needs about {needed / GIB:.2f} GiB "
            f"on {device} (activations {result.activations / GIB:.2f} GiB of it), which has {budget / GIB:.2f} GiB "
            "free; lower --batch-size, or let --batch-size auto choose (`ttt calc` shows the terms)"
        )
    return settings.batch_size


def make_optimizer(
    settings: PeerSettings,
    dht,
    model: DalleTransformer,
    auxiliary: bool = False,
    admitted: AdmittedPeers | None = None,
) -> SwarmOptimizer:
    """The peer's hivemind optimizer; `auxiliary`: a monitor's, which only helps the others average; `admitted`:
    in an authenticated run, the check its averagers make of every caller."""
    preset = find_preset(settings.preset)
    learning_rate = settings.learning_rate or preset.learning_rate
    total_steps = settings.total_steps or schedule_steps(
        preset, settings.local_steps, settings.target_batch_size, int(settings.batch_size)
    )
    compression = averaging_compression()
    local_optimizer = partial(ClippedLAMB8bit, lr=learning_rate, max_grad_norm=settings.max_grad_norm)
    common = dict(
        dht=dht,
        run_id=settings.run_id,
        target_batch_size=settings.target_batch_size,
        batch_size_per_step=None if auxiliary else settings.batch_size,
        auxiliary=auxiliary,
        offload_optimizer=True,
        # Steps and state rounds finish inside step(), so a checkpoint never races a background update.
        delay_optimizer_step=False,
        delay_state_averaging=False,
        matchmaking_time=settings.matchmaking_time,
        averaging_timeout=settings.averaging_timeout,
        client_mode=settings.client_mode,
        # hivemind warns (rare matchmaking deadlocks) unless requests time out sooner than matchmaking ends.
        averager_opts={"request_timeout": min(3.0, settings.matchmaking_time / 2)},
        verbose=False,
        aggregation=Aggregation(settings.aggregation, settings.clip_tau),
        admitted=admitted,
    )
    if settings.local_steps:
        schedule = linear_schedule(total_steps)
        return DiLoCoOptimizer(
            params=model.parameters(),
            inner_optimizer=local_optimizer,
            inner_learning_rate=lambda step: learning_rate * schedule(step),
            local_steps=settings.local_steps,
            outer_lr=settings.outer_lr,
            outer_momentum=settings.outer_momentum,
            compression=compression,
            **common,
        )
    return SwarmOptimizer(
        params=model.parameters(),
        optimizer=local_optimizer,
        scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, linear_schedule(total_steps)),
        # Gradient averaging keeps peers in step; averaging the (8-bit compressed) parameters themselves
        # only corrects drift, and every round adds quantisation noise, so it runs every 10 steps.
        average_state_every=AVERAGE_STATE_EVERY,
        grad_compression=compression,
        state_averaging_compression=compression,
        **common,
    )


def without_traceback(record: logging.LogRecord) -> bool:
    """A log filter that keeps a record's message but drops its traceback (hivemind logs recoverable
    averaging failures, such as finding no group for a round, with full tracebacks)."""
    record.exc_info, record.exc_text = None, None
    return True


def mode_flags(local_steps: int) -> str:
    """The option that sets how a run averages, as a peer publishes it (`PeerMetrics.local_steps`)."""
    return f"--local-steps {local_steps}" if local_steps else "--local-steps 0 (synchronous)"


def aggregation_flags(aggregation: str) -> str:
    """The options that set an aggregation published as "mean" or "centered-clip:TAU"."""
    method, _, tau = aggregation.partition(":")
    return f"--aggregation {method}" + (f" --clip-tau {tau}" if tau else "")


def outliers_by_sender(outliers: Counter[tuple[str, str]]) -> Counter[str]:
    """Sender peer id -> its pieces dropped or clipped."""
    by_sender: Counter[str] = Counter()
    for (sender, _), count in outliers.items():
        by_sender[sender] += count
    return by_sender


def outlier_totals(outliers: Counter[tuple[str, str]]) -> dict[str, int]:
    """ "dropped" and "clipped" -> pieces, over all senders."""
    return {kind: sum(n for (_, k), n in outliers.items() if k == kind) for kind in ("dropped", "clipped")}


def outliers_note(outliers: Counter[tuple[str, str]]) -> str:
    """For the progress line: the pieces the step's rounds dropped or clipped, and who sent most of them."""
    if not outliers:
        return ""
    counts = outlier_totals(outliers)
    sender, count = outliers_by_sender(outliers).most_common(1)[0]
    done = ", ".join(f"{kind} {n}" for kind, n in counts.items() if n)
    return f" | {done} parts ({count} from ...{sender[-8:]})"


def falling_behind_advice(batch_size: int, batch_seconds: float, swarm_step_seconds: float) -> str:
    """What a peer that keeps falling behind can do: make its batch fit in one of the swarm's steps."""
    fitting = int(batch_size * swarm_step_seconds / max(batch_seconds, 1e-9) / 2)
    situation = (
        "this peer keeps falling behind the swarm and downloading its state instead of training (a batch of "
        f"{batch_size} takes {batch_seconds:.1f} s here, a global step of the swarm {swarm_step_seconds:.1f} s)"
    )
    if fitting >= 1:
        return f"{situation}; use --batch-size {fitting} so that its batches arrive before the swarm's rounds"
    return f"{situation}; even a batch of 1 would arrive late: this device is too slow for this run's global steps"


class LastGoodState:
    """A CPU copy of the parameters after the last healthy global step, to roll back a poisoned one."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.keep(model)

    def keep(self, model: torch.nn.Module) -> None:
        self.parameters = [p.detach().cpu().clone() for p in model.parameters()]

    @torch.no_grad()
    def restore_if_broken(self, model: torch.nn.Module) -> bool:
        """If any parameter is NaN or infinite, copy the last good values back and return True.

        One sum per tensor and one check of their total: a NaN or an infinity anywhere makes it non-finite, and
        healthy parameters never add up past float32's range (checking each tensor took 10x longer)."""
        sums = torch.stack([p.sum(dtype=torch.float32) for p in model.parameters()])
        if torch.isfinite(sums.sum()):
            return False
        for parameter, good in zip(model.parameters(), self.parameters, strict=True):
            parameter.copy_(good)
        return True


class Peer:
    """The training loop of one peer, with its progress, metrics, checkpoints and clean exit."""

    def __init__(self, settings: PeerSettings, console: Console | None = None) -> None:
        self.settings = settings
        self.stop_requested = False
        self.console = console or Console(soft_wrap=True)  # progress lines stay whole for logs and scripts
        quiet_hivemind_logs()
        self.access = start_access(settings, self.console)  # a volunteer who is not admitted hears so at once
        if settings.threads:
            torch.set_num_threads(settings.threads)
        self.device = torch.device(pick_device(settings.device))
        validators, self.public_key = make_validators(settings.run_id)
        self.config = model_config(settings)
        self.dataset = settings.dataset if settings.stream else local_copy(settings.dataset)
        if self.dataset != settings.dataset:
            self.console.print(f"training from a local copy of {settings.dataset}: {self.dataset}")
        # Refuse a dataset made for another model (codebook, grid) before joining anyone.
        self.index = index_dataset(self.dataset, self.config.codebook_size, (self.config.grid, self.config.grid))
        batch_size = choose_batch_size(settings, self.config, self.device, self.console)
        self.settings = settings = dataclasses.replace(settings, batch_size=batch_size)
        if settings.resume:
            check_resumable(settings, self.config)
        with quiet_hivemind_children():
            self.dht = start_dht(settings, validators, self.console, self.access)
        try:
            self.stream = self.make_stream()
            torch.manual_seed(settings.seed)
            self.model = DalleTransformer(self.config).to(self.device)
            self.console.print(f"model: {describe(self.config)}")
            admitted = self.access.admitted_peers if self.access else None
            with quiet_hivemind_children():
                self.optimizer = make_optimizer(settings, self.dht, self.model, admitted=admitted)
            self.peer_id = self.dht.peer_id.to_base58()
            self.display_name = settings.display_name or self.peer_id[-8:]
            self.aggregation = str(Aggregation(settings.aggregation, settings.clip_tau))
            self.joins = JoinHolds(self.dht, settings.run_id, self.optimizer.tracker, self.revoked)
            self.batch_seconds = 0.0  # moving average of one batch's forward + backward here
            self.step_seen_at = time.monotonic()  # when this peer last saw the global step change
            self.catch_ups: list[int] = []  # global steps at which this peer caught up by downloading the state
            self.advised_at = -CATCH_UP_WINDOW
            self.joining = False  # announced, and not yet released the step the swarm holds for it
            self.joining_until = 0.0  # published: the swarm holds its step for this peer until then
            self.total_samples = 0
            self.downloads_reported = 0
            self.last_good = LastGoodState(self.model)
            self.refusals_reported = 0
            self.outliers: Counter[tuple[str, str]] = Counter()  # (sender, "dropped" | "clipped") -> pieces, so far
            self.last_outliers: Counter[tuple[str, str]] = Counter()  # those of the last global step
            self.own_lineages: dict[int, str] = {}  # global step -> the lineage this peer published at it (a few)
            self.sent_bytes = 0  # what this peer's averagers sent to other peers, as of the last global step
            # DiLoCo: peer id -> (outer step, inner steps) of a record that this peer waited for until the timeout;
            # it is not waited for again until it changes (a peer that left keeps its record for a while).
            self.waited_in_vain: dict[str, tuple[int, int]] = {}
            # A peer frozen for a few seconds (a laptop's sleep, a swapping machine) and the peers it knew drop each
            # other from their DHT tables; two peers then no longer read each other's records, and each trains
            # alone for good (seen with two peers, one frozen 12 s). Pinging the initial peers puts them back.
            self.initial_peer_ids = [Multiaddr(address)["p2p"] for address in settings.initial_peers]
            self.next_rejoin = time.monotonic() + REJOIN_EVERY
        except BaseException:  # leave the swarm before reporting why we could not join it
            self.dht.shutdown()
            if self.access:
                self.access.close()
            raise

    def make_stream(self, seed: int | None = None) -> CodeStream:
        """The loader; without a seed, each volunteer reads its own order, seeded by its peer identity."""
        settings, config = self.settings, self.config
        return CodeStream(
            self.dataset,
            batch_size=settings.batch_size,
            text_len=config.text_len,
            codebook_size=config.codebook_size,
            grid=(config.grid, config.grid),
            num_workers=settings.loader_workers,
            peer=self.dht.peer_id.to_base58(),
            seed=seed,
            pin_memory=self.device.type == "cuda",
            tokenizer=settings.tokenizer,
            index=self.index,
        )

    @property
    def step(self) -> int:
        return self.optimizer.local_epoch

    def resume_or_join(self) -> None:
        """Continue from our own checkpoint (--resume), then catch up with the swarm's current state."""
        settings = self.settings
        if settings.resume:
            step_dir = latest_checkpoint(Path(settings.checkpoint_dir))
            info = read_config(step_dir)
            from safetensors.torch import load_file

            self.model.load_state_dict(load_file(str(step_dir / WEIGHTS)))
            if (step_dir / TRAINING_STATE).is_file():
                self.optimizer.load_state_dict(torch.load(step_dir / TRAINING_STATE, weights_only=False))
            if (step_dir / STREAM_STATE).is_file():
                state = json.loads((step_dir / STREAM_STATE).read_text())
                # Continue the data order this checkpoint was reading, whatever our peer id is now.
                self.stream = self.make_stream(seed=state["fingerprint"]["seed"])
                self.stream.load_state_dict(state)
            self.console.print(f"resumed from {step_dir} (global step {info['step']})")
        if self.access:
            # Before anything else: the others answer this peer's averaging requests only once they can read it.
            self.access.start(self.dht)
        if settings.initial_peers:
            self.check_same_settings(read_metrics(self.dht, settings.run_id, self.revoked()))
            if settings.join_timeout > 0:
                self.announce_join()
                # Synchronous: released with the first batch. DiLoCo: this peer's record at the swarm's outer step,
                # with its inner steps to take, holds the round instead.
                self.joining = not self.diloco
            self.console.print("downloading the current state from peers")
            self.optimizer.load_state_from_peers()
            if self.diloco:
                self.joining_until = 0.0  # published at once by run()
            seconds = self.optimizer.download_seconds[-1]
            self.console.print(f"synchronised at global step {self.step} (state downloaded in {seconds:.1f} s)")
            self.downloads_reported = len(self.optimizer.download_seconds)
        self.last_good.keep(self.model)

    def run(self) -> None:
        """Train until --max-steps; on Ctrl-C save and leave; on any failure leave the swarm before raising."""
        started = time.perf_counter()
        # Ctrl-C only asks the loop to stop after the current batch: hivemind's background work must not be
        # cut mid-round, and the checkpoint must be written from a consistent state. A second Ctrl-C forces.
        previous_handler = signal.signal(signal.SIGINT, self.request_stop)
        try:
            self.resume_or_join()
            self.publish()  # monitors see the peer at once; --wait-for-peers counts it
            self.wait_for_peers()
            self.train_until_done()
        except BaseException:
            self.shutdown()
            raise
        finally:
            signal.signal(signal.SIGINT, previous_handler)
        self.save()
        if self.stop_requested:
            self.console.print(f"interrupted at global step {self.step}: checkpoint saved, leaving the swarm")
            self.shutdown()
            raise KeyboardInterrupt
        self.finish(time.perf_counter() - started)

    def request_stop(self, signum: int, frame: object) -> None:
        if self.stop_requested:
            raise KeyboardInterrupt
        self.stop_requested = True

    def train_until_done(self) -> None:
        """Batches until --max-steps or Ctrl-C, checked before drawing the next batch: a checkpoint's stream position
        is then that of the last batch trained on."""
        last_step, losses, skipped = self.step, [], 0
        if self.diloco and self.optimizer.round_due:  # resumed from a checkpoint saved while waiting for a round
            self.outer_round(losses)
            if self.step != last_step:
                self.on_new_step(losses, skipped, last_step)
                last_step = self.step
        if self.training_done():
            return
        for batch in self.stream:
            started = time.monotonic()
            text, codes = batch["text"].to(self.device), batch["codes"].to(self.device)
            loss = self.model(text, codes)["loss"]
            if not torch.isfinite(loss):  # never feed a non-finite gradient to the swarm
                skipped += 1
                self.optimizer.zero_grad()
                self.restore_if_broken()  # the parameters themselves, rather than this batch, may be broken
                continue
            loss.backward()
            losses.append(loss.item())
            self.total_samples += len(text)
            seconds = time.monotonic() - started
            self.batch_seconds = 0.8 * self.batch_seconds + 0.2 * seconds if self.batch_seconds else seconds
            if self.joining:
                self.release_join()
            self.tick()
            self.repair_if_split()
            self.optimizer.step()
            self.optimizer.zero_grad()
            if self.diloco and self.optimizer.round_due:
                self.outer_round(losses)
            if self.step != last_step:
                self.on_new_step(losses, skipped, last_step)
                last_step, losses, skipped = self.step, [], 0
            if self.training_done():
                return

    def training_done(self) -> bool:
        max_steps = self.settings.max_steps
        return self.stop_requested or (max_steps is not None and self.step >= max_steps)

    @property
    def diloco(self) -> bool:
        return self.settings.local_steps > 0

    def outer_round(self, losses: Sequence[float]) -> None:
        """DiLoCo: this peer took its H inner steps. It says so, waits until the other peers of this outer step have
        too (at most --averaging-timeout), averages with those that are ready and takes the outer step. A peer that
        finds the swarm at a later outer step, having gone on without it, downloads the swarm's state instead."""
        self.publish(losses)  # inner_steps == H: the others see that this peer is ready
        deadline = time.monotonic() + self.settings.averaging_timeout
        waiting_for = self.peers_to_wait_for()
        while not self.stop_requested and not self.swarm_ahead():
            if not (waiting_for and time.monotonic() < deadline) and not self.join_held():
                break
            time.sleep(0.1)
            self.tick()
            waiting_for = self.peers_to_wait_for()
        if self.stop_requested:
            return  # the checkpoint keeps this state: a resumed peer takes this round first
        if time.monotonic() >= deadline:
            self.waited_in_vain.update({m.peer_id: (m.step, m.inner_steps) for m in waiting_for})
        if not self.swarm_ahead():
            with_others = any(m.step == self.step and m.inner_steps >= self.settings.local_steps for m in self.others())
            members, same_start = self.optimizer.average_pseudo_gradients(with_others, give_up=self.swarm_ahead)
            if with_others and len(members) == 1:
                failure = escape(self.optimizer.round_failure)  # an exception's text may hold [brackets]
                self.console.print(f"[yellow]outer step {self.step}: the round with the others failed ({failure})[/]")
            if not same_start:
                self.console.print(
                    f"[yellow]outer step {self.step}: this peer's parameters had left the others': downloading the "
                    "state they reach[/]"
                )
                self.swarm_ahead(wait=self.settings.averaging_timeout)
            # A round that failed for this peer may have succeeded for the others, even for their last outer step.
            elif len(members) > 1 or not (with_others and self.swarm_ahead(wait=LATE_ROUND_WAIT, finished_too=True)):
                self.optimizer.apply_outer_step(members)
                return
        self.catch_up()

    def announce_join(self) -> None:
        """Ask the swarm to hold its step (its round, with DiLoCo) while this peer downloads the state, and wait until
        the others can have read it: the state downloaded is then that of the step they hold."""
        self.joining_until = get_dht_time() + self.settings.join_timeout
        self.publish()
        time.sleep(ANNOUNCE_WAIT)

    def catch_up(self) -> None:
        """DiLoCo: download the swarm's state during a hold, then show up at its outer step with H inner steps to
        take, which the others wait for."""
        if self.settings.join_timeout > 0:
            self.announce_join()
        self.optimizer.load_state_from_peers()
        self.joining_until = 0.0
        self.publish()

    def join_held(self) -> bool:
        """DiLoCo: whether another peer asked the swarm to hold its round while it downloads the state."""
        now = get_dht_time()
        return any(now < m.joining_until <= now + MAX_JOIN_HOLD for m in self.others())

    def tick(self) -> None:
        """What the training loop does between batches besides training: read the run's records, renew the token,
        greet the initial peers again."""
        self.joins.refresh()
        if self.access:
            self.access.tick()
        if self.settings.initial_peers and time.monotonic() >= self.next_rejoin:
            self.next_rejoin = time.monotonic() + REJOIN_EVERY
            self.dht.run_coroutine(partial(ping_peers, self.initial_peer_ids), return_future=True)

    def others(self, finished_too: bool = False) -> list[PeerMetrics]:
        """The other peers of the run still training (with `finished_too`, also those that finished), as of the last
        read of their records."""
        return [m for m in self.joins.records if m.peer_id != self.peer_id and (finished_too or not m.finished)]

    def peers_to_wait_for(self) -> list[PeerMetrics]:
        """DiLoCo: the peers of this outer step that have not taken their H inner steps yet, and the members of this
        peer's last round whose records still show the previous outer step (they are publishing the new one)."""
        last_members = set(self.optimizer.last_members)
        return [
            m
            for m in self.others()
            if not self.given_up_on(m)
            and (
                (m.step == self.step and m.inner_steps < self.settings.local_steps)
                or (m.step == self.step - 1 and m.peer_id in last_members)
            )
        ]

    def given_up_on(self, record: PeerMetrics) -> bool:
        """DiLoCo: whether this peer waited for that one until the timeout, and its record has not changed since (it
        left without a goodbye, or froze): it holds up neither a round nor this peer's finish again."""
        return self.waited_in_vain.get(record.peer_id) == (record.step, record.inner_steps)

    def swarm_ahead(self, wait: float = 0.0, finished_too: bool = False) -> bool:
        """Whether another peer is at a later outer step than this one, as of the latest read; with `wait`, look for
        so many seconds. With `finished_too`, a peer that finished counts as well (it waits for the peers behind it,
        as in `finish()`)."""
        deadline = time.monotonic() + wait
        while True:
            self.tick()
            if any(m.step > self.step for m in self.others(finished_too)):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def release_join(self) -> None:
        """The first batch is ready: every peer, this one too, ends the held step at one moment, a little ahead."""
        self.joining, self.joining_until = False, get_dht_time() + RELEASE_DELAY
        self.joins.hold(self.joining_until)
        self.publish()

    def on_new_step(self, losses: list[float], skipped: int, previous_step: int) -> None:
        """A global step happened: guard against a poisoned state, report, publish, checkpoint.

        A peer that fell more than a step behind (a slow machine, a lost round) downloads the swarm's state
        inside `optimizer.step()` and jumps ahead; the progress line says so instead of silently skipping.
        """
        if self.restore_if_broken():
            return
        self.last_good.keep(self.model)
        self.count_outliers()
        published = self.publish(losses)
        tracker = self.optimizer.tracker
        mean_loss = sum(losses) / len(losses) if losses else math.nan
        peers, speed = tracker.global_progress.num_peers, tracker.performance_ema.samples_per_second
        downloads = self.optimizer.download_seconds[self.downloads_reported :]
        self.downloads_reported += len(downloads)
        together = "state downloaded" if downloads else f"round {self.optimizer.last_round_size}"
        jumped = self.step > previous_step + 1
        step = f"outer step {self.step:>4}" if self.diloco else f"step {self.step:>5}"
        # DiLoCo's peers of one round hold the same bits: their fingerprints say so.
        mode = (
            f" | DiLoCo every {self.settings.local_steps} local steps | parameters {published.parameters_hash[:8]}"
            if self.diloco
            else ""
        )
        self.console.print(
            f"{step} | data epoch {self.stream.epoch} | loss {mean_loss:.4f} | peers {peers}"
            f" | {together}{mode} | {speed:,.1f} samples/s"
            + (f" | skipped {skipped} non-finite batches" if skipped else "")
            + outliers_note(self.last_outliers)
            + (f" | caught up from step {previous_step}" if jumped else "")
            + (f" in {sum(downloads):.1f} s" if downloads and jumped else "")
            + self.refusals_note()
        )
        if downloads and jumped:
            self.on_catch_up(previous_step)
        self.step_seen_at = time.monotonic()
        if self.step % self.settings.checkpoint_every == 0:
            self.save()

    def restore_if_broken(self) -> bool:
        """Non-finite parameters go back to the last good ones, then to the swarm's state; True if they were."""
        if not self.last_good.restore_if_broken(self.model):
            return False
        self.console.print("[red]non-finite parameters: rolled back to the last good state[/]")
        if self.optimizer.tracker.global_progress.num_peers > 1:
            self.optimizer.load_state_from_peers()
        return True

    def count_outliers(self) -> None:
        """What this peer's averagers dropped or clipped in the step's rounds, and since it started (asked only when
        there are others to average with: each question is a round trip to two processes)."""
        if self.optimizer.tracker.global_progress.num_peers <= 1:
            self.last_outliers = Counter()
            return
        self.sent_bytes = sum(self.optimizer.sent_bytes().values())
        counts = Counter(self.optimizer.outlier_counts())
        self.last_outliers, self.outliers = counts - self.outliers, counts

    def check_same_settings(self, records: Collection[PeerMetrics]) -> None:
        """A run averages one way (every global step or every H local steps) and reduces one way: a peer set
        otherwise is refused before it takes part in any round."""
        others = [m for m in records if not m.finished and m.peer_id != self.peer_id]
        modes = sorted({m.local_steps for m in others})
        if modes and modes != [self.settings.local_steps]:
            raise TrainError(
                f"run {self.settings.run_id!r} trains with {mode_flags(modes[0])}, this peer with "
                f"{mode_flags(self.settings.local_steps)}; join with the run's setting"
            )
        theirs = sorted({m.aggregation for m in others})
        if theirs and theirs != [self.aggregation]:
            raise TrainError(
                f"run {self.settings.run_id!r} averages with {aggregation_flags(theirs[0])}, this peer with "
                f"{aggregation_flags(self.aggregation)}; join with the run's setting"
            )

    def repair_if_split(self) -> None:
        """Mid-run repair: when more peers held another lineage than this one's at a recent global step (its round
        failed, or averaged without them), download the swarm's state at once rather than at a later state round.

        The run's records come from the last read, a batch or so old, so each is compared with this peer's lineage
        at the record's step."""
        others: dict[int, Counter[str]] = {}
        for m in self.joins.records:
            if m.peer_id != self.peer_id and m.lineage and m.step in self.own_lineages:
                others.setdefault(m.step, Counter())[m.lineage] += 1
        for step, lineages in sorted(others.items(), reverse=True):
            mine = self.own_lineages[step]
            majority, holders = lineages.most_common(1)[0]
            if majority != mine and holders > lineages[mine] + 1:
                self.console.print(
                    f"[yellow]step {step}: {holders} peers held parameters that this one's had left (a round without "
                    "them): downloading the swarm's state now[/]"
                )
                self.optimizer.load_state_from_peers()
                self.last_good.keep(self.model)
                self.own_lineages = {}  # what this peer held before says nothing of what it holds now
                self.publish()
                return

    def revoked(self) -> Collection[str]:
        """The users the organiser removed from this run (none in an open run)."""
        return self.access.state.revocations().revoked if self.access else ()

    def refusals_note(self) -> str:
        """For the progress line: requests from unadmitted peers refused since the last line (each is logged)."""
        if self.access is None:
            return ""
        refused = sum(self.access.refused_counts().values())
        new, self.refusals_reported = refused - self.refusals_reported, refused
        return f" | refused {new} unadmitted requests" if new else ""

    def on_catch_up(self, previous_step: int) -> None:
        """A peer that keeps catching up is told, once in a while, how to keep up instead."""
        swarm_step_seconds = (time.monotonic() - self.step_seen_at) / (self.step - previous_step)
        self.catch_ups = [step for step in self.catch_ups if step > self.step - CATCH_UP_WINDOW] + [self.step]
        if len(self.catch_ups) >= 2 and self.step >= self.advised_at + CATCH_UP_WINDOW:
            self.advised_at = self.step
            advice = falling_behind_advice(self.settings.batch_size, self.batch_seconds, swarm_step_seconds)
            self.console.print(f"[yellow]{advice}[/]")

    def save(self) -> Path:
        info = {
            "run_id": self.settings.run_id,
            "local_steps": self.settings.local_steps,
            "dataset": {
                "source": self.settings.dataset,
                "codebook_size": self.index.codebook_size,
                "grid": list(self.index.grid),
                "image_size": self.index.facts.image_size if self.index.facts else None,
                "vqgan": self.index.facts.vqgan.__dict__ if self.index.facts else None,
            },
        }
        return save_checkpoint(
            Path(self.settings.checkpoint_dir),
            self.model,
            self.step,
            info,
            training_state=self.optimizer.state_dict(),
            stream_state=self.stream.state_dict(),
            tokenizer=self.settings.tokenizer,
        )

    def finish(self, seconds: float) -> None:
        """Tell the swarm we are done, agree with the other finished peers on the final parameters, leave.

        A peer whose averaging round failed applied only its own gradient and ended apart from the
        others. Finished peers publish a hash of their parameters; a peer outside the largest group
        (on a tie, the group with the smaller hash) downloads the state from the others. Everyone
        waits until all peers at this step agree, so nobody leaves while another still needs it.
        """
        deadline = time.monotonic() + FINISH_WAIT
        self.publish(finished=True)
        while time.monotonic() < deadline:
            if self.access:
                self.access.tick()
            peers = read_metrics(self.dht, self.settings.run_id, self.revoked())
            if any(not m.finished and m.step <= self.step and not self.given_up_on(m) for m in peers):
                time.sleep(1.0)  # someone is still on its last step
                continue
            hashes = Counter(m.parameters_hash for m in peers if m.finished and m.step == self.step)
            if len(hashes) <= 1:
                break
            agreed = max(hashes, key=lambda h: (hashes[h], h))
            if self.parameters_hash() != agreed:
                self.console.print("this peer's last averaging round failed: downloading the others' final state")
                self.optimizer.load_state_from_peers()
                self.save()
                self.publish(finished=True)
            time.sleep(1.0)
        sent = self.optimizer.sent_bytes()
        self.sent_bytes = sum(sent.values())
        per_sample = self.sent_bytes / max(1, self.total_samples)
        self.console.print(
            f"finished at {'outer' if self.diloco else 'global'} step {self.step}: contributed {self.total_samples:,} "
            f"samples in {seconds:.0f} s and sent {self.sent_bytes:,} bytes to other peers (averaging "
            f"{sent.get('allreduce', 0):,}, states served {sent.get('state', 0):,}: {per_sample:,.0f} per "
            f"sample); checkpoint in {self.settings.checkpoint_dir}"
        )
        self.shutdown()

    def parameters_hash(self) -> str:
        """A short fingerprint of the parameters that peers in step hold alike: the model's, or with DiLoCo those its
        outer step started from (during the inner steps, each peer's model moves away from them on its own)."""
        return fingerprint(self.optimizer.outer_parameters if self.diloco else self.model.parameters())

    def publish(self, losses: Sequence[float] = (), finished: bool = False) -> PeerMetrics:
        """Publish this peer's signed metrics record (on joining, after each global step, when finished); returns it."""
        self.own_lineages = {s: lineage for s, lineage in self.own_lineages.items() if s > self.step - LINEAGE_STEPS}
        self.own_lineages[self.step] = self.optimizer.lineage
        metrics = PeerMetrics(
            step=self.step,
            samples_per_second=0.0 if finished else float(self.optimizer.tracker.performance_ema.samples_per_second),
            samples_accumulated=len(losses) * self.settings.batch_size,
            total_samples=self.total_samples,
            loss=sum(losses) / len(losses) if losses else 0.0,
            mini_steps=len(losses),
            display_name=self.display_name,
            finished=finished,
            parameters_hash=self.parameters_hash(),
            joining_until=self.joining_until,
            rounds_together=self.optimizer.rounds_together,
            round_size=self.optimizer.last_round_size,
            username=self.access.username if self.access else "",
            peer_id=self.peer_id,
            aggregation=self.aggregation,
            lineage=self.optimizer.lineage,
            local_steps=self.settings.local_steps,
            inner_steps=self.optimizer.inner_steps if self.diloco else 0,
            sent_bytes=self.sent_bytes,
            **outlier_totals(self.last_outliers),
            outliers=dict(outliers_by_sender(self.outliers).most_common(MAX_OUTLIER_SENDERS)),
        )
        publish_metrics(self.dht, self.settings.run_id, self.public_key, metrics)
        return metrics

    def wait_for_peers(self) -> None:
        """--wait-for-peers N: the run's first peers start together instead of the first one training alone."""
        wanted = self.settings.wait_for_peers
        if wanted <= 1:
            return
        self.console.print(f"waiting until {wanted} peers of run {self.settings.run_id!r} are here (Ctrl-C to leave)")
        while not self.stop_requested:
            if self.access:
                self.access.tick()
            records = read_metrics(self.dht, self.settings.run_id, self.revoked())
            self.check_same_settings(records)
            present = sum(not m.finished for m in records)
            if present >= wanted:
                self.console.print(f"{present} peers are here: training")
                return
            time.sleep(1.0)

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
