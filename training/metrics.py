"""What each peer publishes to the DHT, signed, for monitors, dashboards and leaderboards.

Every peer stores its `PeerMetrics` under the key `{run_id}_metrics` with its RSA public key
as the subkey. The DHT's record validators (attached on every peer) check the signature (a
peer can only write its own subkey) and the schema (a malformed record is rejected), so a
monitor reading the key gets one validated record per live peer.

An authenticated run (training/auth/) keeps two more keys of the same kind: `{run_id}_credentials` (each peer's
access token) and `{run_id}_revocations` (the organiser's signed revocation list, relayed by peers).

One key is every run's: `ttt_runs`, where each peer and monitor publishes the spec of the run it is in
(training/spec.py), so that a volunteer joining with an address alone learns the run's settings.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from multiprocessing.sharedctypes import Synchronized

import pydantic.v1 as pydantic  # hivemind's schema validator is written for pydantic's v1 API
from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase
from hivemind.utils import MPFuture, ValueWithExpiration, get_dht_time

METRICS_EXPIRATION = 600.0  # seconds a record lives unless refreshed
# A peer publishes at each global step, and again once its record is this old: DiLoCo's outer step can take longer
# than a record lives (50 inner steps of the small preset: ~860 s, three peers on 2 cores), and a peer whose record
# expired is nobody to the others (each took its outer step alone).
RECORD_REFRESH = METRICS_EXPIRATION / 4
MAX_OUTLIER_SENDERS = 8  # a record names at most this many senders of outliers, the most frequent ones
MAX_RECENT_LINEAGES = 8  # a record names the lineages of at most this many recent global steps
MAX_RUN_SETTINGS = 32  # a record carries at most this many run settings (RunSettings has 19)
AgreedValueType = str | int | float | bool | None  # training/config.py's AgreedValue
AgreedField = pydantic.StrictBool | pydantic.StrictInt | pydantic.StrictFloat | pydantic.constr(max_length=128) | None


def few_run_settings(settings: dict) -> dict:
    """A record's run settings (a peer's, or a run spec's), refused when more than MAX_RUN_SETTINGS."""
    if len(settings) > MAX_RUN_SETTINGS:
        raise ValueError(f"at most {MAX_RUN_SETTINGS} settings")
    return settings


