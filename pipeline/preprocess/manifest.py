"""The run manifest: which shards are finished, with their row counts and checksums.

It lives beside the data (`ttt_manifest.json`) and is what makes a killed run resumable:
a shard counts as finished only when its file was renamed into place *and* recorded
here with a matching sha256. The settings fingerprint refuses a re-run with different
settings into the same output.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.core.files import sha256_file, write_atomic

MANIFEST_NAME = "ttt_manifest.json"
MANIFEST_VERSION = 1


@dataclass
class ShardRecord:
    path: str  # relative to the dataset folder
    rows: int  # rows written
    bytes: int
    sha256: str
    planned_rows: int  # rows the shard was given after filtering
    jpeg_bytes: int  # size of the downloaded (resized) JPEGs the codes replace
    failures: dict[str, int]  # download/resize failures by reason
    seconds: dict[str, float]  # time spent per stage (download, encode, write)


@dataclass
class Manifest:
    fingerprint: str
    settings: dict[str, Any]
    num_shards: int
    shards: dict[int, ShardRecord] = field(default_factory=dict)
    version: int = MANIFEST_VERSION

    def finished(self, folder: Path) -> set[int]:
        """Shards recorded here whose file is present with the recorded checksum."""
        done = set()
        for index, record in self.shards.items():
            path = folder / record.path
            if path.is_file() and path.stat().st_size == record.bytes and sha256_file(path) == record.sha256:
                done.add(index)
        return done

    def save(self, folder: Path) -> None:
        payload = asdict(self)
        payload["shards"] = {str(i): asdict(r) for i, r in sorted(self.shards.items())}
        write_atomic(folder / MANIFEST_NAME, json.dumps(payload, indent=1, sort_keys=True).encode())

    @classmethod
    def load(cls, folder: Path) -> Manifest | None:
        path = folder / MANIFEST_NAME
        if not path.exists():
            return None
        raw = json.loads(path.read_text())
        shards = {int(i): ShardRecord(**r) for i, r in raw.pop("shards").items()}
        return cls(shards=shards, **raw)
