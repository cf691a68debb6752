"""Hidden states of the verifier for EAGLE-3 training (Dagster-free; heavy imports happen inside functions): chat
rendering and loss masks, the two backends (``hf`` in-process, ``vllm`` through extraction servers), the sample
files, and a partition's lifecycle: built aside, published whole by one pointer switch (``publish``), its lineage
recorded and judged stale or current (``versions``), its checks (``state_checks``).
"""

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
