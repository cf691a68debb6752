"""The verifier's shape from its config (no weights loaded) and EAGLE-3's auxiliary layer ids on it.

Below every stage and the local vLLM launcher: hidden states, training and ``eagle3 serve-local`` all read them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from eagle3_assets.core.settings import ConfigError

LAYER_IDS_KEY = "layer_ids"
# k: the draft tokens proposed per step (vLLM's num_speculative_tokens) and the positions a draft is trained on
# (training-time-test steps); every default of either is this one
SPECULATIVE_TOKENS = 3


@dataclass(frozen=True)
class VerifierShape:
    num_layers: int
    hidden_size: int
    vocab_size: int


def verifier_shape(verifier_path: str | Path) -> VerifierShape:
    """The verifier's layer count and widths from its config alone (no weights loaded)."""
    # lazy: loads transformers (heavy), which only this path needs
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(verifier_path))
    config = getattr(config, "text_config", config)  # multimodal wrappers keep the LM config inside
    return VerifierShape(config.num_hidden_layers, config.hidden_size, config.vocab_size)


def resolve_layer_ids(layer_ids: Sequence[int] | None, num_layers: int, key: str = LAYER_IDS_KEY) -> list[int]:
    """Default ``[2, N//2, N-3]`` (EAGLE-3's), validated against the verifier; errors name ``key`` and the value."""
    explicit = layer_ids is not None
    ids = list(layer_ids) if layer_ids is not None else [2, num_layers // 2, num_layers - 3]
    problem = None
    if not ids:
        problem = "needs at least one layer id"
    elif any(i < 0 or i >= num_layers for i in ids):
        problem = f"layer ids must lie in [0, {num_layers - 1}] for this {num_layers}-layer verifier"
    elif any(b <= a for a, b in itertools.pairwise(ids)):
        problem = "layer ids must be distinct and increasing (vLLM collects auxiliary states in layer order)"
    if problem is None:
        return ids
    if explicit:
        raise ConfigError(f"{key}={ids!r}: {problem}")
    raise ConfigError(
        f"{key}=None (default [2, N//2, N-3] = {ids!r}): {problem}; set {key} explicitly "
        f"(e.g. {list(range(1, min(num_layers, 4)))} for a small verifier)"
    )
