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
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
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


def content_hash_id(messages: tuple[tuple[str, str], ...]) -> str:
    canonical = json.dumps(messages, ensure_ascii=False, separators=(",", ":"))
    return "h" + hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:24]


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
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    return text[:REJECT_SNIPPET_CHARS].replace("\x00", "\\0")


def _rows(path: Path, truncated: str) -> tuple[Iterable[Row], JsonArrayRows | None]:
    kind = prompt_files.dataset_format(path)
    if kind == "parquet":
        return prompt_files.parquet_rows(path), None
    if kind == "jsonl":
        return prompt_files.jsonl_rows(path), None
    if truncated not in prompt_files.TRUNCATED_POLICIES:
        raise ValueError(f"EAGLE3_PROMPTS_TRUNCATED={truncated!r}: must be one of {prompt_files.TRUNCATED_POLICIES}")
    array = JsonArrayRows(path, keep_complete=truncated == "keep-complete")
    return array, array


def load_prompts(
    path: str | Path,
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
    truncated: str = "error",
    turns_kept: str = "all",
    limit: int = 0,
) -> LoadedPrompts:
    """Read a JSONL, JSON-array or Parquet prompt dataset (or ``package:NAME``); keep the first of exact
    duplicates, reject bad rows. ``truncated``: ``error`` or ``keep-complete`` for a cut-off JSON array;
    ``turns_kept``: ``all`` or ``first`` (:func:`first_turn`); ``limit``: read only the first rows (0: all)."""
    path = prompt_files.resolve_dataset_path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt dataset {path} does not exist (EAGLE3_PROMPTS_PATH)")
    rows, array = _rows(path, truncated)

    result = LoadedPrompts()
    seen_messages: dict[tuple, tuple[int, str]] = {}  # messages -> (line, sample id) of the copy kept
    id_to_messages: dict[str, tuple[tuple, int]] = {}
    for number, row, raw, decode_error in rows:
        if limit and result.rows_read >= limit:
            break
        result.rows_read += 1
        snippet = _snippet(raw) if raw is not None else _snippet(repr(row))
        if decode_error is not None:
            result.rejects.append(Reject(number, decode_error, snippet))
            continue
        try:
            dataset_id, source_format, messages = normalize_row(row, max_prompt_chars, turns_kept)
        except RowError as error:
            result.rejects.append(Reject(number, str(error), snippet))
            continue
        except RecursionError:
            result.rejects.append(Reject(number, "row nested too deeply", snippet))
            continue
        sample_id = dataset_id if dataset_id is not None else content_hash_id(messages)
        if sample_id in id_to_messages:
            kept_messages, kept_line = id_to_messages[sample_id]
            if kept_messages == messages:
                result.duplicate_rows.append(Duplicate(number, kept_line, sample_id, sample_id))
            else:
                result.rejects.append(Reject(number, f"duplicate id {sample_id!r} with different content", snippet))
            continue
        if messages in seen_messages:
            result.duplicate_rows.append(Duplicate(number, *seen_messages[messages], sample_id=sample_id))
            continue
        seen_messages[messages] = (number, sample_id)
        id_to_messages[sample_id] = (messages, number)
        result.prompts.append(Prompt(sample_id, messages, number, source_format, tuple(_turns(row)[1])))
    result.cut = array.cut if array is not None else None
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
    prompt_chars: list[int]
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
    """Load the dataset and write ``raw_prompts`` (table, rejects, manifest) under ``layout``.

    ``truncated``: what a cut-off or malformed JSON array does, ``error`` (raise ``DatasetCutError``, nothing
    written) or ``keep-complete`` (take the records before the cut; ``result.cut`` says where it was).

    Positions are stable across re-runs (see ``partitions.assign_positions``). A changed partition size
    would move samples between partitions that may already be generated, so it is refused while
    downstream partitions exist.
    """
    import collections

    from eagle3_assets import storage
    from eagle3_assets.partitions import assign_positions

    dataset_file = prompt_files.resolve_dataset_path(dataset_path)
    loaded = load_prompts(dataset_file, max_prompt_chars, truncated, turns_kept, limit)
    _refuse_bad_dataset(loaded, dataset_path, max_reject_share)
    previous = _previous_positions(layout, partition_size)
    ids = [p.sample_id for p in loaded.prompts]
    positions, kept, new = assign_positions(ids, previous)
    table = _prompt_frame(loaded.prompts, positions, partition_size)

    rejects_jsonl = "".join(
        json.dumps({"line": r.line, "reason": r.reason, "snippet": r.snippet}, ensure_ascii=False) + "\n"
        for r in loaded.rejects
    ).encode()
    storage.write_bytes_atomic(rejects_jsonl, layout.rejects_path)
    storage.write_parquet_atomic(table, layout.prompts_path)
    storage.write_parquet_atomic(_dataset_turns_frame(loaded.prompts), dataset_turns_path(layout))
    keys = sorted(set(table["partition_key"].to_list()))
    storage.write_json_atomic(
        {
            "dataset_path": str(dataset_path),
            "dataset_file": str(dataset_file),
            "dataset_cut": loaded.cut.as_dict() if loaded.cut is not None else None,
            "partition_size": partition_size,
            "rows": table.height,
            "partition_keys": keys,
        },
        layout.prompts_manifest_path,
    )
    return PromptTableResult(
        rows=table.height,
        rows_read=loaded.rows_read,
        rejects=len(loaded.rejects),
        duplicates=loaded.duplicates,
        new_samples=new,
        kept_samples=kept,
        dropped_samples=len(set(previous) - set(ids)),
        partition_keys=keys,
        partition_size=partition_size,
        prompt_chars=table["prompt_chars"].to_list(),
        reject_reasons=dict(collections.Counter(reason_kind(r.reason) for r in loaded.rejects).most_common(10)),
        table_path=layout.prompts_path,
        rejects_path=layout.rejects_path,
        dataset_file=dataset_file,
        reject_examples=tuple(loaded.rejects[:3]),
        duplicate_examples=tuple(loaded.duplicate_rows[:3]),
        cut=loaded.cut,
    )


