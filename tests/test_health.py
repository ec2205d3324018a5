"""A peer's health (training/peer/health.py) on hand-made records: which peer of a split swarm downloads, and when;
whom a finished peer waits for."""

import threading
from types import SimpleNamespace

import torch
from hivemind.utils.serializer import MSGPackSerializer
from rich.console import Console

from training.metrics import PeerMetrics
from training.peer.health import FINISH_WAIT, Health, agree_on_final_parameters, finish_wait
from training.peer.rounds import GlobalSteps
from training.swarm.optimizer import left_behind, recent_lineages


def lineage_record(step: int, lineage: str, earlier: dict[int, str] | None = None) -> PeerMetrics:
    """A peer's record at `step`, holding `lineage` there and the `earlier` ones at its steps before, as it crosses
    the DHT (msgpack, then the schema's validation)."""
    metrics = PeerMetrics(
        step=step, samples_per_second=1.0, samples_accumulated=8, total_samples=8, loss=5.0, mini_steps=1,
        display_name="peer", lineage=lineage, recent_lineages=sorted({**(earlier or {}), step: lineage}.items()),
    )  # fmt: skip
    return PeerMetrics.parse_obj(MSGPackSerializer.loads(MSGPackSerializer.dumps(metrics.dict())))


class Swarm:
    """The records one peer reads, and what it does with them: the lineages it published, its downloads, its
    lines."""

    def __init__(self, lineage: str) -> None:
        self.records: list[SimpleNamespace] = []
        self.member = SimpleNamespace(lineage=lineage, download_state=self.download)
        self.report = SimpleNamespace(lineages={}, publish=lambda: None)
        self.downloads = 0
        self.console = Console(record=True, width=200)
        self.health = Health(torch.nn.Linear(2, 2), self.member, self, self.report, self.console)

    def others(self, finished_too: bool = False) -> list[SimpleNamespace]:
        return self.records

    def download(self) -> None:
        self.downloads += 1

    def at_step(self, step: int, mine: str, *theirs: str, ahead: tuple[PeerMetrics, ...] = ()) -> bool:
        """This peer published `mine` at `step`, the others `theirs` (and the records of those `ahead` of it, at later
        steps); it compares them after its next batch (whether it downloaded: the loop then takes no optimizer step on
        that batch)."""
        self.report.lineages[step] = mine
        self.records = [lineage_record(step, lineage) for lineage in theirs] + list(ahead)
        return self.health.repair_if_split()


def test_a_peer_outvoted_downloads_at_once_and_says_why():
    swarm = Swarm("c1")
    assert swarm.at_step(4, "c1", "ab", "ab", "ab")
    assert swarm.downloads == 1
    said = swarm.console.export_text()
    assert "step 4: 3 peers held parameters that this one's had left (a round without them)" in said


def test_a_step_apart_before_a_download_sends_nobody_to_download_again():
    """A joiner whose first round was the others' round of a later step held a lineage of its own at step 5, then
    caught up by a download at step 6. Its record of step 5 said nothing of the state it held then, yet the others'
    records of step 5 sent it to download again at once (clean-clone run 213). A download that arrived restarts the
    lineages a peer compares."""
    held = recent_lineages(recent_lineages({}, 4, "ab4"), 5, "c5")
    assert left_behind(held, [{5: "ab5"}, {5: "ab5"}]) == (5, 2)  # apart at step 5, before the download
    held = recent_lineages(held, 6, "ab6", restart=True)  # the download of step 6 arrived
    assert held == {6: "ab6"} and left_behind(held, [{5: "ab5", 6: "ab6"}, {5: "ab5", 6: "ab6"}]) is None
    assert recent_lineages(held, 7, "ab7") == {6: "ab6", 7: "ab7"}


