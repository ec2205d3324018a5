"""A peer's health (training/peer/health.py) on hand-made records: which peer of a split swarm downloads, and when;
whom a finished peer waits for."""

from types import SimpleNamespace

import torch
from rich.console import Console

from training.peer.health import Health, agree_on_final_parameters


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

    def at_step(self, step: int, mine: str, *theirs: str) -> bool:
        """This peer published `mine` at `step`, the others `theirs`; it compares them after its next batch (whether
        it downloaded: the loop then takes no optimizer step on that batch)."""
        self.report.lineages[step] = mine
        self.records = [SimpleNamespace(step=step, lineage=lineage) for lineage in theirs]
        return self.health.repair_if_split()


def test_a_peer_outvoted_downloads_at_once_and_says_why():
    swarm = Swarm("c1")
    assert swarm.at_step(4, "c1", "ab", "ab", "ab")
    assert swarm.downloads == 1
    said = swarm.console.export_text()
    assert "step 4: 3 peers held parameters that this one's had left (a round without them)" in said


def test_a_tie_moves_nobody():
    """Two peers apart, or peers that each took a step alone: no majority to join (a download would come from any
    peer, a hostile one too); the next state round mends them."""
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
        agree_on_final_parameters(6, FinishingSwarm([ends, agreed], answering=set()), member, mode, downloads.append)
        assert downloads == [True]
    downloads = []
    member, mode = SimpleNamespace(parameters_hash=lambda: "A"), SimpleNamespace(given_up_on=lambda m: False)
    agree_on_final_parameters(6, FinishingSwarm([ends, agreed], answering=set()), member, mode, downloads.append)
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
    agree_on_final_parameters(10, view, member, mode, lambda first: downloads.append("b"))
    assert view.looks == [done] and downloads == [] and set(view.pinged) == {"a", "dead"}

    view = FinishingSwarm([[record("dead", 9, False), record("b", 10, True, "B")]], answering=set())
    agree_on_final_parameters(10, view, member, mode, lambda first: downloads.append("b"))
    assert downloads == [] and view.pinged == ["dead"]
