"""A data-quality check's outcome: what every stage's checks return (Dagster-free); ``defs/checks.py`` turns it
into a Dagster check result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class CheckOutcome:
    passed: bool
    description: str
    metadata: dict[str, Any] = field(default_factory=dict)
