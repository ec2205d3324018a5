"""The averagers' side of the audits: each peer's standing as this peer's audits see it. The convicted are refused
(records.py's `refused_peer_ids`): their requests (training/swarm/admission.py), and their groups
(training/swarm/matchmaking.py's leaders to avoid). The proven (records.py's `proven_by`) are out of probation; every
other sender is held to one median peer in this peer's reducers (training/swarm/aggregation.py). A sender nobody can
audit now (records.py's `unaudited_keys`, which the main process tells: `leave_out`) counts for nothing there, proven
or not: proven once, a peer that then commits under a lineage of its own would otherwise keep a proven peer's weight
for work nobody checks.

An averager runs in a process of its own, so it reads the verdicts from the DHT itself, every REFRESH seconds in the
background from its first request or group search on: a caller's request never waits for it. It reads the failed
verdicts at every refresh. The passed ones (every auditor's, never empty in an honest swarm: the largest of these
reads at a thousand peers, docs/scale.md) it reads at its first refresh, and then only after one of its reducers held
a sender on probation: once every sender it meets is proven, it stops reading them. It reads the commitment records
(which name the keys' peer ids) only when it needs them: while somebody stands convicted, and when a key it holds
proven has no peer id yet.

The peer's main process convicts by the same rule from its own reads (training/audit/auditor.py), and tells its
averagers at once (`convict`): a conviction is refused from that moment, not from the next refresh. In each averager's
process this one object is its admission's, its matchmaking's and its reducer's (made once in the main process, and
copied whole when hivemind forked that process), so what it is told holds for all three.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from hivemind.p2p import PeerID

from training.audit.records import (
    AuditRecord,
    CommitmentRecord,
    accusations_key,
    audits_key,
    claimed_ids,
    commitments_key,
    convicted_by,
    parse_entries,
    proven_by,
    refused_peer_ids,
)
from training.metrics import read_latest

REFRESH = 10.0  # seconds between two reads of the records


class AuditStanding:
    """Whom this peer's audits convicted (refused by its averagers) and proved (out of probation in its reducers)."""

    def __init__(self, run_id: str, reader: str) -> None:
        self.run_id, self.reader = run_id, reader  # `reader`: this peer's signing key, as the records name it
        self.refused: set[str] = set()  # peer ids
        self.proven_keys: set[str] = set()  # signing keys, once proven proven for good, unless convicted
        self.proven_ids: dict[str, str] = {}  # signing key -> the peer id its commitments name, for the proven keys
        self.reading: asyncio.Task | None = None  # in each averager's process, from its first use
        self.passed_due = True  # whether the next read reads the passed verdicts: a sender was held on probation
        self.told: set[str] = set()  # peer ids the main process convicted (`convict`): refused for good
        self.unaudited: set[str] = set()  # peer ids nobody can audit now, as the main process last read (`leave_out`)

    async def check(self, caller: PeerID, request: str, dht) -> None:
        """Raise PermissionError if `caller` stands convicted."""
        self.keep_reading(dht)
        if self.refuses(caller):
            raise PermissionError(f"peer {caller} was convicted by the run's audits (its work was not what it said)")

    def convict(self, peer_ids: Iterable[str]) -> None:
        """Refuse `peer_ids` from now on: the main process convicted them, before this process's next read."""
        self.told |= set(peer_ids)
        self.refused |= self.told

    def leave_out(self, peer_ids: Iterable[str]) -> None:
        """Count `peer_ids`, and only them, for nothing in the reducers: the main process found that nobody can audit
        their work now."""
        self.unaudited = set(peer_ids)

    def counted(self, peer_id: PeerID) -> bool:
        """Whether a reducer counts what `peer_id` sends: unless nobody can audit its work now (`leave_out`)."""
        return peer_id.to_base58() not in self.unaudited

    def refuses(self, peer_id: PeerID) -> bool:
        return peer_id.to_base58() in self.refused

    def proven(self, peer_id: PeerID) -> bool:
        """Whether an audit this peer trusts passed a microbatch of `peer_id`'s (else it is on probation, and the next
        read reads the passed verdicts, which may end that)."""
        name = peer_id.to_base58()
        proven = name in self.proven_ids.values() and name not in self.refused
        self.passed_due |= not proven
        return proven

    def keep_reading(self, dht) -> None:
        """Read the records every REFRESH seconds in the background, from now on."""
        if self.reading is None or self.reading.done():
            self.reading = asyncio.create_task(self.read_every(dht))

    async def read_every(self, dht) -> None:
        while True:
            await self.read(dht)
            await asyncio.sleep(REFRESH)

    async def verdicts(self, dht, key: Callable[[str], str]) -> dict[str, AuditRecord]:
        """The failed (accusations_key) or passed (audits_key) verdicts' records."""
        return parse_entries(await read_latest(dht, key(self.run_id), return_future=True), AuditRecord)

    async def read(self, dht) -> None:
        """Read the verdicts, and the commitments when they are needed, into `refused` and `proven_ids`."""
        accusations = await self.verdicts(dht, accusations_key)
        due, self.passed_due = self.passed_due, False
        passed = await self.verdicts(dht, audits_key) if due else {}
        convicted = set(convicted_by(accusations, self.reader))
        self.proven_keys = proven_by(passed, self.reader, self.proven_keys, convicted)
        self.proven_ids = {key: name for key, name in self.proven_ids.items() if key in self.proven_keys}
        unnamed = self.proven_keys - self.proven_ids.keys()
        if not convicted and not unnamed:
            self.refused = set(self.told)
            return
        found = await read_latest(dht, commitments_key(self.run_id), return_future=True)
        commitments = parse_entries(found, CommitmentRecord)
        self.refused = refused_peer_ids(accusations, commitments, self.reader) | self.told
        ids = claimed_ids(commitments)
        self.proven_ids.update({key: ids[key] for key in unnamed if key in ids})
