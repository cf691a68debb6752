"""The prompt table: ``raw_prompts``' files written from a :class:`prompts.DatasetScan`, in bounded memory.

``build_prompt_table`` (the ``raw_prompts`` asset's core) scans the dataset once and writes ``prompts.parquet``,
``dataset_turns.parquet`` and ``rejects.jsonl`` batch by batch, assigning each sample its stable position
(``partitions.assign_positions``' rule, one sample at a time). The three files stay temporary until the whole dataset
was read and accepted, so a refused dataset overwrites nothing. Reading and normalizing rows is ``prompts``' job.
"""

from __future__ import annotations

import array
import collections
import contextlib
import json
import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_assets.core import storage
from eagle3_assets.core.partition_keys import partition_of
from eagle3_assets.prompts import prompt_files
from eagle3_assets.prompts.conversations import DatasetScan, Duplicate, Prompt, Reject
from eagle3_assets.prompts.prompt_files import Cut

PROMPT_TABLE_COLUMNS = (
    "sample_id",
    "position",
    "partition_key",
    "messages",
    "source_line",
    "source_format",
    "num_turns",
    "prompt_chars",
)
# The table is written a row group at a time: memory holds one batch of prompts, whatever the dataset's size.
# Measured on 3 KB conversations: 2M-character batches peak ~60 MB above the imports, 16M ones ~160 MB, at the
# same speed; a row group of ~1,000 rows is about a partition, which a partition's reader can pick out alone.
BATCH_ROWS = 1024
BATCH_CHARS = 2 << 20  # of the rows' whole conversations: a batch of long conversations is cut earlier
# Re-sorting a table whose positions came out of order (a re-run over a reordered dataset): DuckDB sorts within
# this memory and spills the rest to a folder beside the table.
SORT_MEMORY = "512MB"
SORT_SCRATCH = ".sort"
# Distinct reject headings counted; past this, an adversarial file's headings are counted as one.
MAX_REASON_KINDS = 1000
OTHER_REASONS = "(other reasons)"
# Rejects kept as examples for the run log and the too-many-rejects error.
REJECT_EXAMPLES = 5
DUPLICATE_EXAMPLES = 3


class TooManyRejectsError(ValueError):
    """More rows rejected than the configured share allows; nothing was overwritten."""


@dataclass(frozen=True)
class PromptTableResult:
    rows: int
    rows_read: int
    rejects: int
    duplicates: int
    new_samples: int
    kept_samples: int
    dropped_samples: int
    partition_keys: list[str]
    partition_size: int
    prompt_chars: Sequence[int]  # every sample's, in dataset order (an array: 8 bytes a sample)
    reject_reasons: dict[str, int]
    table_path: Path
    rejects_path: Path
    dataset_file: Path = Path()
    reject_examples: tuple[Reject, ...] = ()
    duplicate_examples: tuple[Duplicate, ...] = ()
    cut: Cut | None = None

    def log_lines(self) -> list[str]:
        """What the run log says about this load: the cut taken, the rejects and the duplicates dropped."""
        lines = []
        if self.cut is not None:
            lines.append(
                f"EAGLE3_PROMPTS_TRUNCATED=keep-complete: took the {self.cut.complete_records:,} complete records of "
                f"{self.dataset_file}, which is not a complete JSON array: {self.cut.describe()}"
            )
        if self.rejects:
            reasons = "; ".join(f"{n:,} x {kind}" for kind, n in self.reject_reasons.items())
            examples = "; ".join(f"line {r.line}: {r.reason}" for r in self.reject_examples)
            lines.append(
                f"{self.rejects:,} of {self.rows_read:,} rows rejected ({reasons}), e.g. {examples}; "
                f"every reject with its line and reason: {self.rejects_path}"
            )
        if self.duplicates:
            examples = "; ".join(
                f"line {d.line} (id {d.sample_id!r}) repeats line {d.kept_line}"
                + (f" (id {d.kept_id!r})" if d.kept_id != d.sample_id else "")
                for d in self.duplicate_examples
            )
            lines.append(f"{self.duplicates:,} exact duplicates dropped (the first copy kept), e.g. {examples}")
        return lines


# Field names stay, numbers and indices are masked: "'conversations'[3].value is empty" and
# "'conversations'[0].value is empty" group as "conversations[*].value is empty".
_REASON_PARTS = re.compile(r"duplicate id '(?:[^'\\]|\\.)*'|'(\w+)'(?=\[)|'(?:[^'\\]|\\.)*'|\[\d+\]|\d[\d,]*")


