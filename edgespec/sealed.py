"""JSON records edgespec writes and reads back, sealed with a SHA-256 of their content.

`seal(data)` adds a "sha256" entry: the hash of the rest in canonical form (keys sorted, no
spaces). `unseal(data)` returns the record without it when the hash matches, else None: an
edited, truncated or foreign file reads as absent (its reader then does the work again or
refuses by name) and is never trusted. Used by the learnt-cost files (edgespec.calibration)
and the self-speculation skip sets (edgespec.drafters.self_spec).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

KEY = "sha256"


def digest(data: dict[str, Any]) -> str:
    rest = {k: v for k, v in data.items() if k != KEY}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def seal(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with its hash (the values as JSON will store them: write it with default=str)."""
    plain = json.loads(json.dumps({k: v for k, v in data.items() if k != KEY}, default=str))
    return {**plain, KEY: digest(plain)}


def unseal(data: Any) -> dict[str, Any] | None:
    """The record without its hash when the hash matches; None for anything else."""
    if not isinstance(data, dict) or not isinstance(data.get(KEY), str) or data[KEY] != digest(data):
        return None
    return {k: v for k, v in data.items() if k != KEY}