class PeerMetrics(pydantic.BaseModel):
    step: pydantic.conint(ge=0, strict=True)  # the global step (hivemind epoch) this peer is at
    samples_per_second: pydantic.confloat(ge=0.0, strict=True)
    samples_accumulated: pydantic.conint(ge=0, strict=True)  # samples this peer contributed to the step
    total_samples: pydantic.conint(ge=0, strict=True)  # all samples contributed since the peer started
    loss: pydantic.StrictFloat  # mean local loss over the step's mini-batches
    mini_steps: pydantic.conint(ge=0, strict=True)
    display_name: pydantic.constr(max_length=64)
    finished: pydantic.StrictBool = False  # reached --max-steps and is leaving
    # A fingerprint of its parameters. Peers of a synchronous round hold the same ones up to the gradients'
    # compression noise (hivemind returns each peer the compressed difference to its own piece), so hashes differ.
    parameters_hash: pydantic.constr(max_length=64) = ""
    serves_state: pydantic.StrictBool = False  # a full peer: others can download its state (not a client-mode one)
    # A joining peer asks the swarm to hold its global step until this DHT time (see training/swarm/optimizer.py).
    joining_until: pydantic.confloat(ge=0.0, strict=True) = 0.0
    rounds_together: pydantic.conint(ge=0, strict=True) = 0  # global steps averaged with at least one other peer
    round_size: pydantic.conint(ge=0, strict=True) = 0  # peers whose gradients this peer's last step averaged
    username: pydantic.constr(max_length=64) = ""  # in an authenticated run: the username of this peer's token
    peer_id: pydantic.constr(max_length=64) = ""  # this peer's libp2p id, by which the others name it in `outliers`
    # The rounds this peer's parameters went through (training/swarm/optimizer.py's lineage): peers of equal lineage
    # hold the same parameters, up to the averaging's compression noise.
    lineage: pydantic.constr(max_length=16) = ""
    # (step, lineage) at each of its last few global steps since its last state download: peers compare lineages at
    # a step whatever step each has reached since (training/swarm/optimizer.py's `left_behind`)
    recent_lineages: list[tuple[pydantic.conint(ge=0, strict=True), pydantic.constr(max_length=16)]] = []
    dropped: pydantic.conint(ge=0, strict=True) = 0  # contributions this peer's last step dropped as poisoned
    clipped: pydantic.conint(ge=0, strict=True) = 0  # contributions this peer's last step's CenteredClip clipped
    # The run's settings as this peer trains with them (training/config.py's `agreed_values`): a peer set otherwise
    # is refused before it takes part in any round or downloads a state.
    run_settings: dict[pydantic.constr(max_length=32), AgreedField] = {}
    # What this peer's messages mean (training/config.py's PROTOCOL; records without it: an older ttt's) and its
    # ttt version: a peer of another protocol is refused before it joins (training/peer/view.py).
    protocol: pydantic.conint(ge=0, strict=True) = 1
    version: pydantic.constr(max_length=32) = ""
    inner_steps: pydantic.conint(ge=0, strict=True) = 0  # DiLoCo: inner steps taken in this outer step
    sent_bytes: pydantic.conint(ge=0, strict=True) = 0  # averaging parts and states sent to other peers so far
    # The swarm's data epoch this peer reads blocks of, and how many blocks an epoch has (training/swarm/leases.py;
    # 0: a stream of its own order): the monitor reads that epoch's leases to show its coverage.
    data_epoch: pydantic.conint(ge=0, strict=True) = 0
    epoch_blocks: pydantic.conint(ge=0, strict=True) = 0
    # Since this peer started: sender peer id -> its contributions this peer dropped or clipped (the largest few).
    outliers: dict[pydantic.constr(max_length=64), pydantic.conint(ge=0, strict=True)] = {}

    few_run_settings = pydantic.validator("run_settings", allow_reuse=True)(few_run_settings)

    @pydantic.validator("outliers")
    def few_outlier_senders(cls, outliers: dict) -> dict:
        if len(outliers) > MAX_OUTLIER_SENDERS:
            raise ValueError(f"at most {MAX_OUTLIER_SENDERS} senders")
        return outliers

    @pydantic.validator("recent_lineages")
    def few_recent_lineages(cls, lineages: list) -> list:
        if len(lineages) > MAX_RECENT_LINEAGES:
            raise ValueError(f"at most {MAX_RECENT_LINEAGES} steps")
        return lineages

    def lineages_held(self) -> dict[int, str]:
        """The lineage this peer held at each of its recent global steps, as its record says (an older ttt's record
        names only its current step's)."""
        held = dict(self.recent_lineages) | {self.step: self.lineage}
        return {step: lineage for step, lineage in held.items() if lineage}


class SpecRecord(pydantic.BaseModel):
    """A run's spec as a peer publishes it (training/spec.py's `RunSpec`)."""

    settings: dict[pydantic.constr(max_length=32), AgreedField]
    authority_key: pydantic.constr(max_length=2048) = ""  # the run's run.pub line, when the spec is signed
    signature: pydantic.constr(max_length=1024) = ""

    few_run_settings = pydantic.validator("settings", allow_reuse=True)(few_run_settings)


class RunsSchema(pydantic.BaseModel):
    """The key of every run's spec (`ttt_runs`), by the publisher's public key."""

    runs: dict[BytesWithPublicKey, SpecRecord]


class RunSchema(pydantic.BaseModel):
    """The run's keys in the DHT (each `{run_id}_{field}`), by the owner's public key."""

    metrics: dict[BytesWithPublicKey, PeerMetrics]
    credentials: dict[BytesWithPublicKey, pydantic.StrictBytes]  # an AccessToken protobuf
    revocations: dict[BytesWithPublicKey, pydantic.StrictBytes]  # a signed RevocationList