def _mask(match: re.Match[str]) -> str:
    text = match.group(0)
    if text.startswith("duplicate id"):
        return "duplicate id '…'"
    if match.group(1):
        return match.group(1)
    if text.startswith("'"):
        return text
    return "[*]" if text.startswith("[") else "N"


def reason_kind(reason: str) -> str:
    """The heading a reject reason is counted under (readable: field names kept, varying numbers masked)."""
    return _REASON_PARTS.sub(_mask, reason)[:100]


def build_prompt_table(
    dataset_path: str | Path,
    layout: Any,
    partition_size: int,
    max_reject_share: float = 0.05,
    **scan_options: Any,
) -> PromptTableResult:
    """Stream the dataset into ``raw_prompts`` (table, rejects, manifest) under ``layout``, in bounded memory.

    Rows are read one at a time (:class:`DatasetScan`) and written in row groups of :data:`BATCH_ROWS` prompts,
    rejects as they come; what memory keeps per sample is its id, line, content digest, position and prompt
    length (see ``benchmarks/raw_prompts_memory.py``). Every file is written to a temporary path and renamed into
    place only once the whole dataset was read and accepted, so a refusal overwrites nothing.

    ``scan_options``: :class:`DatasetScan`'s, by name (``max_prompt_chars``, ``turns_kept``, ``limit``, and
    ``truncated``: what a cut-off or malformed JSON array does, ``error`` (raise ``DatasetCutError``, nothing
    written) or ``keep-complete`` (take the records before the cut; ``result.cut`` says where it was)).

    Positions are stable across re-runs (see ``partitions.assign_positions``). A changed partition size
    would move samples between partitions that may already be generated, so it is refused while
    downstream partitions exist.
    """
    dataset_file = prompt_files.resolve_dataset_path(dataset_path)
    scan = DatasetScan(dataset_file, **scan_options)
    positions = _Positions(_previous_positions(layout, partition_size))
    tally = _Tally()
    prompt_chars = array.array("q")
    keys: set[str] = set()
    turns_path = dataset_turns_path(layout)
    for target in (turns_path, layout.prompts_path, layout.rejects_path):
        storage.remove_dead_writers_temps(target.parent, {target.name, target.name + SORT_SCRATCH})
    with contextlib.ExitStack() as stack:
        # entered in reverse: on success the rejects are renamed into place first, then the table, then the turns
        turns_tmp = stack.enter_context(storage.atomic_path(turns_path))
        table_tmp = stack.enter_context(storage.atomic_path(layout.prompts_path))
        rejects_tmp = stack.enter_context(storage.atomic_path(layout.rejects_path))
        table = _ParquetBatches(table_tmp, _prompt_frame)
        turns = _ParquetBatches(turns_tmp, _dataset_turns_frame)
        with table, turns, open(rejects_tmp, "wb") as rejects_out:
            for outcome in scan:
                if isinstance(outcome, Reject):
                    tally.reject(outcome)
                    record = {"line": outcome.line, "reason": outcome.reason, "snippet": outcome.snippet}
                    rejects_out.write(json.dumps(record, ensure_ascii=False).encode() + b"\n")
                elif isinstance(outcome, Duplicate):
                    tally.duplicate(outcome)
                else:
                    position = positions.assign(outcome.sample_id)
                    key = partition_of(position, partition_size)
                    keys.add(key)
                    prompt_chars.append(outcome.prompt_chars)
                    row_chars = sum(len(content) for _, content in outcome.dataset_turns)
                    table.add((outcome, position, key), row_chars)
                    turns.add(outcome, row_chars)
        _refuse_bad_dataset(scan.rows_read, tally, dataset_path, max_reject_share)
        if not positions.in_order:
            _sort_by_position(table_tmp, _sort_folder(layout.prompts_path))
    manifest = {"dataset_path": str(dataset_path), "dataset_file": str(dataset_file), "partition_size": partition_size}
    manifest |= {"dataset_cut": scan.cut.as_dict() if scan.cut is not None else None, "rows": table.rows}
    storage.write_json_atomic({**manifest, "partition_keys": sorted(keys)}, layout.prompts_manifest_path)
    return PromptTableResult(
        rows=table.rows,
        rows_read=scan.rows_read,
        rejects=tally.rejects,
        duplicates=tally.duplicates,
        new_samples=positions.new,
        kept_samples=positions.kept,
        dropped_samples=len(positions.previous),
        partition_keys=sorted(keys),
        partition_size=partition_size,
        prompt_chars=prompt_chars,
        reject_reasons=dict(tally.reject_reasons.most_common(10)),
        table_path=layout.prompts_path,
        rejects_path=layout.rejects_path,
        dataset_file=dataset_file,
        reject_examples=tuple(tally.reject_examples[:3]),
        duplicate_examples=tuple(tally.duplicate_examples),
        cut=scan.cut,
    )