def test_the_peers_of_a_larger_group_count_at_its_step_after_they_moved_on():
    """A crowd's step split into a group of six and one of three. When the six compared, their records had moved on
    to the next step, and only the three's named the step they split at: four of the six downloaded the three's state
    (bench.scale, 8 trainers). Each record names its lineages of its last few steps, and every peer counts at each."""
    ahead = tuple(lineage_record(12, "six12", {11: "six"}) for _ in range(5))
    six = Swarm("six")
    assert not six.at_step(11, "six", "three", "three", "three", ahead=ahead)
    three = Swarm("three")
    assert three.at_step(11, "three", "three", "three", ahead=ahead)
    assert "step 11: 5 peers held parameters that this one's had left" in three.console.export_text()
    older = lineage_record(12, "six12")  # an older ttt's record names its current step's lineage only
    assert older.lineages_held() == {12: "six12"} and not Swarm("three").at_step(11, "three", "three", ahead=(older,))


def test_a_repair_that_brought_another_minoritys_state_is_not_repeated_for_that_step():
    """hivemind downloads from any peer of the latest step, one apart too: the download left this peer's lineage at
    step 5 as it was (here, it changes nothing). It does not download again for step 5 while the others' records name
    it (clean-clone run 219: 17 downloads in a row), but does for the next step it is apart at."""
    swarm = Swarm("c5")
    assert swarm.at_step(5, "c5", "ab5", "ab5", "ab5")
    assert not swarm.at_step(5, "c5", "ab5", "ab5", "ab5")
    assert swarm.at_step(6, "c6", "ab6", "ab6", "ab6")
    assert swarm.downloads == 2


def test_a_tie_moves_nobody():
    """Two peers apart, or peers that each took a step alone: no majority to join (a download would come from any
    peer, a hostile one too). They stay apart in lineage (a state round averages their parameters, not their
    optimizer statistics): the audits do not compare them, and the final agreement brings them together."""
    swarm = Swarm("b1")
    assert not swarm.at_step(1, "b1", "a1", "c1")
    assert not swarm.at_step(2, "b2", "a2")
    assert swarm.downloads == 0


class FinishingSwarm:
    """What a finished peer reads at each look (the last one repeats), and who answers its pings."""

    def __init__(self, looks: list[list[SimpleNamespace]], answering: set[str]) -> None:
        self.looks, self.answering_ids, self.pinged = looks, answering, []

    def read_now(self) -> list[SimpleNamespace]:
        return self.looks.pop(0) if len(self.looks) > 1 else self.looks[0]

    def answering(self, records: list[SimpleNamespace]) -> list[SimpleNamespace]:
        self.pinged += [m.peer_id for m in records]
        return [m for m in records if m.peer_id in self.answering_ids]


def record(
    peer_id: str, step: int, finished: bool, parameters_hash: str = "", serves_state: bool = True
) -> SimpleNamespace:
    return SimpleNamespace(
        peer_id=peer_id, step=step, finished=finished, parameters_hash=parameters_hash, serves_state=serves_state
    )


def test_peers_apart_agree_on_the_parameters_of_a_peer_that_can_serve_them():
    """A public peer and two homes behind NAT (client mode), each apart from the others by the compression noise
    (seen on the NAT testbed, small preset): the homes download the public peer's state, whatever the hashes;
    before, the larger hash won, a home's, which nobody could download."""
    ends = [record("public", 6, True, "A"), record("home0", 6, True, "B", False), record("home1", 6, True, "C", False)]
    agreed = [record(m.peer_id, 6, True, "A", m.serves_state) for m in ends]
    for own in "BC":
        downloads = []
        member = SimpleNamespace(parameters_hash=lambda own=own: own)
        mode = SimpleNamespace(given_up_on=lambda m: False)
        agree_on_final_parameters(
            6, FinishingSwarm([ends, agreed], answering=set()), member, mode, downloads.append, FINISH_WAIT
        )
        assert downloads == [True]
    downloads = []
    member, mode = SimpleNamespace(parameters_hash=lambda: "A"), SimpleNamespace(given_up_on=lambda m: False)
    agree_on_final_parameters(
        6, FinishingSwarm([ends, agreed], answering=set()), member, mode, downloads.append, FINISH_WAIT
    )
    assert downloads == []  # the public peer keeps its own and waits for the homes


