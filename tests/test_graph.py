from distributed import Client

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