def _refuse_bad_dataset(loaded: LoadedPrompts, dataset_path: str | Path, max_reject_share: float) -> None:
    if loaded.rows_read == 0:
        raise ValueError(f"prompt dataset {dataset_path} has no rows")
    if loaded.reject_share > max_reject_share:
        first = "; ".join(f"line {r.line}: {r.reason}" for r in loaded.rejects[:5])
        raise TooManyRejectsError(
            f"{len(loaded.rejects)} of {loaded.rows_read} rows of {dataset_path} rejected "
            f"({loaded.reject_share:.1%} > EAGLE3_MAX_REJECT_SHARE={max_reject_share}); first: {first}"
        )


def _previous_positions(layout: Any, partition_size: int) -> dict[str, int]:
    """sample_id -> position of the table already written (empty on the first run); refuses a re-keying size."""
    import polars as pl

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
    old = pl.read_parquet(layout.prompts_path, columns=["sample_id", "position"])
    return dict(zip(old["sample_id"].to_list(), old["position"].to_list(), strict=True))


def _prompt_frame(prompts: list[Any], positions: list[int], partition_size: int) -> Any:
    import polars as pl

    from eagle3_assets.partitions import partition_of

    return pl.DataFrame(
        {
            "sample_id": [p.sample_id for p in prompts],
            "position": positions,
            "partition_key": [partition_of(pos, partition_size) for pos in positions],
            "messages": [p.messages_as_dicts() for p in prompts],
            "source_line": [p.source_line for p in prompts],
            "source_format": [p.source_format for p in prompts],
            "num_turns": [len(p.messages) for p in prompts],
            "prompt_chars": [p.prompt_chars for p in prompts],
        },
        schema_overrides={
            "position": pl.Int64,
            "source_line": pl.Int64,
            "num_turns": pl.Int32,
            "prompt_chars": pl.Int64,
            "messages": pl.List(pl.Struct({"role": pl.String, "content": pl.String})),
        },
    ).sort("position")


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
        schema_overrides={"messages": pl.List(pl.Struct({"role": pl.String, "content": pl.String}))},
    )
