"""Checkpoints of the swarm's model, taken by the monitor: download the state, write it, push it, draw from it.

The monitor holds a copy of the run's model and a hivemind optimizer that never trains. Every --checkpoint-every
global steps it downloads the peers' current state into it and writes a checkpoint in exactly the layout `ttt train`
writes, so `ttt generate --checkpoint ./ckpt-monitor` draws from it; a failed download is tried again at the next
refresh, never fatal. With --push-to hf://ORG/NAME the step folder goes to a Hub model repo in one commit,
the layout `ttt generate --checkpoint hf://ORG/NAME` reads.

With --assist-averaging the optimizer is a `KeeperOptimizer` instead (training/swarm/keeper.py): it takes part in
every round, so it holds the run's state without downloading it, serves it to the trainers, and its checkpoints
are of that state. It reduces like a trainer, and checks what it reduces (training/audit/helper.py).
"""

from __future__ import annotations

import dataclasses
import io
import json
import threading
from collections.abc import Iterable, Mapping
from functools import partial
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape

from pipeline.core.errors import UserError
from pipeline.core.files import write_atomic
from pipeline.core.hub import explain_hub_error, hub_token, parse_hub_url, retry_rate_limited
from pipeline.core.stream import CodeStream, index_dataset
from training.audit.auditor import open_audits
from training.audit.helper import HELPER_OUTCOME, HelperChecks
from training.audit.ledger import DHT_READ_TIMEOUT, Ledger
from training.audit.received import ReducerCheck
from training.audit.sketch import Sketcher, run_seed
from training.audit.standing import AuditStanding
from training.auth.guard import AdmittedPeers
from training.checkpoint import LATEST, save_checkpoint
from training.config import AgreedValue, ModelConfig, MonitorSettings, PeerSettings, RunSettings, model_config
from training.metrics import peer_key
from training.model import DalleTransformer
from training.swarm.admission import AllChecks
from training.swarm.leases import lessees
from training.swarm.optimizer import left_behind, recent_lineages
from training.swarm.received import Projection
from training.swarm.wiring import Membership, join_swarm


class MonitorError(UserError):
    pass


def check_push_target(settings: MonitorSettings) -> str | None:
    """The repo id of --push-to, checked before the monitor starts: its form, and a token unless --dry-run."""
    if settings.push_to is None:
        return None
    repo_id = parse_hub_url(settings.push_to, "model").repo_id
    if not settings.dry_run and hub_token() is None:
        raise MonitorError(
            f"set HF_TOKEN to a Hugging Face token with write access to push checkpoints to {repo_id} "
            "(https://huggingface.co/settings/tokens), or add --dry-run"
        )
    return repo_id


def check_helper_settings(settings: MonitorSettings) -> None:
    """--assist-averaging and --audit-rate, checked before the monitor starts (its reachability chosen)."""
    if settings.assist_averaging and settings.run.local_steps:
        raise MonitorError(
            "--assist-averaging helps average gradients every global step; a run with --local-steps averages "
            "every outer step among its trainers: leave --assist-averaging out"
        )
    if settings.assist_averaging and settings.client_mode:
        raise MonitorError(
            "--assist-averaging serves the trainers, who must be able to dial this monitor, which joins as a "
            "client (--reachability client, or behind NAT): run it where it has a public address"
        )
    if settings.audit_rate and not settings.assist_averaging:
        raise MonitorError(
            "--audit-rate recomputes the others' work at the parameters of each global step, which only a helper "
            "holds: add --assist-averaging, or leave --audit-rate out"
        )


def push_checkpoint(step_dir: Path, repo_id: str, message: str, dry_run: bool, console: Console) -> bool:
    """Upload STEP_DIR and a latest.json pointing at it to the Hub model repo REPO_ID in one commit."""
    files = sorted(path for path in step_dir.iterdir() if path.is_file())
    latest = json.dumps({"step": int(step_dir.name.split("-")[1]), "path": step_dir.name}).encode()
    if dry_run:
        listing = ", ".join(f"{step_dir.name}/{path.name} ({path.stat().st_size:,} B)" for path in files)
        console.print(f"--dry-run: would push to {repo_id} ({message!r}): {listing}, {LATEST}")
        return False
    from huggingface_hub import CommitOperationAdd, HfApi

    operations = [CommitOperationAdd(f"{step_dir.name}/{path.name}", str(path)) for path in files]
    operations.append(CommitOperationAdd(LATEST, latest))
    api = HfApi(token=hub_token())

    def push() -> None:
        api.create_repo(repo_id, repo_type="model", exist_ok=True)
        api.create_commit(repo_id, operations, commit_message=message, repo_type="model")

    try:
        retry_rate_limited(push, console.print)
    except Exception as err:  # HTTP, offline and auth errors alike: the monitor goes on, the next checkpoint retries
        console.print(f"[yellow]could not push {step_dir.name} to {repo_id}: {escape(explain_hub_error(err))}[/]")
        return False
    console.print(f"pushed {step_dir.name} to hf://{repo_id}")
    return True


