"""Prompt datasets -> normalized conversations with stable sample ids; bad rows rejected with reasons.

Three row shapes are read, from JSONL, a JSON array or Parquet (``prompt_files`` reads the files, and resolves
``package:NAME`` to a dataset a Python package ships):

* OpenAI:   ``{"id"?, "messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``
* ShareGPT: ``{"id"?, "conversations": [{"from": "human"|"gpt"|"system"|..., "value": str}, ...]}``
* Plain:    ``{"id"?, "prompt": str}``

Trailing assistant turns are dropped (the target model regenerates the final answer); earlier turns are
kept as history. A row never crashes the loader: it is accepted, rejected with its line number (a JSON array:
its record number) and a reason, or dropped as an exact duplicate of an earlier row (counted and reported). A
JSON array that is cut off or malformed stops the load (``prompt_files.DatasetCutError``) unless its complete
records are taken on purpose (``truncated="keep-complete"``).

Any size streams (:class:`DatasetScan`, :func:`build_prompt_table`): memory holds one row (a row longer than
``prompt_files.max_row_bytes`` is rejected unread), one batch of the table being written, and per sample its id,
line, content digest and prompt length (~260 bytes; a re-run adds the previous table's ids and positions, ~170).
"""

from __future__ import annotations

import array
import collections
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_assets import prompt_files
from eagle3_assets.prompt_files import Cut, JsonArrayRows, Row

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
}
MAX_ID_CHARS = 256
# A prompt this long cannot fit any realistic context; rejecting it here is cheaper than a 400 later.
DEFAULT_MAX_PROMPT_CHARS = 1_000_000
REJECT_SNIPPET_CHARS = 200
CONTENT_DIGEST_BYTES = 16


class RowError(ValueError):
    """A dataset row that cannot become a prompt; the message is the reason stored with the reject."""


