"""Joining a run, step by step: `ttt train` from its command line to a peer ready for its first batch.

    find the run                --join: the run's spec, from the swarm at the address or from its monitor's page
    check the initial peers     a typo or a dead address fails in seconds, before anything is loaded
    start the access            an authenticated run's token (a volunteer who is not admitted hears so at once)
    prepare the machine         the device, the model's shape, the data (a local copy with --no-stream), the batch
                                that fits, and whether --resume may continue the checkpoint
    connect                     hivemind's log to a file, this machine's reachability, the run's DHT
    enter the swarm             the model from the run's seed, this peer's part in the swarm (training/swarm/),
                                the data stream, the checkpoint of --resume, and the collaborators of the loop

Each step takes what the steps before it made and returns what it made; the loop (training/peer/loop.py) starts
with all of it built. The swarm's state is downloaded later, once the loop holds the stop signals.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from rich.console import Console
from safetensors.torch import load_file

from pipeline.core.console import ttt_console
from pipeline.core.devices import pick_device
from pipeline.core.sources import local_copy
from pipeline.core.stream import CodeStream, DatasetIndex, index_dataset, peer_seed
from pipeline.core.text import tokenizer_identity
from training.audit.auditor import open_audits
from training.audit.ledger import DHT_READ_TIMEOUT, Ledger
from training.audit.sketch import Sketcher, run_seed
from training.audit.standing import AuditStanding
from training.auth.guard import RunAccess, start_access
from training.auth.keys import load_authority_public_key
from training.calc.memory import describe_model
from training.checkpoint import STREAM_STATE, TRAINING_STATE, WEIGHTS, latest_checkpoint, read_config
from training.config import ModelConfig, PeerSettings, RunSpec, agreed_values, model_config
from training.metrics import make_validators, peer_key
from training.model import DalleTransformer
from training.peer.compute_time import ComputeTime
from training.peer.health import Health
from training.peer.joining import JoinHold
from training.peer.loop import Peer
from training.peer.overlap import OverlappedOuterRounds
from training.peer.report import ProgressReport
from training.peer.rounds import GlobalSteps, Mode, OuterRounds
from training.peer.setup import TrainError, check_resumable, choose_batch_size, make_stream
from training.peer.stopping import LEAVE_MARGIN, StopSignals
from training.peer.view import RunView
from training.spec import adopt, choose_spec, read_monitor_page, specs_from_records
from training.swarm.admission import AllChecks
from training.swarm.dht import (
    choose_reachability,
    reachable_addresses,
    read_run_specs,
    refuse_silent_initial_peers,
    start_dht,
)
from training.swarm.leases import LeaseBook, LeaseSource, lessees
from training.swarm.member import DiLoCoMember, SwarmMember
from training.swarm.processes import HIVEMIND_LOG, log_hivemind_to, quiet_hivemind_children
from training.swarm.received import Projection
from training.swarm.wiring import Membership, join_swarm


@dataclass(frozen=True)
class Machine:
    """What this peer's own machine brings: its device, the model's shape, and the data it reads."""

    device: torch.device
    config: ModelConfig
    dataset: str  # where it reads the data: --dataset, or its local copy with --no-stream
    index: DatasetIndex


@dataclass(frozen=True)
class Node:
    """This peer in the run's DHT: the node, and the public key its records are signed with."""

    dht: object  # hivemind.DHT, started by training/swarm/dht.py
    public_key: bytes


def train(settings: PeerSettings) -> None:
    """`ttt train`: run one peer until --max-steps global steps (or forever), checkpointing as it goes."""
    console = ttt_console()  # progress lines stay whole for logs and scripts
    settings = find_run(settings, console)
    dataset = settings.run.dataset
    if not Path(dataset).exists() and "://" not in dataset:
        raise TrainError(f"--dataset {dataset} does not exist; make one with `ttt preprocess`")
    join(settings, console).run()


