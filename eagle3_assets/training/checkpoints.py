"""Checkpoints and the final draft on disk: every write atomic, every resume checked against the run's fingerprint.

``checkpoints/epoch_NNNN.pt`` (one per epoch) holds the trainable weights, the optimizer and scheduler state, the RNG
state and the metric history. A re-run resumes after the newest whole checkpoint whose fingerprint (data, verifier,
model shape, hyper-parameters except ``epochs`` and the process count) matches, so raising ``epochs`` continues a
finished run and a run may resume with another number of processes (the state is replicated, not sharded).
``final/`` is the draft in speculators' format, renamed into place whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3_assets.storage import atomic_path, ensure_free_space, replace_dir_atomic
from eagle3_assets.training.config import TrainConfig

CHECKPOINT_DIR = "checkpoints"
FINAL_DIR = "final"
HISTORY_FILE = "training_history.json"
# Loaded again from the verifier when the model is rebuilt: not worth a copy in every checkpoint.
VERIFIER_OWNED = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")


def fingerprint(
    train_keys: Sequence[str],
    val_key: str,
    verifier: Path,
    layer_ids: list[int],
    vocab: int,
    config: TrainConfig,
    data_samples: int,
) -> str:
    payload = {
        "train": list(train_keys),
        "val": val_key,
        "verifier": str(verifier),
        "layer_ids": layer_ids,
        "draft_vocab_size": vocab,
        "data_samples": data_samples,
        "config": config.fingerprint_fields(),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    return sorted(ckpt_dir.glob("epoch_*.pt"))


def load_latest_checkpoint(ckpt_dir: Path, expected: str, notes: list[str]) -> dict[str, Any] | None:
    import torch

    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as error:
            notes.append(f"skipped unreadable checkpoint {path.name}: {type(error).__name__}")
            continue
        if state.get("fingerprint") != expected:
            notes.append(f"ignored checkpoint {path.name}: made for different data or settings; starting fresh")
            return None
        return state
    return None


def rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def save_final(model: Any, final_dir: Path, dtype: str) -> None:
    import copy

    import torch

    tmp = final_dir.with_name(f".{final_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    to_save = model if dtype == "float32" else copy.deepcopy(model).to(getattr(torch, dtype))
    to_save.save_pretrained(str(tmp))
    replace_dir_atomic(tmp, final_dir)  # the old final/ moved aside, the new one renamed in, the old one removed


def save_checkpoint(
    ckpt_dir: Path,
    epoch: int,
    model: Any,
    optimizers: list,
    schedulers: list,
    history: dict,
    fingerprint: str,
    config: TrainConfig,
) -> None:
    """The trainable weights, optimizer, scheduler and RNG state and the history after ``epoch``, written atomically;
    only the newest ``keep_checkpoints`` are kept. Called on rank 0 only (every rank holds the same state)."""
    import io

    import torch

    weights = {k: v.detach().cpu() for k, v in model.state_dict().items() if k not in VERIFIER_OWNED}
    state = {
        "epoch": epoch,
        "fingerprint": fingerprint,
        "model": weights,
        "optimizers": [o.state_dict() for o in optimizers],
        "schedulers": [s.state_dict() for s in schedulers],
        "rng": rng_state(),
        "history": history,
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    path = ckpt_dir / f"epoch_{epoch:04d}.pt"
    ensure_free_space(ckpt_dir, len(data), "draft_model checkpoint")
    with atomic_path(path, needed_bytes=len(data)) as tmp:
        tmp.write_bytes(data)
    for old in list_checkpoints(ckpt_dir)[: -config.keep_checkpoints]:
        old.unlink(missing_ok=True)
