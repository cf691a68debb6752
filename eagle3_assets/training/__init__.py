"""Vocabulary mapping and EAGLE-3 draft training around speculators (Dagster-free; heavy imports are lazy).

Modules: ``train_config`` (TrainConfig, TrainResult), ``model`` (the draft), ``checkpoints`` (resume and final save),
``loop`` (the training loop, one rank or N), ``launch`` (torchrun for N processes), ``vocab`` (draft vocabulary),
``data`` (loaders of stored states), ``online_states`` (states fetched while training), ``pinning`` (the hidden-state
versions a run reads).
"""

from eagle3_assets.training.loop import train_draft
from eagle3_assets.training.train_config import TrainConfig, TrainResult
from eagle3_assets.training.vocab import VocabResult, build_vocab_mapping, load_vocab_mapping

__all__ = [
    "TrainConfig",
    "TrainResult",
    "VocabResult",
    "build_vocab_mapping",
    "load_vocab_mapping",
    "train_draft",
]
