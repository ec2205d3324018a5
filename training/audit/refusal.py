"""The averagers' side of the audits: refuse the peers this peer convicted (records.py's `refused_peer_ids`): their
requests (training/swarm/admission.py), and their groups (training/swarm/matchmaking.py's leaders to avoid).

An averager runs in a process of its own, so it reads the failed verdicts from the DHT itself, every REFRESH seconds in
the background from its first request or group search on: a caller's request never waits for it. It reads the
commitment records (which name the convicted keys' peer ids) only while somebody stands convicted.
"""

from __future__ import annotations

import asyncio

from hivemind.p2p import PeerID

from training.audit.records import (
    AuditRecord,
    CommitmentRecord,
    accusations_key,
    commitments_key,
    convicted_by,
    parse_entries,
    refused_peer_ids,
)

REFRESH = 10.0  # seconds between two reads of the records


class ConvictedRefused:
    """A check of callers (training/swarm/admission.py): refuses the peer ids this peer's audits convicted."""

    def __init__(self, run_id: str, reader: str) -> None:
        self.run_id, self.reader = run_id, reader  # `reader`: this peer's signing key, as the records name it
        self.refused: set[str] = set()
        self.reading: asyncio.Task | None = None  # in each averager's process, from its first use

    async def check(self, caller: PeerID, request: str, dht) -> None:
        """Raise PermissionError if `caller` stands convicted."""
        self.keep_reading(dht)
        if self.refuses(caller):
            raise PermissionError(f"peer {caller} was convicted by the run's audits (its work was not what it said)")

    def refuses(self, peer_id: PeerID) -> bool:
        return peer_id.to_base58() in self.refused

    def keep_reading(self, dht) -> None:
        """Read the records every REFRESH seconds in the background, from now on."""
        if self.reading is None or self.reading.done():
            self.reading = asyncio.create_task(self.read_every(dht))

    async def read_every(self, dht) -> None:
        while True:
            self.refused = await self.read_refused(dht)
            await asyncio.sleep(REFRESH)

    async def read_refused(self, dht) -> set[str]:
        """The peer ids this peer's audits convict: from the failed verdicts, and the commitments (which name the
        convicted keys' peer ids) only when somebody stands convicted."""
        found = await dht.get(accusations_key(self.run_id), latest=True, return_future=True)
        accusations = parse_entries(found, AuditRecord)
        if not convicted_by(accusations, self.reader):
            return set()
        found = await dht.get(commitments_key(self.run_id), latest=True, return_future=True)
        return refused_peer_ids(accusations, parse_entries(found, CommitmentRecord), self.reader)
