"""Which hidden-states folders a training run reads: the pinned version of each partition, and their metadata.

A re-extraction publishes a new version beside the one training reads and never swaps files under it
(:mod:`eagle3_assets.hidden_states.publish`);
speculators' dataset opens sample files lazily, so training must read from the
version folders it pinned, never through the partition's pointer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_assets.core.storage import DataLayout, read_json
from eagle3_assets.hidden_states import publish
from eagle3_assets.hidden_states.extract import META_FILE
from eagle3_assets.hidden_states.publish import INDEX_FILE

if TYPE_CHECKING:
    from eagle3_assets.training.ranks import Ranks


def _broadcast(ranks: Ranks, value: Any) -> Any:
    """Rank 0's ``value`` on every rank (a picklable object)."""
    if ranks.world == 1:
        return value
    # lazy: loads torch (heavy), which only this path needs
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def pinned_partitions(layout: DataLayout, keys: Sequence[str], ranks: Ranks) -> Iterator[dict[str, Path]]:
    """The version folder of each hidden_states partition, pinned while training reads it: a re-extraction
    publishes a new version beside it and never swaps or removes these files (publish.py). Rank 0 pins the
    current versions; the other ranks pin the very same folders (a publish between two ranks' look-ups
    cannot give them different data)."""
    if ranks.main:
        with publish.pinned(layout, keys) as dirs:
            _broadcast(ranks, {k: str(v) for k, v in dirs.items()})
            yield dirs
    else:
        chosen = _broadcast(ranks, None)
        with publish.pinned(layout, keys, chosen) as dirs:
            yield dirs


def partition_meta(layout: DataLayout, keys: Sequence[str], dirs: Mapping[str, Path] | None = None) -> dict[str, Any]:
    """The partitions' shared extraction metadata (of the pinned ``dirs`` when given); an error names the two
    that disagree."""
    metas = {}
    for key in keys:
        folder = (dirs or {}).get(key) or layout.hidden_states_dir(key)
        if not (folder / INDEX_FILE).exists() and not layout.hidden_states_index_path(key).exists():
            index = layout.hidden_states_index_path(key)
            raise FileNotFoundError(f"hidden_states partition {key} is not complete (no {index})")
        metas[key] = read_json(folder / META_FILE)
    first_key, first = next(iter(metas.items()))
    for key, meta in metas.items():
        for name in ("layer_ids", "hidden_size", "vocab_size"):
            if meta[name] != first[name]:
                raise ValueError(
                    f"hidden_states partitions disagree on {name}: {first_key} has {first[name]}, "
                    f"{key} has {meta[name]} (re-extract them with the same verifier and layer_ids)"
                )
    return first
