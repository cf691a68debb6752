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
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3_assets.core import hashing, storage
from eagle3_assets.core.hashing import digest, file_digest, files_digest
from eagle3_assets.core.storage import DataLayout

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
    # lazy: loads duckdb (heavy), which only this path needs
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
            file_hash = cache[cache_key] = file_digest(path, 64)
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


def held_out_key(usable: Sequence[str], requested: str | None = None) -> str | None:
    """THE hold-out rule, for training's validation and the evaluation alike: ``requested``, else the last of the
    ``usable`` hidden_states partitions (:func:`partitions_passing_checks`); None when there is none."""
    return requested or (usable[-1] if usable else None)


def held_out_partition(layout: DataLayout, requested: str | None = None) -> str | None:
    """:func:`held_out_key` over the hidden_states partitions on disk whose checks passed: the partition the
    draft_model asset held out of training, unless the data changed since."""
    usable, _ = partitions_passing_checks(layout, sorted(layout.partition_files("hidden_states")))
    return held_out_key(usable, requested)


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
            [key, lineage.data_version if lineage else None, hashing.file_digest(index) if index.exists() else None]
        )
    vocab = None if vocab_digest == NO_VOCAB_MAPPING else vocab_digest
    if vocab_digest is None:
        vocab_dir = layout.vocab_mapping_dir
        vocab = files_digest(p for p in vocab_dir.glob("*") if p.is_file()) if vocab_dir.is_dir() else None
    verifier = verifier_fingerprint(verifier_path, cache_dir=layout.asset_dir("hidden_states"))
    return digest([parts, vocab, verifier])


def training_fingerprint(base: str, *inputs: Any, **named_inputs: Any) -> str:
    """A training run's checkpoint fingerprint: ``base`` (the config and the partition keys) plus the content
    hash of its inputs (``inputs``, ``named_inputs``: :func:`training_inputs_digest`'s arguments, passed on as they
    came: the fingerprint is that digest behind the base), so a checkpoint trained on other data or another
    verifier is never resumed."""
    return digest([base, training_inputs_digest(*inputs, **named_inputs)], 16)
