"""The draft vocabulary: the most frequent assistant tokens, mapped with speculators' own function.

Frequencies are the partitions' ``token_freq.pt`` (loss-masked tokens only, as speculators counts them),
summed over the given partitions. ``build_vocab_mappings_from_distribution`` picks the top ``draft_vocab_size``
ids and returns ``d2t`` (int64 [draft], target id = i + d2t[i]) and ``t2d`` (bool [target]).

A configured draft vocabulary larger than the target's is capped at the target's size (a draft cannot have
more tokens than the verifier; this is the case for tiny verifiers with the default 32000) and the result
says so in ``notes``. When the two sizes are equal speculators treats the draft as full-vocabulary and ignores
the mappings, which is exactly right.

Written to ``layout.vocab_mapping_dir``: ``d2t.npy``, ``t2d.npy`` (the files speculators' CLI takes as
``--d2t-path``/``--t2d-path``), ``token_freq.pt`` (the merged counts) and ``vocab.json`` (sizes, coverage).
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_assets.settings import ConfigError
from eagle3_assets.storage import DataLayout, exclusive_lock, write_bytes_atomic, write_json_atomic

D2T_FILE = "d2t.npy"
T2D_FILE = "t2d.npy"
FREQ_FILE = "token_freq.pt"
SUMMARY_FILE = "vocab.json"


@dataclass
class VocabResult:
    draft_vocab_size: int  # the size used (after capping)
    requested_draft_vocab_size: int
    target_vocab_size: int
    capped: bool
    distinct_tokens: int  # distinct loss-masked token ids seen
    loss_tokens: int  # loss-masked tokens counted
    coverage: float  # share of loss-masked tokens whose id is in the draft vocabulary
    partitions: list[str]
    d2t_path: Path
    t2d_path: Path
    token_freq_path: Path
    notes: list[str] = field(default_factory=list)


def _npy_bytes(array: object) -> bytes:
    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def load_vocab_mapping(layout: DataLayout) -> tuple[object, object] | None:
    """(d2t, t2d) as torch tensors, or None when no mapping was built."""
    import numpy as np
    import torch

    d2t, t2d = layout.vocab_mapping_dir / D2T_FILE, layout.vocab_mapping_dir / T2D_FILE
    if not (d2t.exists() and t2d.exists()):
        return None
    return torch.from_numpy(np.load(d2t)), torch.from_numpy(np.load(t2d))


def build_vocab_mapping(
    layout: DataLayout,
    partition_keys: Sequence[str],
    draft_vocab_size: int = 32000,
    *,
    target_vocab_size: int,
) -> VocabResult:
    # Cheap checks first: importing torch and speculators takes ~20 s.
    if draft_vocab_size <= 0:
        raise ConfigError(f"draft_vocab_size={draft_vocab_size!r}: must be a positive integer")
    if target_vocab_size <= 0:
        raise ConfigError(f"target_vocab_size={target_vocab_size!r}: must be a positive integer")
    if not partition_keys:
        raise ValueError("vocab_mapping needs at least one hidden_states partition")

    import torch

    from eagle3_assets.hidden_states.extract import TOKEN_FREQ_FILE
    from eagle3_assets.speculators_adapter import build_vocab_mappings

    counts: Counter[int] = Counter()
    for key in partition_keys:
        path = layout.hidden_states_dir(key) / TOKEN_FREQ_FILE
        if not path.exists():
            raise FileNotFoundError(f"hidden_states partition {key} has no {TOKEN_FREQ_FILE} at {path}")
        counts.update(torch.load(path, weights_only=True))
    if any(t < 0 or t >= target_vocab_size for t in counts):
        raise ValueError(f"token ids outside the target vocabulary of {target_vocab_size}: wrong verifier?")

    notes = []
    size = draft_vocab_size
    if size > target_vocab_size:
        size = target_vocab_size
        notes.append(
            f"draft_vocab_size {draft_vocab_size} capped at the target vocabulary size {target_vocab_size} "
            "(full vocabulary: speculators ignores the mapping)"
        )
    freq = dict(counts)
    d2t, t2d = build_vocab_mappings(freq, draft_vocab_size=size, target_vocab_size=target_vocab_size)

    loss_tokens = sum(freq.values())
    covered = sum(n for t, n in freq.items() if bool(t2d[t]))
    coverage = covered / loss_tokens if loss_tokens else 0.0
    if len(freq) < size:
        notes.append(f"only {len(freq)} distinct assistant tokens seen; the rest of the draft vocabulary is filler")

    out = layout.vocab_mapping_dir
    with exclusive_lock(layout.lock_path("vocab_mapping"), "vocab_mapping"):
        buffer = io.BytesIO()
        torch.save(freq, buffer)
        write_bytes_atomic(buffer.getvalue(), out / FREQ_FILE)
        write_bytes_atomic(_npy_bytes(d2t.numpy()), out / D2T_FILE)
        write_bytes_atomic(_npy_bytes(t2d.numpy()), out / T2D_FILE)
        result = VocabResult(
            draft_vocab_size=size,
            requested_draft_vocab_size=draft_vocab_size,
            target_vocab_size=target_vocab_size,
            capped=size != draft_vocab_size,
            distinct_tokens=len(freq),
            loss_tokens=loss_tokens,
            coverage=coverage,
            partitions=list(partition_keys),
            d2t_path=out / D2T_FILE,
            t2d_path=out / T2D_FILE,
            token_freq_path=out / FREQ_FILE,
            notes=notes,
        )
        summary = {k: (str(v) if isinstance(v, Path) else v) for k, v in result.__dict__.items()}
        write_json_atomic(summary, out / SUMMARY_FILE)
    return result