@dataclass(frozen=True)
class Prompt:
    sample_id: str
    messages: tuple[tuple[str, str], ...]  # (role, content); hashable, so duplicates are cheap to find
    source_line: int
    source_format: str
    # the row's turns as the dataset has them, assistant answers included (the regeneration ablation's variant
    # trained on the dataset's own answers); written beside the table by build_prompt_table, never sent
    dataset_turns: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)

    @property
    def prompt_chars(self) -> int:
        return sum(len(content) for _, content in self.messages)

    def messages_as_dicts(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


@dataclass(frozen=True)
class Reject:
    line: int
    reason: str
    snippet: str


@dataclass(frozen=True)
class Duplicate:
    line: int  # the dropped copy's line (JSON array: record number)
    kept_line: int  # the copy kept
    kept_id: str
    sample_id: str


@dataclass
class LoadedPrompts:
    prompts: list[Prompt] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    duplicate_rows: list[Duplicate] = field(default_factory=list)
    rows_read: int = 0
    cut: Cut | None = None  # a cut-off JSON array whose complete records were taken (truncated="keep-complete")

    @property
    def duplicates(self) -> int:
        return len(self.duplicate_rows)

    @property
    def reject_share(self) -> float:
        return len(self.rejects) / self.rows_read if self.rows_read else 0.0


def content_digest(messages: tuple[tuple[str, str], ...]) -> bytes:
    """16 bytes of the sha256 of the messages' canonical JSON: equal digests mean equal prompts (a collision needs
    about 2**64 prompts), so duplicates are found from the digests alone, never by keeping the prompts."""
    canonical = json.dumps(messages, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).digest()[:CONTENT_DIGEST_BYTES]


def content_hash_id(messages: tuple[tuple[str, str], ...], digest: bytes | None = None) -> str:
    """The sample id of a row without one (``digest``: its :func:`content_digest`, when already computed)."""
    return "h" + (digest if digest is not None else content_digest(messages)).hex()[:24]


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise RowError(f"{where} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise RowError(f"{where} is empty")
    if "\x00" in value:
        raise RowError(f"{where} contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RowError(f"{where} contains invalid Unicode (lone surrogate)") from None
    return value


def _turns(row: dict[str, Any]) -> tuple[str, list[tuple[str, str]]]:
    shapes = [key for key in ("messages", "conversations", "prompt") if key in row and row[key] is not None]
    if not shapes:
        raise RowError("no 'messages', 'conversations' or 'prompt' field")
    if len(shapes) > 1:
        raise RowError(f"ambiguous row: has both {shapes[0]!r} and {shapes[1]!r}")
    shape = shapes[0]
    if shape == "prompt":
        return "prompt", [("user", _text(row["prompt"], "'prompt'"))]
    turns = row[shape]
    if not isinstance(turns, list):
        raise RowError(f"'{shape}' must be a list, got {type(turns).__name__}")
    if not turns:
        raise RowError(f"'{shape}' is empty")
    role_key, text_key = ("role", "content") if shape == "messages" else ("from", "value")
    out: list[tuple[str, str]] = []
    for i, turn in enumerate(turns):
        where = f"'{shape}'[{i}]"
        if not isinstance(turn, dict):
            raise RowError(f"{where} must be an object, got {type(turn).__name__}")
        role = turn.get(role_key)
        if not isinstance(role, str):
            raise RowError(f"{where}.{role_key} must be a string, got {type(role).__name__}")
        if shape == "messages":
            if role not in ROLES:
                raise RowError(f"{where} has unknown role {role[:40]!r} (expected one of {', '.join(ROLES)})")
        else:
            if role.lower() not in SHAREGPT_ROLES:
                raise RowError(f"{where} has unknown role {role[:40]!r}")
            role = SHAREGPT_ROLES[role.lower()]
        out.append((role, _text(turn.get(text_key), f"{where}.{text_key}")))
    return ("openai" if shape == "messages" else "sharegpt"), out


def first_turn(turns: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``EAGLE3_PROMPTS_TURNS=first``: a leading system turn, if any, and the first user turn; what came before the
    first user turn (a split conversation's assistant turn) and everything after it are dropped."""
    system = turns[:1] if turns and turns[0][0] == "system" else []
    user = next((turn for turn in turns if turn[0] == "user"), None)
    return [*system, user] if user is not None else turns


def normalize_row(
    row: Any, max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS, turns_kept: str = "all"
) -> tuple[str | None, str, tuple]:
    """(dataset id or None, format, messages) for one decoded row; raises RowError with the reason.

    ``turns_kept``: ``all`` (the conversation as history, trailing assistant turns dropped) or ``first``."""
    if not isinstance(row, dict):
        raise RowError(f"row must be a JSON object, got {type(row).__name__}")
    source_format, turns = _turns(row)
    if turns_kept == "first":
        turns = first_turn(turns)
    while turns and turns[-1][0] == "assistant":
        turns.pop()
    if not turns:
        raise RowError("no turns left after dropping the trailing assistant turn(s)")
    if not any(role == "user" for role, _ in turns):
        raise RowError("no user turn")
    if turns[-1][0] != "user":
        raise RowError(f"last turn must be from the user, got {turns[-1][0]!r}")
    if any(role == "system" for role, _ in turns[1:]):
        raise RowError("a system turn is only allowed first")
    chars = sum(len(text) for _, text in turns)
    if chars > max_prompt_chars:
        raise RowError(f"prompt has {chars:,} characters, above the limit of {max_prompt_chars:,}")

    dataset_id = row.get("id")
    if dataset_id is not None:
        if isinstance(dataset_id, bool) or not isinstance(dataset_id, (str, int)):
            raise RowError(f"'id' must be a string or an integer, got {type(dataset_id).__name__}")
        dataset_id = str(dataset_id).strip()
        if not dataset_id:
            raise RowError("'id' is empty")
        if len(dataset_id) > MAX_ID_CHARS or not dataset_id.isprintable():
            raise RowError(f"'id' must be printable and at most {MAX_ID_CHARS} characters")
    return dataset_id, source_format, tuple(turns)


def _snippet(raw: bytes | str) -> str:
    text = raw[: prompt_files.SNIPPET_BYTES].decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    return text[:REJECT_SNIPPET_CHARS].replace("\x00", "\\0")


def _rows(path: Path, truncated: str, max_row_bytes: int) -> tuple[Iterable[Row], JsonArrayRows | None]:
    kind = prompt_files.dataset_format(path)
    if kind == "parquet":
        return prompt_files.parquet_rows(path), None
    if kind == "jsonl":
        return prompt_files.jsonl_rows(path, max_row_bytes), None
    if truncated not in prompt_files.TRUNCATED_POLICIES:
        raise ValueError(f"EAGLE3_PROMPTS_TRUNCATED={truncated!r}: must be one of {prompt_files.TRUNCATED_POLICIES}")
    array = JsonArrayRows(path, keep_complete=truncated == "keep-complete", max_row_bytes=max_row_bytes)
    return array, array


class DatasetScan:
    """The rows of a prompt dataset (or ``package:NAME``), one at a time, each as its outcome: a :class:`Prompt`
    kept, a :class:`Reject` with its line and reason, or a :class:`Duplicate` dropped (the first copy is kept).

    Memory holds one row (``prompt_files`` bounds it by EAGLE3_MAX_PROMPT_CHARS), never the dataset: exact
    duplicates are found from each kept sample's id, line and :func:`content_digest`, never its text.
    ``truncated``: ``error`` or ``keep-complete`` for a cut-off JSON array (``cut`` says where, once read);
    ``turns_kept``: ``all`` or ``first`` (:func:`first_turn`); ``limit``: read only the first rows (0: all).
    """

    def __init__(
        self,
        path: str | Path,
        max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
        truncated: str = "error",
        turns_kept: str = "all",
        limit: int = 0,
    ) -> None:
        self.path = prompt_files.resolve_dataset_path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"prompt dataset {self.path} does not exist (EAGLE3_PROMPTS_PATH)")
        self.max_prompt_chars, self.turns_kept, self.limit = max_prompt_chars, turns_kept, limit
        self._rows, self._array = _rows(self.path, truncated, prompt_files.max_row_bytes(max_prompt_chars))
        self.rows_read = 0
        self.cut: Cut | None = None  # a cut-off JSON array whose complete records were taken

    def __iter__(self) -> Iterator[Prompt | Reject | Duplicate]:
        # the per-row memory of a scan: one entry in each dict (see the raw_prompts memory benchmark)
        kept_line_by_id: dict[str, int] = {}
        kept_id_by_content: dict[bytes, str] = {}
        for number, row, raw, decode_error in self._rows:
            if self.limit and self.rows_read >= self.limit:
                break
            self.rows_read += 1
            if decode_error is not None:
                yield Reject(number, decode_error, _snippet(raw if raw is not None else repr(row)))
                continue
            try:
                dataset_id, source_format, messages = normalize_row(row, self.max_prompt_chars, self.turns_kept)
            except RowError as error:
                yield Reject(number, str(error), _snippet(raw if raw is not None else repr(row)))
                continue
            except RecursionError:
                yield Reject(number, "row nested too deeply", _snippet(raw if raw is not None else repr(row)))
                continue
            content = content_digest(messages)
            sample_id = dataset_id if dataset_id is not None else content_hash_id(messages, content)
            kept_line = kept_line_by_id.get(sample_id)
            if kept_line is not None:
                # ids are unique among kept samples, so the content is the kept copy's exactly when its id maps back
                if kept_id_by_content.get(content) == sample_id:
                    yield Duplicate(number, kept_line, sample_id, sample_id)
                else:
                    reason = f"duplicate id {sample_id!r} with different content"
                    yield Reject(number, reason, _snippet(raw if raw is not None else repr(row)))
                continue
            kept_id = kept_id_by_content.get(content)
            if kept_id is not None:
                yield Duplicate(number, kept_line_by_id[kept_id], kept_id, sample_id)
                continue
            kept_line_by_id[sample_id] = number
            kept_id_by_content[content] = sample_id
            yield Prompt(sample_id, messages, number, source_format, tuple(_turns(row)[1]))
        self.cut = self._array.cut if self._array is not None else None


def load_prompts(
    path: str | Path,
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
    truncated: str = "error",
    turns_kept: str = "all",
    limit: int = 0,
) -> LoadedPrompts:
    """Every outcome of :class:`DatasetScan` in lists (memory grows with the dataset: for the raw_prompts asset,
    :func:`build_prompt_table` streams instead)."""
    scan = DatasetScan(path, max_prompt_chars, truncated, turns_kept, limit)
    result = LoadedPrompts()
    for outcome in scan:
        if isinstance(outcome, Prompt):
            result.prompts.append(outcome)
        elif isinstance(outcome, Reject):
            result.rejects.append(outcome)
        else:
            result.duplicate_rows.append(outcome)
    result.rows_read, result.cut = scan.rows_read, scan.cut
    return result


# ------------------------------------------------------------------------------------ the prompt table

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
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
    truncated: str = "error",
    turns_kept: str = "all",
    limit: int = 0,
) -> PromptTableResult:
    """Stream the dataset into ``raw_prompts`` (table, rejects, manifest) under ``layout``, in bounded memory.

    Rows are read one at a time (:class:`DatasetScan`) and written in row groups of :data:`BATCH_ROWS` prompts,
    rejects as they come; what memory keeps per sample is its id, line, content digest, position and prompt
    length (see ``benchmarks/raw_prompts_memory.py``). Every file is written to a temporary path and renamed into
    place only once the whole dataset was read and accepted, so a refusal overwrites nothing.

    ``truncated``: what a cut-off or malformed JSON array does, ``error`` (raise ``DatasetCutError``, nothing
    written) or ``keep-complete`` (take the records before the cut; ``result.cut`` says where it was).

    Positions are stable across re-runs (see ``partitions.assign_positions``). A changed partition size
    would move samples between partitions that may already be generated, so it is refused while
    downstream partitions exist.
    """
    import contextlib

    from eagle3_assets import storage
    from eagle3_assets.partitions import partition_of

    dataset_file = prompt_files.resolve_dataset_path(dataset_path)
    scan = DatasetScan(dataset_file, max_prompt_chars, truncated, turns_kept, limit)
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
    storage.write_json_atomic(
        {
            "dataset_path": str(dataset_path),
            "dataset_file": str(dataset_file),
            "dataset_cut": scan.cut.as_dict() if scan.cut is not None else None,
            "partition_size": partition_size,
            "rows": table.rows,
            "partition_keys": sorted(keys),
        },
        layout.prompts_manifest_path,
    )
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
    import shutil

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
    import pyarrow.parquet as pq

    from eagle3_assets import storage
    from eagle3_assets.settings import ConfigError

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
    import polars as pl

    return pl.List(pl.Struct({"role": pl.String, "content": pl.String}))


def _prompt_frame(batch: list[tuple[Prompt, int, str]]) -> Any:
    """One batch of the prompt table: (prompt, position, partition key) rows."""
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
    import polars as pl

    return pl.DataFrame(
        {
            "sample_id": [p.sample_id for p in prompts],
            "messages": [[{"role": r, "content": c} for r, c in p.dataset_turns] for p in prompts],
        },
        schema={"sample_id": pl.String, "messages": _messages_type()},
    )
