"""Deterministic hashes of JSON-like values, shared by lineage (every stage) and request fingerprints (generation)."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(value: Any) -> bytes:
    """Deterministic JSON: sorted keys, no whitespace, UTF-8 (so equal values hash equally on every machine)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str).encode()


def digest(value: Any, length: int = 32) -> str:
    """sha256 of :func:`canonical_json` of ``value``, as ``length`` hex characters."""
    return hashlib.sha256(canonical_json(value)).hexdigest()[:length]
