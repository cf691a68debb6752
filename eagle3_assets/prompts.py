"""Prompt datasets -> normalized conversations with stable sample ids; bad rows rejected with reasons.

Three row shapes are read, from JSONL or Parquet:

* OpenAI:   ``{"id"?, "messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``
* ShareGPT: ``{"id"?, "conversations": [{"from": "human"|"gpt"|"system"|..., "value": str}, ...]}``
* Plain:    ``{"id"?, "prompt": str}``

Trailing assistant turns are dropped (the target model regenerates the final answer); earlier turns are
kept as history. A row never crashes the loader: it is accepted or rejected with its line number and a
reason.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


@dataclass
class LoadedPrompts:
    prompts: list[Prompt] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    duplicates: int = 0
    rows_read: int = 0

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


def normalize_row(row: Any, max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS) -> tuple[str | None, str, tuple]:
    """(dataset id or None, format, messages) for one decoded row; raises RowError with the reason."""
    if not isinstance(row, dict):
        raise RowError(f"row must be a JSON object, got {type(row).__name__}")
    source_format, turns = _turns(row)
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


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any, bytes | None, str | None]]:
    """(line number, decoded row, raw line, decode error) for each non-blank line."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # a UTF-8 byte-order mark (Windows editors write one) is not part of the first row
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield number, None, raw, f"invalid UTF-8 at byte {error.start}"
                continue
            try:
                yield number, json.loads(text), raw, None
            except RecursionError:
                yield number, None, raw, "invalid JSON: nested too deeply"
            except ValueError as error:
                yield number, None, raw, f"invalid JSON: {error}"


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any, bytes | None, str | None]]:
    import polars as pl

    frame = pl.read_parquet(path)
    for number, row in enumerate(frame.iter_rows(named=True), start=1):
        yield number, row, None, None


def load_prompts(path: str | Path, max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS) -> LoadedPrompts:
    """Read a JSONL or Parquet prompt dataset; keep the first of exact duplicates, reject bad rows."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt dataset {path} does not exist (EAGLE3_PROMPTS_PATH)")
    suffix = path.suffix.lower()
    if suffix in {".jsonl", ".json", ".ndjson"}:
        rows = _jsonl_rows(path)
    elif suffix == ".parquet":
        rows = _parquet_rows(path)
    else:
        raise ValueError(f"prompt dataset {path}: unknown format {suffix!r} (use .jsonl or .parquet)")

    result = LoadedPrompts()
    seen_messages: set[tuple] = set()
    id_to_messages: dict[str, tuple] = {}
    for number, row, raw, decode_error in rows:
        result.rows_read += 1
        snippet = _snippet(raw) if raw is not None else _snippet(repr(row))
        if decode_error is not None:
            result.rejects.append(Reject(number, decode_error, snippet))
            continue
        try:
            dataset_id, source_format, messages = normalize_row(row, max_prompt_chars)
        except RowError as error:
            result.rejects.append(Reject(number, str(error), snippet))
            continue
        except RecursionError:
            result.rejects.append(Reject(number, "row nested too deeply", snippet))
            continue
        sample_id = dataset_id if dataset_id is not None else content_hash_id(messages)
        if sample_id in id_to_messages:
            if id_to_messages[sample_id] == messages:
                result.duplicates += 1
            else:
                result.rejects.append(Reject(number, f"duplicate id {sample_id!r} with different content", snippet))
            continue
        if messages in seen_messages:
            result.duplicates += 1
            continue
        seen_messages.add(messages)
        id_to_messages[sample_id] = messages
        result.prompts.append(Prompt(sample_id, messages, number, source_format))
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


def _reason_kind(reason: str) -> str:
    # Group "'messages'[3] has unknown role 'tool'" and "'messages'[0] ..." under one heading.
    import re

    return re.sub(r"\[\d+\]|'[^']*'|\d[\d,]*", "_", reason)[:80]


def build_prompt_table(
    dataset_path: str | Path,
    layout: Any,
    partition_size: int,
    max_reject_share: float = 0.05,
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
) -> PromptTableResult:
    """Load the dataset and write ``raw_prompts`` (table, rejects, manifest) under ``layout``.

    Positions are stable across re-runs (see ``partitions.assign_positions``). A changed partition size
    would move samples between partitions that may already be generated, so it is refused while
    downstream partitions exist.
    """
    import collections

    from eagle3_assets import storage
    from eagle3_assets.partitions import assign_positions

    loaded = load_prompts(dataset_path, max_prompt_chars)
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
    keys = sorted(set(table["partition_key"].to_list()))
    storage.write_json_atomic(
        {
            "dataset_path": str(dataset_path),
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
        reject_reasons=dict(collections.Counter(_reason_kind(r.reason) for r in loaded.rejects).most_common(10)),
        table_path=layout.prompts_path,
        rejects_path=layout.rejects_path,
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
