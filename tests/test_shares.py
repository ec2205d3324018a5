"""Each reducer's share of a round follows the bandwidth it declared (training/swarm/shares.py), within a cap that
keeps a peer that lies about its link from taking the round; the averagers of both kinds of run are given it."""

import asyncio

import hivemind
import pytest
import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.utils import MSGPackSerializer

from tests.test_robust import RoundAverager
from training.config import RunSettings
from training.swarm.processes import quiet_hivemind_children
from training.swarm.shares import reducer_shares
from training.swarm.wiring import Membership, make_optimizer

CLIENT, NODE = AveragingMode.CLIENT, AveragingMode.NODE


def test_without_declared_bandwidths_every_reducer_takes_the_same_share_and_a_client_none():
    assert reducer_shares([None, None, None, None], [CLIENT, NODE, CLIENT, NODE]) == (0.0, 1.0, 0.0, 1.0)


def test_shares_follow_the_declared_bandwidths_and_a_client_reduces_nothing_whatever_it_declares():
    shares = reducer_shares([20.0, 100.0, 50.0, 50.0], [CLIENT, NODE, NODE, NODE])
    assert shares == (0.0, 100.0, 50.0, 50.0)


def test_a_declared_bandwidth_counts_at_most_four_times_the_other_reducers_median():
    """One of two helpers on a link ten times as fast takes 80% of the round, not all of it (hivemind's linear
    program gave it every part); a peer that claims a thousand times the others' link takes at most 4 / (n + 3)."""
    assert reducer_shares([None, None, None, 100.0, 10.0], [CLIENT] * 3 + [NODE] * 2) == (0.0, 0.0, 0.0, 40.0, 10.0)
    shares = reducer_shares([100.0, 100.0, 100.0, 100_000.0], [NODE] * 4)
    assert shares == (100.0, 100.0, 100.0, 400.0) and shares[3] / sum(shares) == 4 / 7


def test_a_reducer_that_declared_nothing_counts_as_the_median_of_the_others_as_counted():
    """The claim of a liar is capped before the median is taken: the silent reducer does not inherit it."""
    assert reducer_shares([1e9, 100.0, None], [NODE] * 3) == (400.0, 100.0, 250.0)


@pytest.mark.parametrize("garbage", ["fast", float("nan"), float("inf"), -5.0, 0.0, True, [1]])
def test_anything_but_a_positive_number_is_no_declaration(garbage):
    """Another member's gathered data is anything: what is not a bandwidth counts as none declared."""
    assert reducer_shares([garbage, 100.0, 50.0], [NODE] * 3) == (75.0, 100.0, 50.0)


def test_the_round_splits_its_parts_by_the_shares_of_the_gathered_bandwidths():
    """`RobustAveraging._aggregate_with_group` reads each member's declared bandwidth and mode from the gathered
    data, and its runner splits the vector by `reducer_shares`, not by hivemind's linear program."""
    averager, serializer = RoundAverager(), MSGPackSerializer
    members = [(20.0, CLIENT, 7), (100.0, NODE, 7), (10.0, NODE, 7)]
    gathered = [serializer.dumps([bw, mode.value, serializer.dumps(step)]) for bw, mode, step in members]
    group = GroupInfo(b"a round", ("home", "fast helper", "slow helper"), tuple(gathered))
    assert asyncio.run(averager._aggregate_with_group(group, min_vector_size=0)) == dict.fromkeys(group.peer_ids, 7)
    assert averager.fractions == [(0.0, 40.0, 10.0)]


@pytest.mark.parametrize("local_steps", [0, 2], ids=["synchronous", "DiLoCo"])
def test_every_averager_of_a_peer_declares_its_bandwidth(local_steps):
    """hivemind 1.1.12 gives the optimizer's `averager_opts` to its state averager alone: a synchronous peer's
    gradient averager declared nothing until the optimizer passed it on (bench.wan: both helpers still sent the
    same bytes)."""
    run = RunSettings(run_id=f"declared{local_steps}", local_steps=local_steps, matchmaking_time=1.0)
    model = torch.nn.Linear(100, 30)
    with quiet_hivemind_children():
        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        optimizer = make_optimizer(run, dht, model, Membership(batch_size=16, bandwidth=40.0))
    try:
        averagers = [optimizer.state_averager, optimizer.grad_averager or optimizer.pseudo_gradients]
        assert [averager.bandwidth for averager in averagers] == [40.0, 40.0]
    finally:
        optimizer.shutdown()
        dht.shutdown()