def find_run(settings: PeerSettings, console: Console) -> PeerSettings:
    """--join: the run's settings from its spec (the swarm's at the address, or its monitor's), the options given
    beside checked against it, and the address (the monitor's peers) as initial peers; nothing to do without it."""
    address = settings.join
    if address is None:
        return settings
    log_hivemind_to(Path(settings.checkpoint_dir) / HIVEMIND_LOG)
    if address.startswith(("http://", "https://")):
        initial_peers, spec = read_monitor_page(address)
        initial_peers, specs = reachable_addresses(initial_peers), [spec]
    else:
        refuse_silent_initial_peers([address])
        with quiet_hivemind_children():
            initial_peers, specs = [address], specs_from_records(read_run_specs(address))
    run_id = settings.run.run_id if "run_id" in settings.run_options_given else None
    authority = load_authority_public_key(settings.auth.authority_key) if settings.auth else None
    spec = choose_spec(specs, run_id, authority, address)
    run = adopt(spec, settings.run, settings.run_options_given)
    console.print(f"joining run {run.run_id!r} at {address}: {signature_note(spec, authority is not None)}")
    peers = [*settings.initial_peers, *(peer for peer in initial_peers if peer not in settings.initial_peers)]
    return dataclasses.replace(settings, run=run, spec=spec, initial_peers=peers)


def join(settings: PeerSettings, console: Console) -> Peer:
    """A peer of the run, ready for its first batch."""
    refuse_silent_initial_peers(settings.initial_peers)
    stop = StopSignals(console, settings.run.averaging_timeout + LEAVE_MARGIN)
    access = start_access(settings, console)
    machine = prepare_machine(settings, console)
    settings = dataclasses.replace(
        settings, batch_size=choose_batch_size(settings, machine.config, machine.device, console)
    )
    if settings.resume:
        check_resumable(settings, machine.config)
    settings, node = connect(settings, console, access)
    try:
        return enter_swarm(settings, console, stop, access, machine, node)
    except BaseException:  # leave the swarm before reporting why we could not join it
        node.dht.shutdown()
        if access:
            access.close()
        raise


def signature_note(spec: RunSpec, checked: bool) -> str:
    """What a joining peer knows of who wrote the run's spec."""
    if not spec.signature:
        return "its spec is not signed: any peer there could have published it"
    if checked:
        return "its spec is signed by the run's --authority-key"
    return "its spec is signed by the key it names (pass the run's --authority-key to check that it is the organiser's)"


def prepare_machine(settings: PeerSettings, console: Console) -> Machine:
    """The device and its threads, the model's shape, and the data, refused here if it was made for another model
    (codebook, grid)."""
    if settings.threads:
        torch.set_num_threads(settings.threads)
    device = torch.device(pick_device(settings.device))
    config = model_config(settings.run.preset, settings.run.tokenizer)
    dataset = settings.run.dataset if settings.stream else local_copy(settings.run.dataset)
    if dataset != settings.run.dataset:
        console.print(f"training from a local copy of {settings.run.dataset}: {dataset}")
    index = index_dataset(dataset, config.codebook_size, (config.grid, config.grid))
    return Machine(device, config, dataset, index)


def connect(settings: PeerSettings, console: Console, access: RunAccess | None) -> tuple[PeerSettings, Node]:
    """hivemind's log into a file, this machine's reachability (which may make the peer a client: returned in the
    settings), and the run's DHT node."""
    validators, public_key = make_validators(settings.run.run_id)
    log = Path(settings.checkpoint_dir) / HIVEMIND_LOG
    log_hivemind_to(log)
    console.print(f"hivemind's own log: {log}")
    settings = choose_reachability(settings, console)
    with quiet_hivemind_children():
        dht = start_dht(settings, validators, console, access)
    return settings, Node(dht, public_key)


