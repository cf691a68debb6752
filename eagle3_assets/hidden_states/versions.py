"""A hidden_states partition's versions at the level of its lineage: built aside, recorded, published whole, and
whether the version a reader pinned is still what it would be built from now (Dagster-free).

The pointer mechanics (version folders, the atomic switch, recovery, sweeping, pins) are ``publish.py`` beside it;
what a partition was built from (:class:`~eagle3_assets.core.lineage.PartitionLineage`) is ``core/lineage.py``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Collection, Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from eagle3_assets.core import hashing, storage
from eagle3_assets.core.hashing import digest
from eagle3_assets.core.lineage import LINEAGE_FILE, PartitionLineage, verifier_fingerprint
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.hidden_states import publish

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- hidden states: build aside, publish


def hidden_states_staging_dir(layout: DataLayout, partition_key: str) -> Path:
    return publish.staging_dir(layout, partition_key)


_STAGING_INPUTS = "_staging_inputs.json"  # marks a build in progress; removed when it is published


def hidden_states_extraction_inputs(
    layout: DataLayout, verifier_path: Path, layer_ids: list[int], max_seq_len: int, dtype: str
) -> dict[str, Any]:
    """What a stored hidden state depends on besides its tokens (each sample file is checked against those)."""
    return {
        "verifier": verifier_fingerprint(verifier_path, cache_dir=layout.asset_dir("hidden_states")),
        "layer_ids": list(layer_ids),
        "max_seq_len": int(max_seq_len),
        "dtype": dtype,
    }


def _link_tree(source: Path, target: Path) -> None:
    """Hard-link every file of ``source`` into ``target`` where ``target`` has none (copy across filesystems);
    the version's own index, lineage and pin file are not carried over (a build writes its own).

    Every writer replaces files by rename, never in place, so a link shared with the published folder is safe.
    """
    for path in source.rglob("*"):
        if not path.is_file() or (path.parent == source and path.name in publish.VERSION_OWN_FILES):
            continue
        dest = target / path.relative_to(source)
        if dest.exists():
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, dest)
        except OSError:
            shutil.copy2(path, dest)


def begin_hidden_states(layout: DataLayout, partition_key: str, extraction: Mapping[str, Any]) -> Path:
    """The folder to (re)build a hidden_states partition in, while the published one stays untouched.

    Kept across a killed run for the same extraction inputs (its finished samples resume); otherwise emptied.
    Seeded with hard links to the published partition's files when that was built with the same verifier
    content, layer ids, max_seq_len and dtype (the per-sample check then keeps only files whose tokens still
    match); a partition built from anything else, or of unknown provenance, is recomputed from scratch.
    A kill interrupted publish earlier is finished first (``publish.recover``: the caller holds the lock).
    """
    for line in publish.recover(layout, partition_key):
        logger.info("hidden_states %s: %s", partition_key, line)
    staging = hidden_states_staging_dir(layout, partition_key)
    marker = staging / _STAGING_INPUTS
    try:
        same = json.loads(marker.read_text()) == dict(extraction)
    except (OSError, ValueError):
        same = False
    if not same:
        shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True, exist_ok=True)
    for name in publish.VERSION_OWN_FILES:  # a killed build's index or lineage: rewritten at the end
        (staging / name).unlink(missing_ok=True)
    storage.write_json_atomic(dict(extraction), marker)
    published = PartitionLineage.load(layout, "hidden_states", partition_key)
    live = publish.current_version(layout, partition_key)
    if published is not None and published.inputs.get("extraction") == dict(extraction) and live is not None:
        _link_tree(live, staging)
    return staging


def record_hidden_states(
    staging: Path, partition_key: str, extraction: Mapping[str, Any], responses_digest: str
) -> PartitionLineage:
    """Write the build's lineage into ``staging`` (before it is published: it switches with the folder).

    ``responses_digest`` is the digest of exactly the responses bytes the build read (computed while reading),
    so a regeneration of the partition meanwhile never makes these states look current. The data version
    hashes those inputs and the index content, so Dagster marks the partition (and the draft) stale when either
    changes."""
    # lazy: the module has its own name for it
    from eagle3_assets.hidden_states.publish import INDEX_FILE, LINEAGE_FILE

    inputs = {"responses_data_version": responses_digest, "extraction": dict(extraction)}
    index_digest = hashing.file_digest(staging / INDEX_FILE)
    lineage = PartitionLineage(
        "hidden_states",
        partition_key,
        data_version=digest([inputs, index_digest]),
        inputs={**inputs, "index": index_digest},
    )
    storage.write_json_atomic(asdict(lineage), staging / LINEAGE_FILE)
    return lineage


def publish_hidden_states(
    layout: DataLayout, partition_key: str, staging: Path, files_synced_in: Collection[str] = ()
) -> Path:
    """Make the complete build (index and lineage written into it) the partition's current version with one
    atomic switch (``publish.publish``); returns the partition's folder (its pointer). ``files_synced_in``: the
    subfolders whose files were each fsynced when written (the per-sample files)."""
    return publish.publish(layout, partition_key, staging, _STAGING_INPUTS, files_synced_in)


# ------------------------------------------------------------------------------ stale downstream partitions


def _differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    return sorted(k for k in current if recorded.get(k) != current[k])


def stale_hidden_states(
    layout: DataLayout,
    keys: Iterable[str] | None = None,
    extraction: Mapping[str, Any] | None = None,
    dirs: Mapping[str, Path] | None = None,
    responses_required: bool = True,
) -> dict[str, str]:
    """hidden_states partitions built from other responses than the file on disk now, or (given the current
    ``extraction`` settings, any subset of verifier / layer_ids / max_seq_len / dtype) with other settings:
    key -> why. Partitions without a lineage record are left to the checks (not recorded: not trained on).

    THE staleness rule: ``eagle3 status``, ``backfill --missing``, training and the evaluation all ask it.
    ``dirs``: the version folder each key's reader pinned (its lineage is judged, not the pointer's now).
    ``responses_required`` False: a partition whose responses file is absent is not stale for that (states copied
    to another machine to train there: nothing contradicts them; status and backfill still report it)."""
    stale: dict[str, str] = {}
    for key in publish.known_keys(layout) if keys is None else keys:
        pinned = (dirs or {}).get(key)
        hidden = (
            PartitionLineage.load_file(pinned / LINEAGE_FILE)
            if pinned is not None
            else PartitionLineage.load(layout, "hidden_states", key)
        )
        if hidden is None or not hidden.data_version:
            continue
        responses = layout.responses_path(key)
        why = []
        if not responses.exists():
            if responses_required:
                why.append("its synthetic_responses file is gone")
        elif hidden.inputs.get("responses_data_version") != hashing.file_digest(responses):
            why.append("built from other responses than those on disk")
        changed = _differences(hidden.inputs.get("extraction") or {}, extraction or {})
        if changed:
            why.append(f"built with other settings ({', '.join(changed)})")
        if why:
            stale[key] = "; ".join(why)
    return stale


class StaleHiddenStatesError(ValueError):
    """A reader (training, the evaluation) was given hidden states built from other inputs than the current ones;
    the message names each partition, what differs and the remedy."""


def require_current_hidden_states(
    layout: DataLayout,
    keys: Iterable[str],
    extraction: Mapping[str, Any],
    dirs: Mapping[str, Path],
    reader: str,
) -> None:
    """Refuse (:class:`StaleHiddenStatesError`) when any of ``keys``' pinned versions (``dirs``) is stale by
    :func:`stale_hidden_states` against ``extraction`` (what ``reader`` would use now): a draft is never trained
    or measured on states of another verifier, other layers or other responses (states whose responses file is
    absent here, copied to train elsewhere, are read)."""
    stale = stale_hidden_states(layout, list(keys), extraction, dirs, responses_required=False)
    if not stale:
        return
    listed = "; ".join(f"{key} ({why})" for key, why in sorted(stale.items()))
    raise StaleHiddenStatesError(
        f"{reader}: stale hidden_states partition(s), not read: {listed}. Re-materialize hidden_states for "
        f"{'them' if len(stale) > 1 else 'it'} with the current responses, verifier and layer ids "
        "(`eagle3 backfill --missing` plans every stale partition), then run this again"
    )