class SwarmSnapshots:
    """The monitor's copy of the run's model, kept up to date by downloads from the peers."""

    def __init__(
        self, settings: MonitorSettings, dht, public_key: bytes, console: Console, admitted: AdmittedPeers | None
    ) -> None:
        self.settings, self.console = settings, console
        run = settings.run
        torch.manual_seed(run.seed)  # a keeper starts where the run's first trainers start
        self.model = DalleTransformer(model_config(run.preset, run.tokenizer))
        self.sketcher = Sketcher.for_run([p.numel() for p in self.model.parameters()], run_seed(run.run_id))
        self.data = audited_data(run, self.model.config) if settings.audit_rate else None  # read before joining
        # The run's optimizer, as its trainers have it (an assisting monitor applies every average as they do), of
        # the trainers' default batch (the length of the schedule with --local-steps).
        membership = Membership(PeerSettings.batch_size, settings.client_mode, settings.bandwidth, admitted=admitted)
        key = peer_key(public_key)  # the helper's signing key, as the audits' records name it
        if settings.assist_averaging:
            membership = self.helper_membership(membership, key)
        self.member = join_swarm(run, dht, self.model, membership)
        self.checks = self.helper_checks(dht, public_key, key) if settings.assist_averaging else None
        self.last_saved = -1
        self.lineages: dict[int, str] = {}  # a keeper's lineage at each of its recent steps (`compare_lineages`)
        self.repair_due = threading.Event()  # set from the refresh, taken by the keeper's thread (`assist`)

    def helper_membership(self, membership: Membership, key: str) -> Membership:
        """A helper's part: the keeper's, which reduces like a trainer, refusing whom the audits convicted and holding
        every sender on probation, and sums what each sender sent it for its checks (training/audit/helper.py)."""
        standing = AuditStanding(self.settings.run.run_id, key)
        sketch = self.sketcher
        projection = Projection(sketch.coordinates, sketch.signs, sketch.buckets, sketch.bounds)
        return dataclasses.replace(
            membership, keeper=True, admitted=AllChecks(membership.admitted, standing), avoided=standing,
            probation=standing, projection=projection,
        )  # fmt: skip

    def helper_checks(self, dht, public_key: bytes, key: str) -> HelperChecks:
        """A helper's checks of what it reduced (training/audit/helper.py) and, with --audit-rate, its audits and
        re-checks from the run's data as a trainer's (training/audit/auditor.py), judged into one `Ledger`."""
        run = self.settings.run
        ledger = Ledger(
            dht=dht, run_id=run.run_id, public_key=public_key, key=key, peer_id=dht.peer_id.to_base58(),
            console=self.console, refuse=self.member.refuse_convicted, outcome=HELPER_OUTCOME,
        )  # fmt: skip
        if self.data is None:
            return HelperChecks(ledger, ReducerCheck(self.member.received_rounds, self.member.leave_out_unaudited))
        read_lessees = partial(lessees, dht, run.run_id, timeout=DHT_READ_TIMEOUT)
        audits = open_audits(
            ledger, self.settings.audit_rate, self.model, self.member, self.data, self.sketcher, read_lessees, run.seed
        )
        return HelperChecks(ledger, audits.reducer, audits)

    @property
    def step(self) -> int:
        return self.member.step

    def assist(self) -> None:
        """One step of the keeper: take part in a gradient round the others are forming, if any; at a new global step,
        check what it reduced."""
        self.member.optimizer_step()
        if self.repair_due.is_set():
            self.repair_due.clear()
            self.console.print(
                f"step {self.step}: the trainers held parameters that this helper's had left: downloading their state"
            )
            self.member.download_state()
            self.lineages = {}  # what it held before says nothing of what it holds now
        self.lineages = recent_lineages(self.lineages, self.step, self.member.lineage)  # the refresh's thread reads it
        if self.checks is not None:
            self.checks.step_done(self.step)

    def compare_lineages(self, others: Iterable[Mapping[int, str]]) -> None:
        """From the refresh, with the trainers' lineages by step (`PeerMetrics.lineages_held`): when more of them
        held another lineage than the keeper's at a recent step, by more than one (`left_behind`: a round it missed
        and a download that failed, or a state round, which joins no lineages, with its optimizer statistics apart),
        the keeper downloads their state at its next step. Apart, it would serve its own to newcomers, and its
        audits, which recompute only at its own lineage, would judge nobody."""
        if self.settings.assist_averaging and left_behind(self.lineages, others) is not None:
            self.repair_due.set()

    def trainers_read(self, identities: Iterable[AgreedValue]) -> None:
        """From the trainers' records (`identities`: the dataset each publishes): a helper recomputes once a trainer
        reads the data it reads, and never before (recomputed from other rows, every microbatch would fail)."""
        if self.data is None or self.checks is None or self.checks.data_agreed:
            return
        if self.data.index.identity in identities:
            self.checks.data_agreed = True
            self.console.print(
                f"audits: the trainers read this helper's data {self.data.index.identity}: it recomputes one "
                f"microbatch at {self.settings.audit_rate:g} of global steps, and every failed verdict of another "
                "auditor"
            )

    def download(self) -> bool:
        """The swarm's current state; False when no peer had a newer one than this monitor's last checkpoint.
        A keeper holds it already."""
        if self.settings.assist_averaging:
            return self.step > self.last_saved
        try:
            self.member.download_state(then_train=False)
        except Exception as err:  # a peer that left mid-download: the next refresh tries again
            self.console.print(f"[yellow]could not download the swarm's state: {err}; retrying later[/]")
            return False
        return self.step > self.last_saved

    def save(self) -> Path:
        """Write the downloaded state as `ttt train` writes a checkpoint."""
        info = {"run_id": self.settings.run.run_id, "dataset": None, "written_by": "ttt monitor"}
        step_dir = save_checkpoint(
            Path(self.settings.checkpoint_dir),
            self.model,
            self.step,
            info,
            training_state=self.member.state_dict(),
            tokenizer=self.settings.run.tokenizer,
        )
        self.last_saved = self.step
        self.console.print(f"checkpoint of the swarm at global step {self.step}: {step_dir}")
        return step_dir

    def push(self, step_dir: Path, loss: float | None) -> bool:
        repo_id = check_push_target(self.settings)
        message = f"step {self.step}" + (f", loss {loss:.4f}" if loss is not None else "")
        return push_checkpoint(step_dir, repo_id, message, self.settings.dry_run, self.console)

    def shutdown(self) -> None:
        self.member.shutdown()


