"""Hidden states of the verifier for EAGLE-3 training (Dagster-free; heavy imports happen inside functions)."""

from __future__ import annotations

from eagle3_assets.hidden_states.extract import (
    CheckOutcome,
    HiddenStatesConfig,
    HiddenStatesResult,
    check_finite,
    check_one_per_ok_response,
    check_token_ids,
    extract_partition,
)

__all__ = [
    "CheckOutcome",
    "HiddenStatesConfig",
    "HiddenStatesResult",
    "check_finite",
    "check_one_per_ok_response",
    "check_token_ids",
    "extract_partition",
]