def enter_swarm(
    settings: PeerSettings,
    console: Console,
    stop: StopSignals,
    access: RunAccess | None,
    machine: Machine,
    node: Node,
) -> Peer:
    """The model, this peer's part in the swarm, its data stream, and the collaborators of the loop."""
    torch.manual_seed(settings.run.seed)  # every first peer of a run starts from the same parameters
    model = DalleTransformer(machine.config).to(machine.device)
    console.print(f"model: {describe_model(machine.config)}")
    audited = settings.audit_rate > 0 and not settings.run.local_steps  # DiLoCo's pseudo-gradients: not yet
    standing = AuditStanding(settings.run.run_id, peer_key(node.public_key)) if audited else None
    admitted = AllChecks(access.admitted_peers if access else None, standing)
    sketcher = Sketcher.for_run([p.numel() for p in model.parameters()], run_seed(settings.run.run_id))
    projection = Projection(sketcher.coordinates, sketcher.signs, sketcher.buckets, sketcher.bounds)
    membership = Membership(
        settings.batch_size, settings.client_mode, settings.bandwidth, admitted=admitted, avoided=standing,
        probation=standing,
        projection=projection if audited else None,  # its reducer checks what the senders committed to
    )  # fmt: skip
    with quiet_hivemind_children():
        member = join_swarm(settings.run, node.dht, model, membership)
    if settings.resume:
        resume(settings, model, member, console)
    # The audits convict (Audits.convicted); the leases (LeaseBook.ignored) and the run's view ignore them.
    convicted_keys: set[str] = set()
    stream = open_stream(settings, machine, node, console, convicted_keys)
    audits = None
    if audited:
        ledger = Ledger(
            dht=node.dht, run_id=settings.run.run_id, public_key=node.public_key, key=peer_key(node.public_key),
            peer_id=node.dht.peer_id.to_base58(), console=console, refuse=member.refuse_convicted,
            convicted=convicted_keys,
        )  # fmt: skip
        read_lessees = partial(lessees, node.dht, settings.run.run_id, timeout=DHT_READ_TIMEOUT)
        audits = open_audits(
            ledger, settings.audit_rate, model, member, stream, sketcher, read_lessees, settings.run.seed
        )
    identities = {"dataset": machine.index.identity, "tokenizer": tokenizer_identity(settings.run.tokenizer)}
    view = RunView(node.dht, settings.run.run_id, settings.initial_peers, member, access, convicted_keys)
    report = ProgressReport(
        settings, console, node.dht, node.public_key, member, access, stream, agreed_values(settings.run, identities)
    )
    join_hold = JoinHold(view, report, member, console, settings.join_timeout)
    return Peer(
        settings=settings, console=console, stop=stop, access=access, dht=node.dht, member=member, model=model,
        device=machine.device, index=machine.index, stream=stream, view=view, report=report, join_hold=join_hold,
        mode=choose_mode(settings, member, view, console, report, join_hold, stop),
        health=Health(model, member, view, report, console), compute_time=ComputeTime(member.local_optimizers),
        audits=audits,
    )  # fmt: skip


def choose_mode(
    settings: PeerSettings,
    member: SwarmMember,
    view: RunView,
    console: Console,
    report: ProgressReport,
    join_hold: JoinHold,
    stop: StopSignals,
) -> Mode:
    """How this peer averages, as its part in the swarm was made (training/swarm/wiring.py chose it)."""
    if not isinstance(member, DiLoCoMember):
        steps = GlobalSteps(view)
        member.give_up_looking_when(steps.nobody_to_meet)
        return steps
    rounds = OverlappedOuterRounds if settings.outer_overlap else OuterRounds
    return rounds(settings, member, view, console, report, join_hold, stop)


def resume(settings: PeerSettings, model: torch.nn.Module, member: SwarmMember, console: Console) -> None:
    """--resume: the model and optimizer of this peer's own latest checkpoint."""
    step_dir = latest_checkpoint(Path(settings.checkpoint_dir))
    model.load_state_dict(load_file(str(step_dir / WEIGHTS)))
    if (step_dir / TRAINING_STATE).is_file():
        member.load_state_dict(torch.load(step_dir / TRAINING_STATE, weights_only=False))
    console.print(f"resumed from {step_dir} (global step {read_config(step_dir)['step']})")


def open_stream(
    settings: PeerSettings, machine: Machine, node: Node, console: Console, convicted_keys: set[str]
) -> CodeStream:
    """The peer's data: each epoch's blocks, leased in the run's DHT so that the swarm reads every row once per
    epoch (training/swarm/leases.py), the leases of CONVICTED_KEYS counting for nothing. --resume continues the
    stream of the checkpoint; one saved by a ttt before leases continues its peer's own order."""
    saved = latest_checkpoint(Path(settings.checkpoint_dir)) / STREAM_STATE if settings.resume else None
    state = json.loads(saved.read_text()) if saved is not None and saved.is_file() else None
    seed, blocks = settings.run.seed, None
    if state is not None and not state["fingerprint"].get("swarm_blocks"):
        seed = state["fingerprint"]["seed"]
    else:
        own = peer_seed(node.dht.peer_id.to_base58())  # the order it tries blocks in, or reads them in alone
        book = LeaseBook(node.dht, settings.run.run_id, node.public_key, order_seed=own, ignored=convicted_keys)
        units = [unit.rows for unit in machine.index.units]
        blocks = LeaseSource(book, units, seed, say=console.print, own_seed=own)
    stream = make_stream(settings, machine.config, machine.dataset, machine.index, machine.device, seed, blocks)
    if state is not None:
        stream.load_state_dict(state)
    return stream
