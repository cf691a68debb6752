"""What each partition was built from, and whether that is still what it would be built from now (Dagster-free).

Three questions the asset wrappers, ``eagle3 status``, ``eagle3 backfill --missing`` and training ask:

* :func:`prompt_drift`: does a ``synthetic_responses`` file still answer its partition's prompt set (a prompt
  appended to a half-full last partition, edited under its id, or dropped makes it stale)?
* :func:`verifier_fingerprint`: what verifier content produced a hidden state (a revision when the folder is a
  Hugging Face snapshot, else a content hash of its config and weight files, cached by name, size and mtime)?
* :class:`PartitionLineage`: the data version, inputs and check outcomes recorded beside a partition, so a
  downstream stage can tell a partition built from other inputs, or one whose checks failed, from a current one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Collection, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3_assets import storage
from eagle3_assets.hashing import digest
from eagle3_assets.storage import DataLayout

logger = logging.getLogger(__name__)

# Code versions declared on the assets: bump when a change makes earlier outputs wrong, so Dagster marks every
# partition built by the older code as stale (its data versions are content hashes and cannot tell).
RESPONSES_CODE_VERSION = "responses-2"  # 2: rows carry request fingerprints; resume keeps only current rows
HIDDEN_STATES_CODE_VERSION = "hidden-states-2"  # 2: re-extracted when the verifier, layers or responses change

# Files of a model folder that determine its outputs; tokenizer files change the rendered tokens.
_MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".json", ".model", ".txt", ".jinja", ".py")
_HASH_CACHE = "_verifier_hashes.json"
LINEAGE_FILE = "lineage.json"  # a hidden_states version's own record (publish.LINEAGE_FILE: the same name)
# passed as a training fingerprint's vocabulary part when the run found no vocab_mapping folder: recorded as None,
# the value every earlier version recorded then (their checkpoints still resume)
NO_VOCAB_MAPPING = "no vocab_mapping folder"


# ------------------------------------------------------------------------------------------- prompt drift


@dataclass(frozen=True)
class PromptDrift:
    """How a responses file differs from its partition's current prompt set."""

    missing: int  # prompts of the partition without a row (e.g. appended to a half-full partition)
    unexpected: int  # rows whose prompt left the partition
    edited: int  # rows whose stored messages differ from the prompt under the same id

    @property
    def changed(self) -> bool:
        return bool(self.missing or self.unexpected or self.edited)

    def describe(self) -> str:
        parts = [
            f"{n} {what}" for n, what in ((self.missing, "new"), (self.edited, "edited"), (self.unexpected, "dropped"))
        ]
        return "prompts changed: " + ", ".join(p for p in parts if not p.startswith("0 "))


def _quote(path: Path | str) -> str:
    return str(path).replace("'", "''")


def prompt_drift(layout: DataLayout, keys: Iterable[str] | None = None) -> dict[str, PromptDrift]:
    """Partitions whose ``synthetic_responses`` file no longer matches ``raw_prompts`` (changed ones only).

    One DuckDB pass per file over two small columns each; an unreadable file is skipped (``eagle3 status``
    reports it as unreadable on its own).
    """
    import duckdb

    files = layout.partition_files("synthetic_responses")
    if keys is not None:
        wanted = set(keys)
        files = {k: p for k, p in files.items() if k in wanted}
    if not files or not layout.prompts_path.exists():
        return {}
    drift: dict[str, PromptDrift] = {}
    prompts = _quote(layout.prompts_path)
    with duckdb.connect() as con:
        for key, path in files.items():
            # the table is sorted by position, so the partition_key filter reads only that partition's row groups
            sql = f"""
                WITH p AS (SELECT sample_id, messages FROM read_parquet('{prompts}') WHERE partition_key = ?),
                     r AS (SELECT sample_id, messages FROM read_parquet('{_quote(path)}'))
                SELECT count(*) FILTER (WHERE r.sample_id IS NULL),
                       count(*) FILTER (WHERE p.sample_id IS NULL),
                       count(*) FILTER (WHERE p.sample_id IS NOT NULL AND r.sample_id IS NOT NULL
                                        AND p.messages IS DISTINCT FROM r.messages)
                FROM p FULL OUTER JOIN r ON p.sample_id = r.sample_id
            """
            try:
                missing, unexpected, edited = con.execute(sql, [key]).fetchone()  # type: ignore[misc]
            except duckdb.Error:
                continue
            found = PromptDrift(int(missing), int(unexpected), int(edited))
            if found.changed:
                drift[key] = found
    return drift


# --------------------------------------------------------------------------------------- verifier content


