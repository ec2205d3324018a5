"""When a peer that downloads the state looks for the next round's group first (`SwarmOptimizer.join_next_group`,
docs/design/averaging.md#a-peer-that-missed-a-round), on hand-made optimizer state: the swarm tests on the NAT testbed
(tests/test_wan.py) show what it changes in a run."""

from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from hivemind.averaging.control import AveragingStage
from hivemind.utils import get_dht_time

from training.swarm.keeper import KeeperOptimizer
from training.swarm.optimizer import Download, SwarmOptimizer, nobody_left, result_lost

MATCHMAKING = 5.0  # seconds: the run's --matchmaking-time, and hivemind's next_chunk_timeout with it


class GradientAverager:
    def __init__(self) -> None:
        self.scheduled = 0
        self.gathered: list[int] = []

    def schedule_step(self, timeout: float, gather: int) -> str:
        self.scheduled += 1
        self.gathered.append(gather)
        return "next group"


def optimizer(
    downloads: list[float], step_ends_in: float = 2.0, peers: int = 3, scheduled=None, steps: tuple[int, int] = (4, 5)
) -> SimpleNamespace:
    """A peer's optimizer as `join_next_group` reads it: its downloads' seconds, when the swarm's step ends, its
    own step and the swarm's (`steps`)."""
    tracker = SimpleNamespace(
        global_progress=SimpleNamespace(num_peers=peers),
        estimated_next_update_time=get_dht_time() + step_ends_in,
        global_epoch=steps[1],
    )
    return SimpleNamespace(
        local_epoch=steps[0],
        grad_averager=GradientAverager(),
        tracker=tracker,
        downloads=[Download(seconds, True) for seconds in downloads],
        matchmaking_time=MATCHMAKING,
        next_chunk_timeout=MATCHMAKING,
        averaging_timeout=60.0,
        scheduled_grads=scheduled,
    )


def test_a_peer_out_of_step_looks_for_the_next_group_before_a_download_like_its_last():
    peer = optimizer(downloads=[3.8])
    assert SwarmOptimizer.join_next_group(peer) == "next group"
    assert peer.grad_averager.scheduled == 1


@pytest.mark.parametrize("steps", [(4, 5), (9, 15), (5, 5)])
def test_the_looked_ahead_round_gathers_the_step_the_download_brings(steps):
    """The round sends the microbatches computed after the download, at the swarm's step, and its reducers judge
    them around the step it gathered (training/audit/received.py): gathered at 9 before a download to 15, honest
    senders were convicted (bench.scale at 8 peers, 10 of 40 trainers in four runs)."""
    peer = optimizer(downloads=[3.8], steps=steps)
    SwarmOptimizer.join_next_group(peer)
    assert peer.grad_averager.gathered == [max(steps)]


def diloco_optimizer() -> SimpleNamespace:
    return SimpleNamespace(**{**vars(optimizer([3.8])), "grad_averager": None})


@pytest.mark.parametrize(
    "why_not, make_peer",  # made when the test runs: the step's end is a DHT time
    [
        ("a newcomer: no download measured yet", lambda: optimizer(downloads=[])),
        ("alone: nobody to meet", lambda: optimizer(downloads=[3.8], peers=1)),
        ("its last download outlasted the window and the round's wait for a sender", lambda: optimizer([10.5])),
        ("the step ends long after the download and a matchmaking", lambda: optimizer([3.8], step_ends_in=30.0)),
        (
            "a round is scheduled already (hivemind tags along with it)",
            lambda: optimizer([3.8], scheduled=SimpleNamespace(done=lambda: False)),
        ),
        ("DiLoCo: no gradient rounds", diloco_optimizer),
    ],
)
def test_a_peer_does_not_look_ahead_when_it_could_not_be_in_time_or_has_nothing_to_join(why_not, make_peer):
    peer = make_peer()
    assert SwarmOptimizer.join_next_group(peer) is None, why_not
    if peer.grad_averager is not None:
        assert peer.grad_averager.scheduled == 0


def test_a_finished_round_scheduled_before_does_not_stop_the_look_ahead():
    peer = optimizer(downloads=[3.8], scheduled=SimpleNamespace(done=lambda: True))
    assert SwarmOptimizer.join_next_group(peer) == "next group"


def test_a_keeper_never_looks_ahead():
    assert KeeperOptimizer.join_next_group(optimizer(downloads=[3.8])) is None


def step_control(stage: AveragingStage) -> Future:
    """A round's control as the optimizer reads it (hivemind's StepControl is a future with a stage), its result
    not set."""
    control = Future()
    control.stage = stage
    return control


def test_a_round_finished_whose_result_never_came_is_not_waited_for():
    """On the NAT testbed beside a busy core, a home's round was FINISHED in the averager while its result never
    reached the optimizer: hivemind waited for it the whole averaging timeout (60 s), twice. A finished round's
    result gets LOST_RESULT_GRACE; one that arrived, or a round still running, is not lost."""
    assert result_lost(step_control(AveragingStage.FINISHED))
    arrived = step_control(AveragingStage.FINISHED)
    arrived.set_result(["a group"])
    assert not result_lost(arrived)
    assert not result_lost(step_control(AveragingStage.RUNNING_ALLREDUCE))


@pytest.mark.parametrize("stage", [AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP, AveragingStage.FINISHED])
def test_a_peer_tags_along_only_with_a_round_whose_group_has_formed(stage):
    """Before a download, a round with no group yet (or whose result was lost) is cancelled, as hivemind's shutdown
    cancels one still looking: nobody counts on this peer's parts there, and waiting for it took the averaging
    timeout (a late home in CI, test_wan)."""
    control = step_control(stage)
    SwarmOptimizer._tag_along_with_zero_weight(SimpleNamespace(), control)
    assert control.cancelled()


def test_a_round_looking_for_its_group_is_given_up_once_nobody_is_left_to_meet():
    """A volunteer who gave a smaller --max-steps left a run of two: the last peer looked for a group until
    --averaging-timeout (60 s) before it took its step alone. The round is now given up as soon as the peer says
    nobody is left (training/peer/rounds.py: every other peer finished), and hivemind applies this peer's own
    gradients; a round whose group has formed is waited for as before."""
    looks = iter([False, False, True])
    assert nobody_left(step_control(AveragingStage.LOOKING_FOR_GROUP), lambda: next(looks), timeout=60.0)
    formed = step_control(AveragingStage.RUNNING_ALLREDUCE)
    assert not nobody_left(formed, lambda: True, timeout=60.0)


def test_a_round_that_finds_nobody_is_given_up_by_its_own_deadline_not_this_wait():
    """The look is bounded: a round still looking when the averaging timeout has passed is left to hivemind."""
    assert not nobody_left(step_control(AveragingStage.LOOKING_FOR_GROUP), lambda: False, timeout=0.3)
