import pytest
from distributed import Client, LocalCluster

from pipeline.preprocess import graph
from pipeline.preprocess.graph import gather_as_completed


def serialize_or_fail(index: int) -> int:
    if index == 2:
        raise OSError("image vanished")
    return index


def test_a_failed_shard_does_not_stop_the_others():
    with Client(processes=False, n_workers=1, threads_per_worker=2, dashboard_address=None) as client:
        futures = {client.submit(serialize_or_fail, i, pure=False): i for i in range(5)}
        delivered = []
        failed = gather_as_completed(futures, delivered.append)
    assert sorted(delivered) == [0, 1, 3, 4]
    assert failed == {2: "OSError: image vanished"}


def test_a_scheduler_without_workers_is_named_instead_of_waited_on_forever(monkeypatch):
    monkeypatch.setattr(graph, "WORKER_WAIT_SECONDS", 1.0)
    with LocalCluster(n_workers=0, processes=False, dashboard_address=None) as cluster:
        with pytest.raises(ConnectionError) as refused:
            with graph.dask_client(cluster.scheduler_address):
                pass
    assert str(refused.value) == (
        f"the Dask scheduler at {cluster.scheduler_address} has no workers after 1 s; "
        f"start some with `dask worker {cluster.scheduler_address}`"
    )


def test_a_stall_says_once_what_the_workers_are_running(monkeypatch):
    """No shard for a while: one report of each worker's running tasks and their last frames; a shard that finishes
    lets the next stall be reported again, after five times the slowest shard so far."""
    import time as clock

    class Cluster:
        def call_stack(self):
            return {"tcp://w1": {"encode-00003": ['File "encode.py", line 85, in encode_shard']}, "tcp://w2": {}}

    said = []
    monkeypatch.setattr(graph, "STALL_SECONDS", 0.2)
    with graph.StallReport(Cluster(), said.append, check_every=0.02) as stall:
        clock.sleep(0.6)
        assert len(said) == 1
        assert "tcp://w1: encode-00003" in said[0] and "line 85, in encode_shard" in said[0]
        assert "tcp://w2: nothing" in said[0]
        stall.shard_done()  # after ~0.6 s: the next report waits 5 x 0.6 s
        clock.sleep(1.0)
        assert len(said) == 1
        clock.sleep(2.5)
    assert len(said) == 2