@dataclass
class _Tally:
    """Rejects and duplicates counted, with a few examples: bounded, however many there are."""

    rejects: int = 0
    duplicates: int = 0
    reject_reasons: collections.Counter[str] = field(default_factory=collections.Counter)
    reject_examples: list[Reject] = field(default_factory=list)
    duplicate_examples: list[Duplicate] = field(default_factory=list)

    def reject(self, reject: Reject) -> None:
        self.rejects += 1
        kind = reason_kind(reject.reason)
        if kind not in self.reject_reasons and len(self.reject_reasons) >= MAX_REASON_KINDS:
            kind = OTHER_REASONS
        self.reject_reasons[kind] += 1
        if len(self.reject_examples) < REJECT_EXAMPLES:
            self.reject_examples.append(reject)

    def duplicate(self, duplicate: Duplicate) -> None:
        self.duplicates += 1
        if len(self.duplicate_examples) < DUPLICATE_EXAMPLES:
            self.duplicate_examples.append(duplicate)


class _Positions:
    """Positions assigned one sample at a time, by the rule of ``partitions.assign_positions``: a known sample keeps
    its recorded position, a new one goes after the last. Each id is asked once (duplicates never get here), so a
    known one is popped from ``previous``: what is left at the end are the dropped samples."""

    def __init__(self, previous: dict[str, int]) -> None:
        self.previous = previous
        self.next_position = max(previous.values(), default=-1) + 1
        self.kept = self.new = 0
        self.last_position = -1
        self.in_order = True  # the table, written in dataset order, is sorted by position already

    def assign(self, sample_id: str) -> int:
        position = self.previous.pop(sample_id, None)
        if position is None:
            position, self.next_position = self.next_position, self.next_position + 1
            self.new += 1
        else:
            self.kept += 1
        self.in_order = self.in_order and position > self.last_position
        self.last_position = position
        return position


class _ParquetBatches:
    """A Parquet file written a row group at a time: rows are added one by one and ``to_frame`` turns each batch
    (:data:`BATCH_ROWS` rows or :data:`BATCH_CHARS` characters) into a polars frame. A context manager: closing
    writes the last batch (or, for no rows at all, the schema)."""

    def __init__(self, path: Path, to_frame: Callable[[list[Any]], Any]) -> None:
        self.path, self.to_frame = path, to_frame
        self.pending: list[Any] = []
        self.pending_chars = 0
        self.rows = 0
        self._writer: Any = None

    def add(self, row: Any, chars: int) -> None:
        self.pending.append(row)
        self.pending_chars += chars
        if len(self.pending) >= BATCH_ROWS or self.pending_chars >= BATCH_CHARS:
            self._flush()

    def _flush(self) -> None:
        # lazy: loads pyarrow (heavy), which only this path needs
        import pyarrow.parquet as pq

        batch = self.to_frame(self.pending).to_arrow()
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, batch.schema, compression="zstd")
        self._writer.write_table(batch)
        self.rows += len(self.pending)
        self.pending, self.pending_chars = [], 0

    def __enter__(self) -> _ParquetBatches:
        return self

    def __exit__(self, error_type: Any, *_: Any) -> None:
        try:
            if error_type is None and (self.pending or self._writer is None):
                self._flush()
        finally:
            if self._writer is not None:
                self._writer.close()


def _sort_folder(target: Path) -> Path:
    """Scratch space beside ``target`` for its out-of-core sort, named like ``storage``'s temporaries
    (``.NAME.tmp-PID``) so that ``storage.remove_dead_writers_temps`` sweeps a killed run's."""
    return target.with_name(f".{target.name}{SORT_SCRATCH}.tmp-{os.getpid()}")