RUNS_PREFIX = "ttt"  # RunsSchema's key: ttt_runs


def runs_key() -> str:
    return f"{RUNS_PREFIX}_runs"


def metrics_key(run_id: str) -> str:
    return f"{run_id}_metrics"


def credentials_key(run_id: str) -> str:
    return f"{run_id}_credentials"


def revocations_key(run_id: str) -> str:
    return f"{run_id}_revocations"


def make_validators(run_id: str, rejected: Synchronized | None = None) -> tuple[list[RecordValidatorBase], bytes]:
    """The record validators every peer of a run attaches (counting what they reject in REJECTED, if given), and
    this peer's public key (its subkey)."""
    signature = RSASignatureValidator()
    schemas = [SchemaValidator(RunSchema, prefix=run_id), SchemaValidator(RunsSchema, prefix=RUNS_PREFIX)]
    return [RunValidator([*schemas, signature], rejected)], signature.local_public_key


def reader_validators() -> list[RecordValidatorBase]:
    """What a DHT client that only reads (`ttt train --join`, `ttt status`) needs: the records come signed, and the
    signature validator takes the signature off."""
    return [RunValidator([SchemaValidator(RunsSchema, prefix=RUNS_PREFIX), RSASignatureValidator()])]


# Nodes a read of the run's keys visits: the key's replicas (hivemind stores each record on the 5 nodes nearest its
# key). With hivemind's default beam, its bucket size (20), a read met min(N - 1, 20) copies of each record, since every
# node that read the key caches it (`python -m bench.records`: 15.0 at 16 nodes, 5.0 with this beam).
READ_BEAM = 5


def read_latest(dht: DHT, key: str, return_future: bool = False) -> ValueWithExpiration | None | MPFuture:
    """The latest records under KEY (`DHT.get(key, latest=True)`), from the READ_BEAM nodes nearest it: every read of
    a run's keys by ttt goes through here."""
    return dht.get(key, latest=True, return_future=return_future, beam_size=READ_BEAM)


CHECKED_RECORDS = 4096  # verdicts a RunValidator remembers (16-byte digests), the most recently used


class RunValidator(RecordValidatorBase):
    """The run's validators as one, checking each distinct record once and counting the rejected in `rejected`
    (shared memory, because the DHT validates in a process of its own; a monitor shows the count).

    A read with `latest=True` asks every node near the key, and each answers with every record under it, so one
    record arrives many times a second. Its RSA signature and its pydantic schema (39% of a DHT process's CPU when
    every copy was checked) are checked the first time, and the verdict is kept under a digest of the whole record
    (key, subkey, value and expiration, all of which the signature covers). Verdicts are forgotten when validators
    are added."""

    def __init__(self, validators: list[RecordValidatorBase], rejected: Synchronized | None = None) -> None:
        self.validators, self.rejected = CompositeValidator(validators), rejected
        self.verdicts: OrderedDict[bytes, bool] = OrderedDict()

    def validate(self, record: DHTRecord) -> bool:
        digest = record_digest(record)
        valid = self.verdicts.get(digest)
        if valid is None:
            valid = self.verdicts[digest] = self.validators.validate(record)
            if len(self.verdicts) > CHECKED_RECORDS:
                self.verdicts.popitem(last=False)  # the least recently seen
        else:
            self.verdicts.move_to_end(digest)
        if not valid and self.rejected is not None:
            with self.rejected.get_lock():
                self.rejected.value += 1
        return valid

    def merge_with(self, other: RecordValidatorBase) -> bool:
        """Take in the validators added later (hivemind's optimizer adds its own), so that they merge with the
        run's as they would without this wrapper: one signature check, one schema of all keys."""
        self.validators.extend([other])
        self.verdicts.clear()  # a record the old validators passed may fail the new ones
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        return self.validators.sign_value(record)

    def strip_value(self, record: DHTRecord) -> bytes:
        return self.validators.strip_value(record)


