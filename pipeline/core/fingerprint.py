"""Settings fingerprints: how a resumed run knows it is the same run (the preprocess manifest, the stream state)."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def as_saved(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings as they read back from JSON (tuples become lists), so saved and current compare equal."""
    return json.loads(json.dumps(settings))


def fingerprint(settings: dict[str, Any]) -> str:
    """A stable hash of everything that changes the output."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def differing_keys(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The settings whose saved and current values differ (sorted); empty when it is the same run."""
    current = as_saved(current)
    return sorted(key for key in set(saved) | set(current) if saved.get(key) != current.get(key))
