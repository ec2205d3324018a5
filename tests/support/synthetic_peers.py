"""Many signed peer records from one process: what a monitor of a run with hundreds of peers reads.

Each record of a run's metrics key is signed by its own peer's RSA key, and the monitor's DHT checks the
signature and the schema. `SyntheticPeers` holds N keys and one DHT whose signer signs each record with the key
its subkey names, so one process publishes as N peers would. Shared by bench/monitor.py and tests/test_monitor.py.
"""

from __future__ import annotations

import functools

import hivemind
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from training.metrics import METRICS_EXPIRATION, PeerMetrics, RunSchema, metrics_key

CHUNK = 10  # records per DHT store: hivemind's DHT process reads its calls without blocking, so a call must
# reach it in one piece (about 3 KiB here; a 16 KiB call arrived in parts and killed the DHT process)


def make_key(bits: int) -> RSAPrivateKey:
    """An RSA key of BITS bits (peers use 2048; a test that only needs many signers may take 1024, 8x faster)."""
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = rsa.generate_private_key(public_exponent=65537, key_size=bits)
    return key


class ManyKeysSigner(RSASignatureValidator):
    """Signs each record with the key its subkey names."""

    def __init__(self, keys: list[RSAPrivateKey]) -> None:
        super().__init__(keys[0])
        signers = [RSASignatureValidator(key) for key in keys]
        self.signers = {signer.local_public_key: signer for signer in signers}

    def sign_value(self, record: DHTRecord) -> bytes:
        for public_key, signer in self.signers.items():
            if public_key in record.subkey:
                return signer.sign_value(record)
        return record.value


async def store_many(dht: hivemind.DHT, node, **kwargs) -> dict:
    return await node.store_many(**kwargs)


def make_keys(count: int, bits: int = 2048) -> list[RSAPrivateKey]:
    return [make_key(bits) for _ in range(count)]


class SyntheticPeers:
    """Signed peers of run RUN_ID, one per key, published from one DHT that joins INITIAL_PEERS."""

    def __init__(self, run_id: str, keys: list[RSAPrivateKey], initial_peers: list) -> None:
        self.run_id = run_id
        self.signer = ManyKeysSigner(keys)
        self.subkeys = list(self.signer.signers)
        validators = [SchemaValidator(RunSchema, prefix=run_id), self.signer]
        self.dht = hivemind.DHT(start=True, initial_peers=initial_peers, record_validators=validators)

    def publish(self, records: list[PeerMetrics]) -> None:
        """Record i as peer i's, CHUNK records per DHT store."""
        expiration = get_dht_time() + METRICS_EXPIRATION
        for start in range(0, len(records), CHUNK):
            chunk = records[start : start + CHUNK]
            store = functools.partial(
                store_many,
                keys=[metrics_key(self.run_id)] * len(chunk),
                values=[record.dict() for record in chunk],
                expiration_time=expiration,
                subkeys=self.subkeys[start : start + len(chunk)],
            )
            failed = sum(not ok for ok in self.dht.run_coroutine(store).values())
            if failed:
                raise RuntimeError(f"{failed} of {len(chunk)} records were not stored")

    def shutdown(self) -> None:
        self.dht.shutdown()