def test_a_finished_peer_waits_for_a_slow_peer_it_gave_up_on_while_it_answers_not_for_a_dead_one():
    """DiLoCo: b gave up on a in the last round. a is slow, not gone: b waits until a finished (apart, so a
    downloads from b). A peer that answers no ping (killed) holds nobody up."""
    mode = SimpleNamespace(given_up_on=lambda m: m.peer_id in ("a", "dead"))
    member = SimpleNamespace(parameters_hash=lambda: "B")
    slow = [record("a", 9, False), record("dead", 3, False), record("b", 10, True, "B")]
    done = [record("a", 10, True, "B"), record("dead", 3, False), record("b", 10, True, "B")]
    view = FinishingSwarm([slow, slow, done], answering={"a"})
    downloads = []
    agree_on_final_parameters(10, view, member, mode, lambda first: downloads.append("b"), FINISH_WAIT)
    assert view.looks == [done] and downloads == [] and set(view.pinged) == {"a", "dead"}

    view = FinishingSwarm([[record("dead", 9, False), record("b", 10, True, "B")]], answering=set())
    agree_on_final_parameters(10, view, member, mode, lambda first: downloads.append("b"), FINISH_WAIT)
    assert downloads == [] and view.pinged == ["dead"]


def test_homes_that_end_apart_with_nobody_finished_serving_agree_on_the_helpers_state():
    """Every trainer behind NAT, a helper serving the swarm's state: the homes ended apart (each missed a round), and
    neither can serve its own. Each downloads the helper's once, and they agree on it; before, the larger hash won,
    and the other home downloaded the helper's, which matched neither, until the deadline (test_wan's all-NAT run)."""
    ends = [record("home0", 9, True, "B", False), record("home1", 9, True, "C", False)]
    one_fetched = [record("home0", 9, True, "K", False), record("home1", 9, True, "C", False)]
    agreed = [record(m.peer_id, 9, True, "K", False) for m in ends]
    for own in "BC":
        downloads = []
        member = SimpleNamespace(parameters_hash=lambda own=own: own)
        mode = SimpleNamespace(given_up_on=lambda m: False)
        view = FinishingSwarm([ends, one_fetched, one_fetched, agreed], answering=set())
        fetch = lambda first, downloads=downloads: downloads.append(first) or True  # noqa: E731
        assert agree_on_final_parameters(9, view, member, mode, fetch, FINISH_WAIT)
        assert downloads == [True]  # once: its own hash is then the helper's, and it waits for the other home


def test_a_synchronous_peer_behind_is_given_up_on_once_its_record_is_overdue_at_its_own_pace():
    """A peer killed mid-run keeps its record for 10 minutes; finished peers waited for it a whole FINISH_WAIT. Its
    record says 3 batches of 8 at 20 samples/s (0.4 s each): 3 x 1.2 s + 9.5 s + a read's 0.5 s later it is given up
    on (then waited for only while it answers a ping); a record with no batches (just joined) never is."""
    ages = {"killed": 70.0, "slow": 10.0, "joined": 70.0}
    view = SimpleNamespace(record_age=lambda m: ages[m.peer_id], read_period=lambda: 0.5)
    mode = GlobalSteps(view)
    paced = dict(samples_accumulated=24, mini_steps=3, samples_per_second=20.0, inner_steps=0)
    killed, slow = (SimpleNamespace(peer_id=name, **paced) for name in ("killed", "slow"))
    joined = SimpleNamespace(peer_id="joined", samples_accumulated=0, mini_steps=0, samples_per_second=0.0)
    assert mode.given_up_on(killed) and not mode.given_up_on(slow) and not mode.given_up_on(joined)
    ages["slow"] = 13.7
    assert mode.given_up_on(slow)