def record_digest(record: DHTRecord) -> bytes:
    """16 bytes that differ for any two records that differ in key, subkey, value or expiration time."""
    digest = hashlib.blake2b(digest_size=16)
    for part in (record.key, record.subkey, record.value):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    digest.update(struct.pack("<d", record.expiration_time))
    return digest.digest()


def publish_metrics(dht: DHT, run_id: str, public_key: bytes, metrics: PeerMetrics) -> None:
    dht.store(
        key=metrics_key(run_id),
        subkey=public_key,
        value=metrics.dict(),
        expiration_time=get_dht_time() + METRICS_EXPIRATION,
        return_future=True,
    )


def publish_spec(dht: DHT, public_key: bytes, spec: Mapping[str, AgreedValueType]) -> None:
    """Store the spec of the run this peer is in (training/config.py's `RunSpec.values()`) under its own subkey of
    `ttt_runs`, for as long as a metrics record."""
    settings = {name: value for name, value in spec.items() if name not in ("authority_key", "signature")}
    record = SpecRecord(settings=settings, authority_key=spec["authority_key"], signature=spec["signature"])
    dht.store(
        key=runs_key(),
        subkey=public_key,
        value=record.dict(),
        expiration_time=get_dht_time() + METRICS_EXPIRATION,
        return_future=True,
    )


def read_spec_values(dht: DHT) -> list[dict]:
    """Every run spec the swarm holds, one per publisher, as `RunSpec.values()` gives them (training/spec.py's
    `specs_from_records` checks them)."""
    found = read_latest(dht, runs_key())
    if found is None or not isinstance(found.value, dict):
        return []
    values = []
    for entry in found.value.values():
        try:
            record = SpecRecord.parse_obj(entry.value)
        except (pydantic.ValidationError, TypeError):  # the validators already reject these; be safe
            continue
        values.append({**record.settings, "authority_key": record.authority_key, "signature": record.signature})
    return values


def read_metrics(dht: DHT, run_id: str, revoked: Collection[str] = ()) -> list[PeerMetrics]:
    """Every live peer's latest validated metrics, without those of revoked users."""
    return parse_metrics(read_latest(dht, metrics_key(run_id)), revoked)


def parse_metrics(found: ValueWithExpiration | None, revoked: Collection[str] = ()) -> list[PeerMetrics]:
    """The records of a `dht.get` of the metrics key, without those of revoked users."""
    return [record.metrics for record in unrevoked_records(found, revoked)]


def unrevoked_records(found: ValueWithExpiration | None, revoked: Collection[str] = ()) -> list[PeerRecord]:
    """The same, with when each was published."""
    return [record for record in parse_records(found)[0] if record.metrics.username not in revoked]


@dataclass(frozen=True)
class PeerRecord:
    """One peer's latest metrics as a monitor sees them."""

    key: str  # a short fingerprint of the public key that signed it: one per peer process
    metrics: PeerMetrics
    published_at: float  # DHT time


def peer_key(subkey: bytes) -> str:
    return hashlib.sha256(bytes(subkey)).hexdigest()[:16]


def parse_records(
    found: ValueWithExpiration | None, usernames: Mapping[bytes, str] | None = None
) -> tuple[list[PeerRecord], int]:
    """The valid records of a `dht.get` of the metrics key, and how many entries were rejected.

    `usernames` (an authenticated run): subkey -> the username of its valid credential. Only those records are
    kept, named by that username (the leaderboard credits users, not self-chosen names); the others count as
    rejected (revoked, or never admitted).
    """
    if found is None or not isinstance(found.value, dict):
        return [], 0
    records, rejected = [], 0
    for subkey, entry in found.value.items():
        try:
            metrics = PeerMetrics.parse_obj(entry.value)
        except (pydantic.ValidationError, TypeError):  # the validators already reject these; be safe
            rejected += 1
            continue
        if usernames is not None:
            if bytes(subkey) not in usernames:
                rejected += 1
                continue
            username = usernames[bytes(subkey)]
            metrics = metrics.copy(update={"username": username, "display_name": username})
        records.append(PeerRecord(peer_key(subkey), metrics, entry.expiration_time - METRICS_EXPIRATION))
    return records, rejected
