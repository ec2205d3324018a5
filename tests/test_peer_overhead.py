"""A peer spends its time training: alone it never searches for a group, and its optimizer steps in the training
thread (bench/train.py measures what each cost: a core of matchmaking, and ~20% of every forward and backward)."""

import threading

from rich.console import Console

from training.config import PeerSettings
from training.peer.loop import Peer


def test_a_peer_alone_neither_searches_for_a_group_nor_steps_in_another_thread(sample_dataset, tmp_path):
    settings = PeerSettings(
        dataset=str(sample_dataset),
        run_id="alone",
        preset="tiny",
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        target_batch_size=64,  # 4 batches per global step, each step ending within a matchmaking time
        batch_size=16,
        checkpoint_dir=str(tmp_path),
        checkpoint_every=10**9,
        loader_workers=0,
        matchmaking_time=1.0,
        max_steps=3,
    )
    peer = Peer(settings, console=Console(quiet=True))
    optimizer = peer.optimizer
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
        peer.resume_or_join()
        peer.train_until_done()
    finally:
        peer.shutdown()
    assert peer.step == 3
    assert searches == []
    assert step_threads == {threading.current_thread().name}