def _sort_by_position(table: Path, scratch: Path) -> None:
    """Rewrite the Parquet file ``table`` ordered by position, in :data:`SORT_MEMORY` plus what DuckDB spills to
    ``scratch`` (never the working directory, DuckDB's default)."""

    # lazy: loads duckdb (heavy), which only this path needs
    import duckdb

    def quoted(path: Path) -> str:
        return "'" + str(path).replace("'", "''") + "'"

    scratch.mkdir(parents=True, exist_ok=True)
    try:
        unsorted = scratch / "unsorted.parquet"
        os.replace(table, unsorted)
        config = {"memory_limit": SORT_MEMORY, "temp_directory": str(scratch / "spill")}
        with duckdb.connect(config=config) as con:
            con.execute(
                f"COPY (SELECT * FROM read_parquet({quoted(unsorted)}) ORDER BY position) TO {quoted(table)} "
                f"(FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE {BATCH_ROWS})"
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _refuse_bad_dataset(rows_read: int, tally: _Tally, dataset_path: str | Path, max_reject_share: float) -> None:
    if rows_read == 0:
        raise ValueError(f"prompt dataset {dataset_path} has no rows")
    share = tally.rejects / rows_read
    if share > max_reject_share:
        first = "; ".join(f"line {r.line}: {r.reason}" for r in tally.reject_examples)
        raise TooManyRejectsError(
            f"{tally.rejects} of {rows_read} rows of {dataset_path} rejected "
            f"({share:.1%} > EAGLE3_MAX_REJECT_SHARE={max_reject_share}); first: {first}"
        )


def _previous_positions(layout: Any, partition_size: int) -> dict[str, int]:
    """sample_id -> position of the table already written (empty on the first run); refuses a re-keying size."""
    # lazy: loads pyarrow (heavy), which only this path needs
    import pyarrow.parquet as pq

    # lazy: loads pydantic (heavy), which only this path needs
    from eagle3_assets.core.settings import ConfigError

    if not layout.prompts_path.exists():
        return {}
    manifest = storage.read_json(layout.prompts_manifest_path) if layout.prompts_manifest_path.exists() else {}
    old_size = manifest.get("partition_size", partition_size)
    generated = layout.generated_partitions()  # finished files and half-generated journals alike
    if old_size != partition_size and generated:
        raise ConfigError(
            f"EAGLE3_PARTITION_SIZE={partition_size!r}: the data in {layout.root} was partitioned with "
            f"{old_size} and partition(s) {', '.join(generated[:5])} hold generated work (finished or "
            f"in progress); changing it would move generated samples between partitions. Use a new "
            f"EAGLE3_DATA_DIR or set EAGLE3_PARTITION_SIZE={old_size}."
        )
    positions: dict[str, int] = {}
    # batch by batch: the ids and positions alone, never the table's messages
    for batch in pq.ParquetFile(layout.prompts_path).iter_batches(columns=["sample_id", "position"]):
        positions.update(zip(batch["sample_id"].to_pylist(), batch["position"].to_pylist(), strict=True))
    return positions


def _messages_type() -> Any:
    # lazy: loads polars (heavy), which only this path needs
    import polars as pl

    return pl.List(pl.Struct({"role": pl.String, "content": pl.String}))


def _prompt_frame(batch: list[tuple[Prompt, int, str]]) -> Any:
    """One batch of the prompt table: (prompt, position, partition key) rows."""
    # lazy: loads polars (heavy), which only this path needs
    import polars as pl

    return pl.DataFrame(
        {
            "sample_id": [p.sample_id for p, _, _ in batch],
            "position": [position for _, position, _ in batch],
            "partition_key": [key for _, _, key in batch],
            "messages": [p.messages_as_dicts() for p, _, _ in batch],
            "source_line": [p.source_line for p, _, _ in batch],
            "source_format": [p.source_format for p, _, _ in batch],
            "num_turns": [len(p.messages) for p, _, _ in batch],
            "prompt_chars": [p.prompt_chars for p, _, _ in batch],
        },
        schema={
            "sample_id": pl.String,
            "position": pl.Int64,
            "partition_key": pl.String,
            "messages": _messages_type(),
            "source_line": pl.Int64,
            "source_format": pl.String,
            "num_turns": pl.Int32,
            "prompt_chars": pl.Int64,
        },
    )


def dataset_turns_path(layout: Any) -> Path:
    """Beside the prompt table: every sample's turns as the dataset has them, its assistant answers included."""
    return Path(layout.asset_dir("raw_prompts")) / "dataset_turns.parquet"


def _dataset_turns_frame(prompts: list[Prompt]) -> Any:
    # lazy: loads polars (heavy), which only this path needs
    import polars as pl

    return pl.DataFrame(
        {
            "sample_id": [p.sample_id for p in prompts],
            "messages": [[{"role": r, "content": c} for r, c in p.dataset_turns] for p in prompts],
        },
        schema={"sample_id": pl.String, "messages": _messages_type()},
    )
