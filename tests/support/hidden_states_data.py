"""Small, deterministic inputs for tests: a tiny verifier, a fabricated responses partition, and the inputs of
``draft_model`` built from them.

Both are the project's own (``eagle3_assets.local.tiny_model``, ``eagle3_assets.prompts.sample_data``, which the
benchmarks use too); here with the tests' smaller default shape (hidden 64, vocabulary 1,024).
"""

from __future__ import annotations

from pathlib import Path

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.prompts.sample_data import fabricate_responses

# two training partitions and one held out
TRAINING_KEYS = ["00000", "00001", "00002"]

__all__ = [
    "TRAINING_KEYS",
    "cached_tiny_verifier",
    "copy_training_inputs",
    "fabricate_responses",
    "tiny_verifier",
    "training_inputs",
]


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


def record_checks_as_the_assets_do(layout: DataLayout, key: str) -> None:
    """What the two partitioned assets record after their checks (the hidden states' real outcomes; the responses
    were fabricated whole), so the hold-out rule and training see the partition as the pipeline would leave it."""
    from eagle3_assets.core import hashing, lineage
    from eagle3_assets.hidden_states import check_finite, check_one_per_ok_response, check_token_ids

    digest = hashing.file_digest(layout.responses_path(key))
    lineage.PartitionLineage("synthetic_responses", key, digest, checks={"fabricated_whole": True}).save(layout)
    checks = (check_token_ids, check_finite, check_one_per_ok_response)
    lineage.record_checks(layout, "hidden_states", key, {c.__name__: c(layout, key).passed for c in checks})


def training_inputs(data_dir: Path) -> tuple[DataLayout, Path]:
    """(a data dir ready for ``draft_model``, the tiny verifier): TRAINING_KEYS' hidden_states (48 fabricated
    responses each) with what their assets record after the checks (their real outcomes; the responses were
    fabricated whole), and a 256-token vocabulary mapping of the first two."""
    from eagle3_assets.hidden_states import (
        HiddenStatesConfig,
        extract_partition,
    )
    from eagle3_assets.training import build_vocab_mapping

    verifier = cached_tiny_verifier()
    layout = DataLayout.at(data_dir)
    for key in TRAINING_KEYS:
        fabricate_responses(layout, key, 48, min_words=20, max_words=40)
        extract_partition(layout, key, verifier, HiddenStatesConfig(layer_ids=[1, 2, 3]))
        record_checks_as_the_assets_do(layout, key)
    build_vocab_mapping(layout, TRAINING_KEYS[:2], draft_vocab_size=256, target_vocab_size=1024)
    return layout, verifier


def copy_training_inputs(src: DataLayout, dst: Path) -> DataLayout:
    """``training_inputs``' files copied to ``dst`` (a test's own data dir; the locks stay behind)."""
    import shutil

    for asset in ("synthetic_responses", "hidden_states", "vocab_mapping"):
        shutil.copytree(src.asset_dir(asset), dst / asset, ignore=shutil.ignore_patterns("_locks"))
    return DataLayout.at(dst)
