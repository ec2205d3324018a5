"""Copies of each record one latest read downloads, on real DHT nodes on this machine (bench/records.py measures
it, tests/test_join_holds.py checks that ttt's reads stay within their beam)."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from multiprocessing.sharedctypes import Synchronized

import hivemind
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

from training.swarm.joins import METRICS_ENTRY_BYTES

Read = Callable[[hivemind.DHT, str], object]  # a latest read of a key: returns what `DHT.get` returns


class RecordsReceived(RecordValidatorBase):
    """Passes every record, counting them in shared memory (the DHT checks records in a process of its own)."""

    def __init__(self, count: Synchronized) -> None:
        self.count = count

    def validate(self, record: DHTRecord) -> bool:
        with self.count.get_lock():
            self.count.value += 1
        return True


def hivemind_read(dht: hivemind.DHT, key: str) -> object:
    """A latest read as hivemind's default makes it: a beam of its bucket size (20)."""
    return dht.get(key, latest=True)


def copies_received(nodes: int, read: Read = hivemind_read, reads: int = 5) -> float:
    """Copies of each record one READ receives in a DHT of NODES nodes (hivemind's defaults, caching included, as
    ttt's peers run), after each node stored a record of the metrics' size and read the key three times the same way;
    every read must find every record."""
    count, address, dhts = mp.Value("q", 0), ["/ip4/127.0.0.1/tcp/0"], []
    try:
        dhts.append(hivemind.DHT(start=True, host_maddrs=address))
        joining = {"host_maddrs": address, "initial_peers": dhts[0].get_visible_maddrs()}
        for k in range(1, nodes):  # the last one counts what it receives
            validators = [RecordsReceived(count)] if k == nodes - 1 else []
            dhts.append(hivemind.DHT(start=True, record_validators=validators, **joining))
        for _ in range(3):
            for k, dht in enumerate(dhts):
                dht.store("metrics", b"x" * METRICS_ENTRY_BYTES, get_dht_time() + 300, subkey=f"peer {k}")
            for dht in dhts:
                read(dht, "metrics")
        count.value = 0
        found = [len(read(dhts[-1], "metrics").value) for _ in range(reads)]
        assert found == [nodes] * reads, f"a read found {found} of {nodes} records"
        return count.value / reads / nodes
    finally:
        for dht in dhts:
            dht.shutdown()
