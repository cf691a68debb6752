"""Every content hash of the project: of JSON-like values (lineage, request fingerprints) and of files (data versions,
the verifier's weights, the vocabulary mapping)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def canonical_json(value: Any) -> bytes:
    """Deterministic JSON: sorted keys, no whitespace, UTF-8 (so equal values hash equally on every machine)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str).encode()


def digest(value: Any, length: int = 32) -> str:
    """sha256 of :func:`canonical_json` of ``value``, as ``length`` hex characters."""
    return hashlib.sha256(canonical_json(value)).hexdigest()[:length]


def file_digest(path: Path, length: int = 32) -> str:
    """sha256 of a file's bytes (streamed), as ``length`` hex characters: a content hash for data versions."""
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            sha.update(block)
    return sha.hexdigest()[:length]


def files_digest(paths: Iterable[Path]) -> str:
    """A content hash over several files (name and bytes), e.g. the vocabulary mapping a draft is trained with."""
    return digest([(Path(p).name, file_digest(Path(p), 64)) for p in sorted(paths, key=str) if os.path.exists(p)])