def _snapshot_revision(path: Path) -> str | None:
    """The commit of a Hugging Face cache snapshot folder (``.../snapshots/<40 hex>``), else None."""
    parent = path.parent.name
    name = path.name
    if parent == "snapshots" and len(name) == 40 and all(c in "0123456789abcdef" for c in name):
        return name
    return None


def _sha256_file(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            sha.update(block)
    return sha.hexdigest()


def verifier_fingerprint(model_dir: Path, cache_dir: Path | None = None) -> str:
    """A content fingerprint of a local model folder: its Hugging Face revision when it is a cache snapshot,
    else a hash over the content hashes of its config, tokenizer and weight files.

    File hashes are cached in ``cache_dir/_verifier_hashes.json`` keyed by path, size and mtime, so a 100 GB
    verifier is read once, not on every partition. Editing or replacing a file changes its size or mtime.
    """
    model_dir = Path(model_dir).resolve()
    revision = _snapshot_revision(model_dir)
    if revision is not None:
        return f"revision:{revision}"
    cache_path = (cache_dir or model_dir) / _HASH_CACHE
    cache: dict[str, str] = {}
    if cache_dir is not None:
        with contextlib.suppress(OSError, ValueError):
            cache = json.loads(cache_path.read_text())
    entries: list[tuple[str, str]] = []
    dirty = False
    for path in sorted(model_dir.rglob("*")):
        if not path.is_file() or path.name.startswith(".") or not path.name.endswith(_MODEL_FILE_SUFFIXES):
            continue
        stat = path.stat()
        cache_key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
        file_hash = cache.get(cache_key)
        if file_hash is None:
            file_hash = cache[cache_key] = _sha256_file(path)
            dirty = True
        entries.append((str(path.relative_to(model_dir)), file_hash))
    if dirty and cache_dir is not None:
        with contextlib.suppress(OSError):
            storage.write_json_atomic(cache, cache_path)
    return "content:" + digest(entries)


# ------------------------------------------------------------------------------------- partition lineage


@dataclass
class PartitionLineage:
    """What one partition of an asset was built from and what its checks said."""

    asset: str
    partition_key: str
    data_version: str  # content hash of the partition's output
    inputs: dict[str, Any] = field(default_factory=dict)  # upstream data versions and the settings that matter
    checks: dict[str, bool] = field(default_factory=dict)  # check name -> passed

    @property
    def inputs_digest(self) -> str:
        return digest(self.inputs)

    @property
    def checks_passed(self) -> bool:
        return bool(self.checks) and all(self.checks.values())

    def save(self, layout: DataLayout, folder: Path | None = None) -> None:
        """Write the record beside the partition; ``folder``: the hidden_states version folder it describes (the
        one a reader pinned), else the version the pointer names now."""
        path = folder / LINEAGE_FILE if folder is not None else layout.lineage_path(self.asset, self.partition_key)
        if self.asset == "hidden_states" and not path.parent.is_dir():
            # written into the published version only: never a folder made up where the pointer is missing
            raise FileNotFoundError(
                f"hidden_states partition {self.partition_key} has no published folder {path.parent}"
            )
        storage.write_json_atomic(asdict(self), path)

    @classmethod
    def load(cls, layout: DataLayout, asset: str, partition_key: str) -> PartitionLineage | None:
        """The recorded lineage, or None when there is none (or it is unreadable: then nothing is trusted)."""
        return cls.load_file(layout.lineage_path(asset, partition_key))

    @classmethod
    def load_file(cls, path: Path) -> PartitionLineage | None:
        try:
            data = json.loads(path.read_text())
            return cls(**data)
        except (OSError, ValueError, TypeError):
            return None


def record_checks(
    layout: DataLayout,
    asset: str,
    partition_key: str,
    outcomes: Mapping[str, bool],
    folder: Path | None = None,
) -> None:
    """Store check outcomes in the partition's lineage (the checks run after the output is written).

    ``folder``: the hidden_states version folder the checks read (pinned): the outcomes go into that version's
    lineage, never into one a concurrent rebuild published meanwhile (which nobody checked)."""
    lineage = (
        PartitionLineage.load_file(folder / LINEAGE_FILE)
        if folder is not None
        else PartitionLineage.load(layout, asset, partition_key)
    )
    if lineage is None:
        lineage = PartitionLineage(asset, partition_key, data_version="")
    lineage.checks = {**lineage.checks, **{k: bool(v) for k, v in outcomes.items()}}
    lineage.save(layout, folder)


def partitions_passing_checks(
    layout: DataLayout, keys: Iterable[str], dirs: Mapping[str, Path] | None = None
) -> tuple[list[str], dict[str, str]]:
    """(usable keys, excluded key -> why): a hidden_states partition is usable for training when its own checks
    passed, the responses it was built from passed theirs, and it was built from the responses now on disk.
    ``dirs``: the version folder each key's reader pinned (else the pointer's version now)."""
    usable: list[str] = []
    excluded: dict[str, str] = {}
    for key in keys:
        pinned = (dirs or {}).get(key)
        hidden = (
            PartitionLineage.load_file(pinned / LINEAGE_FILE)
            if pinned is not None
            else PartitionLineage.load(layout, "hidden_states", key)
        )
        responses = PartitionLineage.load(layout, "synthetic_responses", key)
        if hidden is None or not hidden.checks_passed:
            failed = sorted(k for k, v in (hidden.checks if hidden else {}).items() if not v)
            excluded[key] = f"hidden_states checks failed: {failed}" if failed else "hidden_states checks not recorded"
        elif responses is None or not responses.checks_passed:
            excluded[key] = "synthetic_responses checks failed or not recorded"
        elif hidden.inputs.get("responses_data_version") != responses.data_version:
            excluded[key] = "built from other responses than those on disk (re-materialize hidden_states)"
        else:
            usable.append(key)
    return usable, excluded


def files_digest(paths: Iterable[Path]) -> str:
    """A content hash over several files (name and bytes), e.g. the vocabulary mapping a draft is trained with."""
    return digest(
        [(Path(p).name, storage.file_digest(Path(p), 64)) for p in sorted(paths, key=str) if os.path.exists(p)]
    )


# --------------------------------------------------------------------------- hidden states: build aside, publish


def hidden_states_staging_dir(layout: DataLayout, partition_key: str) -> Path:
    from eagle3_assets import publish

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
    import shutil

    from eagle3_assets.publish import VERSION_OWN_FILES

    for path in source.rglob("*"):
        if not path.is_file() or (path.parent == source and path.name in VERSION_OWN_FILES):
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
    import shutil

    from eagle3_assets import publish

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
    from eagle3_assets.publish import INDEX_FILE, LINEAGE_FILE

    inputs = {"responses_data_version": responses_digest, "extraction": dict(extraction)}
    index_digest = storage.file_digest(staging / INDEX_FILE)
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
    from eagle3_assets import publish

    return publish.publish(layout, partition_key, staging, _STAGING_INPUTS, files_synced_in)


def training_inputs_digest(
    layout: DataLayout,
    keys: Iterable[str],
    verifier_path: Path,
    dirs: Mapping[str, Path] | None = None,
    vocab_digest: str | None = None,
) -> str:
    """A content hash of what a draft trains on: each partition's recorded hidden-states data version and
    index content, the vocabulary mapping and the verifier content (not paths and counts). ``dirs``: the
    pinned version folder of each key (else the current one). ``vocab_digest``: the vocabulary part computed
    from the mapping bytes the run loaded (``training.vocab.fingerprint_part``; :data:`NO_VOCAB_MAPPING`: no
    folder): a mapping rebuilt after the load must not be what the checkpoint claims it was trained with. None (a
    caller that loads nothing): the files in the mapping folder now. Both give the same value for the same files,
    the value of every earlier version, so an upgrade never makes a checkpoint look made for other data."""
    parts: list[Any] = []
    for key in sorted(keys):
        folder = (dirs or {}).get(key) or layout.hidden_states_dir(key)
        lineage = PartitionLineage.load_file(folder / LINEAGE_FILE)
        index = folder / "index.parquet"
        parts.append(
            [key, lineage.data_version if lineage else None, storage.file_digest(index) if index.exists() else None]
        )
    vocab = None if vocab_digest == NO_VOCAB_MAPPING else vocab_digest
    if vocab_digest is None:
        vocab_dir = layout.vocab_mapping_dir
        vocab = files_digest(p for p in vocab_dir.glob("*") if p.is_file()) if vocab_dir.is_dir() else None
    verifier = verifier_fingerprint(verifier_path, cache_dir=layout.asset_dir("hidden_states"))
    return digest([parts, vocab, verifier])


def training_fingerprint(
    base: str,
    layout: DataLayout,
    keys: Iterable[str],
    verifier_path: Path,
    dirs: Mapping[str, Path] | None = None,
    vocab_digest: str | None = None,
) -> str:
    """A training run's checkpoint fingerprint: ``base`` (the config and the partition keys) plus the content
    hash of its inputs, so a checkpoint trained on other data or another verifier is never resumed."""
    return digest([base, training_inputs_digest(layout, keys, verifier_path, dirs, vocab_digest)], 16)


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
    from eagle3_assets import publish

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
        elif hidden.inputs.get("responses_data_version") != storage.file_digest(responses):
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
