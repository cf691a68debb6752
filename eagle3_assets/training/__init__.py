"""Vocabulary mapping and EAGLE-3 draft training around speculators (Dagster-free; heavy imports are lazy)."""

from __future__ import annotations

from eagle3_assets.training.train import TrainConfig, TrainResult, train_draft
from eagle3_assets.training.vocab import VocabResult, build_vocab_mapping, load_vocab_mapping

__all__ = ["TrainConfig", "TrainResult", "VocabResult", "build_vocab_mapping", "load_vocab_mapping", "train_draft"]
