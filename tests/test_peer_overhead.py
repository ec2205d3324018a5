"""A peer spends its time training: alone it never searches for a group, and its optimizer steps in the training
thread (bench/train.py measures what each cost: a core of matchmaking, and ~20% of every forward and backward); the
time it spends computing is what its last line says."""

import threading
import time

import torch
from rich.console import Console

from training.config import PeerSettings, RunSettings
from training.peer.compute_time import ComputeTime
from training.peer.join import join


def test_a_peer_alone_neither_searches_for_a_group_nor_steps_in_another_thread(sample_dataset, tmp_path):
    run = RunSettings(
        dataset=str(sample_dataset),
        run_id="alone",
        preset="tiny",
        target_batch_size=64,  # 4 batches per global step, each step ending within a matchmaking time
        matchmaking_time=1.0,
    )
    settings = PeerSettings(
        run=run,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        batch_size=16,
        checkpoint_dir=str(tmp_path),
        checkpoint_every=10**9,
        loader_workers=0,
        max_steps=3,
    )
    peer = join(settings, Console(quiet=True))
    optimizer = peer.member._optimizer  # hivemind's, behind the peer's interface
    searches, step_threads = [], set()
    schedule_gradient_round = optimizer.grad_averager.schedule_step
    schedule_state_round = optimizer.state_averager.schedule_step
    lamb_step = optimizer.state_averager.optimizer.step

    def searching_for_gradients(*args, **kwargs):
        searches.append("gradients")
        return schedule_gradient_round(*args, **kwargs)

    def searching_for_state(*args, **kwargs):
        searches.append("state")
        return schedule_state_round(*args, **kwargs)

    def stepping(*args, **kwargs):
        step_threads.add(threading.current_thread().name)
        return lamb_step(*args, **kwargs)

    optimizer.grad_averager.schedule_step = searching_for_gradients
    optimizer.state_averager.schedule_step = searching_for_state
    optimizer.state_averager.optimizer.step = stepping
    try:
        peer.catch_up_with_the_swarm()
        peer.train_until_done()
    finally:
        peer.shutdown()
    assert peer.step == 3
    assert searches == []
    assert step_threads == {threading.current_thread().name}
    forward_backward, optimizer_steps = peer.compute_time.shares(time.monotonic())
    assert forward_backward > 0 and optimizer_steps > 0 and forward_backward + optimizer_steps <= 1


def test_compute_time_counts_the_training_threads_batches_and_optimizer_steps_only():
    """Forward and backward as the loop reports them; an optimizer step by its hooks, in the training thread only
    (a step some other thread takes does not hold the training thread up) and from the first batch on."""
    parameter = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    clock = ComputeTime([optimizer])
    optimizer.register_step_pre_hook(lambda *_: time.sleep(0.1))  # after the clock's own: inside the timed step
    parameter.grad = torch.ones(4)
    optimizer.step()  # before the first batch
    clock.batch_done(0.5)
    elsewhere = threading.Thread(target=optimizer.step)
    elsewhere.start()
    elsewhere.join()
    assert clock.optimizer_steps == 0
    optimizer.step()
    assert 0.1 <= clock.optimizer_steps < 0.2
    forward_backward, optimizer_steps = clock.shares(clock.first_batch_at + 2.0)
    assert forward_backward == 0.25 and optimizer_steps == clock.optimizer_steps / 2
    assert clock.shares(clock.first_batch_at) == (0.0, 0.0)
