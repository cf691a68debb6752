"""Small, deterministic inputs for tests: a tiny verifier and a fabricated responses partition.

Both are the project's own (``eagle3_assets.local.tiny_model``, ``eagle3_assets.sample_data``, which the
benchmarks use too); here with the tests' smaller default shape (hidden 64, vocabulary 1,024).
"""

from __future__ import annotations

from pathlib import Path

from eagle3_assets.sample_data import fabricate_responses

__all__ = ["cached_tiny_verifier", "fabricate_responses", "tiny_verifier"]


def tiny_verifier(
    out_dir: Path, seed: int = 0, num_layers: int = 4, hidden_size: int = 64, vocab_size: int = 1024
) -> Path:
    """A tiny random verifier folder (model + tokenizer with a reasoning chat template); built once per folder."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    from eagle3_assets.local.tiny_model import build_tiny_model

    return Path(
        build_tiny_model(out_dir, seed=seed, num_layers=num_layers, hidden_size=hidden_size, vocab_size=vocab_size)
    )


def cached_tiny_verifier(seed: int = 0, num_layers: int = 4, hidden_size: int = 64, vocab_size: int = 1024) -> Path:
    """``tiny_verifier`` built once per machine under the temp dir (``cached_tiny_model``)."""
    from eagle3_assets.local.tiny_model import cached_tiny_model

    return cached_tiny_model(seed=seed, num_layers=num_layers, hidden_size=hidden_size, vocab_size=vocab_size)