def audited_data(run: RunSettings, config: ModelConfig) -> CodeStream:
    """The run's dataset, as a helper that recomputes the others' work reads it: one row group at a time, on demand."""
    grid = (config.grid, config.grid)
    index = index_dataset(run.dataset, config.codebook_size, grid)
    return CodeStream(
        run.dataset, text_len=config.text_len, codebook_size=config.codebook_size, grid=grid,
        tokenizer=run.tokenizer, index=index,
    )  # fmt: skip


def write_previews(step_dir: Path, settings: MonitorSettings, out: Path) -> dict[str, str]:
    """One image per preview prompt from the checkpoint in STEP_DIR, as PNGs in OUT: {prompt: file name}."""
    from inference.generate import draw_previews
    from inference.sample_quality import HELDOUT_PROMPTS, SEEN_PROMPTS

    # Default: two prompts the sample's captions hold and one they never do.
    prompts = settings.preview_prompts or [SEEN_PROMPTS[0], SEEN_PROMPTS[1], HELDOUT_PROMPTS[1]]
    images = draw_previews(str(step_dir), prompts, settings.vqgan_config, settings.vqgan_ckpt)
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for index, (prompt, image) in enumerate(zip(prompts, images, strict=True)):
        files[prompt] = f"{step_dir.name}-{index}.png"
        png = io.BytesIO()
        image.save(png, format="PNG")
        write_atomic(out / files[prompt], png.getvalue())
    return files
