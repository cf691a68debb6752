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

Any size streams (:class:`DatasetScan`; ``prompt_table.build_prompt_table`` writes the table from it): memory holds
one row (a row longer than ``prompt_files.max_row_bytes`` is rejected unread), one batch of the table being written,
and per sample its id, line, content digest and prompt length (~260 bytes; a re-run adds the previous table's ids
and positions, ~170).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_assets.prompts import prompt_files
from eagle3_assets.prompts.prompt_files import Cut, JsonArrayRows, Row

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


def load_prompts(path: str | Path, **options: Any) -> LoadedPrompts:
    """Every outcome of ``DatasetScan(path, **options)`` in lists (memory grows with the dataset: for the raw_prompts
    asset, ``prompt_table.build_prompt_table`` streams instead). ``options``: :class:`DatasetScan`'s, by name."""
    scan = DatasetScan(path, **options)
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