def test_without_agreement_by_the_deadline_the_peer_says_so():
    """Nobody serves a state at all (every trainer behind NAT, no helper): the downloads fail until the deadline, and
    the agreement says it failed, which the peer prints."""
    member, mode = SimpleNamespace(parameters_hash=lambda: "B"), SimpleNamespace(given_up_on=lambda m: False)
    ends = [record("home0", 9, True, "B", False), record("home1", 9, True, "C", False)]
    tries = []
    assert not agree_on_final_parameters(9, FinishingSwarm([ends], answering=set()), member, mode, tries.append, 0.5)
    assert tries == [True]  # one try within the half second: none arrived


def test_finished_peers_wait_for_a_peer_behind_as_long_as_its_last_round_may_look_for_a_group():
    """A peer a step behind ends its last step by a round that looks for its group until --averaging-timeout: the
    finished peers wait that long and 30 s more for it, a minute at least."""
    assert finish_wait(60.0) == 90.0 and finish_wait(10.0) == FINISH_WAIT == 60.0 and finish_wait(120.0) == 150.0


def others_finished(*finished: bool) -> SimpleNamespace:
    """A view whose other peers' records say whether each finished (`others` as RunView's)."""
    records = [SimpleNamespace(finished=done) for done in finished]
    return SimpleNamespace(
        tick=lambda: None, others=lambda finished_too=False: [m for m in records if finished_too or not m.finished]
    )


def test_a_synchronous_peer_has_nobody_to_meet_once_every_other_peer_finished():
    """A volunteer who gave a smaller --max-steps left a run of two, and the last peer's next round looked for a group
    until --averaging-timeout. The round is given up (training/swarm/optimizer.py's `nobody_left`) once every other
    peer finished; a peer still training, or no other peer known at all, keeps it looking."""
    assert GlobalSteps(others_finished(True)).nobody_to_meet()
    assert GlobalSteps(others_finished(True, True)).nobody_to_meet()
    assert not GlobalSteps(others_finished(True, False)).nobody_to_meet()
    assert not GlobalSteps(others_finished()).nobody_to_meet()


def test_a_keeper_outvoted_by_the_trainers_downloads_their_state_at_its_next_step():
    """A helper's keeper (`ttt monitor --assist-averaging`) compares its lineage with the trainers' records as a
    trainer does: apart (a round it missed and a download that failed, or a state round, which joins no lineages),
    it would serve its own state to newcomers and audit nobody. It downloads at its next step, in its own thread."""
    from training.monitor.snapshots import SwarmSnapshots

    lineages = iter(["k3", "k4", "t5"])  # the keeper's lineage after each of its steps
    member = SimpleNamespace(step=3, downloads=0, optimizer_step=lambda: None)
    member.lineage = "k3"

    def download_state() -> None:
        member.downloads += 1

    member.download_state = download_state
    console = Console(record=True, width=200)
    keeper = SimpleNamespace(
        member=member, checks=None, console=console, lineages={}, repair_due=threading.Event(),
        settings=SimpleNamespace(assist_averaging=True),
    )  # fmt: skip
    keeper.step = 3

    def assist(step: int) -> None:
        keeper.step = member.step = step
        member.lineage = next(lineages)
        SwarmSnapshots.assist(keeper)

    assist(3)
    assist(4)
    SwarmSnapshots.compare_lineages(keeper, [{4: "t4"}, {4: "k4"}, {2: "t2"}, {2: "t2"}])  # a tie; a step it forgot
    assert not keeper.repair_due.is_set()
    SwarmSnapshots.compare_lineages(keeper, [{3: "t3"}, {3: "t3"}, {4: "t4"}])
    assert keeper.repair_due.is_set() and member.downloads == 0  # the refresh's thread only asks
    assist(5)
    assert member.downloads == 1 and keeper.lineages == {5: "t5"} and not keeper.repair_due.is_set()
    assert "step 5: the trainers held parameters that this helper's had left" in console.export_text()
