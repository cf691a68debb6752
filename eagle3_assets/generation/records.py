"""The ``synthetic_responses`` row: one per prompt of a partition, ``ok`` or ``failed``.

Downstream (hidden states) reads ``sample_id, messages, reasoning, content, status, finish_reason`` and, when the
server returned them, ``prompt_token_ids`` and ``completion_token_ids`` (the exact tokens it trains on).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl

STATUS_OK = "ok"
# the suffix of a turn row's sample id in all-turns regeneration: "{sample_id}#turn{k}" (generation/turns.py)
TURN_MARK = "#turn"
STATUS_FAILED = "failed"

MESSAGE_DTYPE = pl.List(pl.Struct({"role": pl.String, "content": pl.String}))

RESPONSE_SCHEMA: dict[str, pl.DataType] = {
    "sample_id": pl.String(),
    "partition_key": pl.String(),
    "messages": MESSAGE_DTYPE,
    "reasoning": pl.String(),
    "content": pl.String(),
    "finish_reason": pl.String(),
    "prompt_tokens": pl.Int64(),
    "completion_tokens": pl.Int64(),
    # vLLM's own token ids (``return_token_ids``); null when the server did not send them
    "prompt_token_ids": pl.List(pl.Int64()),
    "completion_token_ids": pl.List(pl.Int64()),
    "latency_s": pl.Float64(),
    "endpoint": pl.String(),
    "attempts": pl.Int64(),
    "model": pl.String(),
    "sampling_params": pl.String(),
    "status": pl.String(),
    "error": pl.String(),
    "finished_at": pl.Float64(),
    # hash of what determined the answer (generation/fingerprint.py); null in files written before it existed
    "request_fingerprint": pl.String(),
    # EAGLE3_REGENERATE=all-turns (generation/turns.py); null in last-turn rows. User turns the model answered,
    # user turns the conversation has, why it stopped early (null: it did not), the [start, end) token offsets
    # of every model-written turn inside prompt_token_ids + completion_token_ids (the loss mask) and their length.
    "turns_regenerated": pl.Int64(),
    "turns_total": pl.Int64(),
    "stop_reason": pl.String(),
    "model_spans": pl.List(pl.List(pl.Int64())),
    "model_tokens": pl.Int64(),
}
COLUMNS = tuple(RESPONSE_SCHEMA)


@dataclass(frozen=True)
class PromptToGenerate:
    """One prompt of the partition: its id and the chat messages sent as the request."""

    sample_id: str
    messages: Sequence[Mapping[str, str]]


def normalize_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, str]]:
    # Only role and content travel: the row schema is a list of {role, content} structs.
    return [
        {"role": str(m["role"]), "content": "" if m.get("content") is None else str(m["content"])} for m in messages
    ]


# The Python type each column's non-null values have in a journal record (checked before a record is written).
_ROW_TYPES: dict[str, type] = {
    "sample_id": str,
    "partition_key": str,
    "messages": list,
    "reasoning": str,
    "content": str,
    "finish_reason": str,
    "prompt_tokens": int,
    "completion_tokens": int,
    "prompt_token_ids": list,
    "completion_token_ids": list,
    "latency_s": float,
    "endpoint": str,
    "attempts": int,
    "model": str,
    "sampling_params": str,
    "status": str,
    "error": str,
    "finished_at": float,
    "turns_regenerated": int,
    "turns_total": int,
    "stop_reason": str,
    "model_spans": list,
    "model_tokens": int,
}


def check_row(record: Mapping[str, Any]) -> None:
    """Raise TypeError naming the first field of ``record`` whose value cannot go into its column.

    Why here and not only where replies are parsed: a row of the wrong type would be journaled fine and then break
    the partition's Parquet on every later run, so no record reaches the journal unchecked, whoever built it.
    """
    for name, kind in _ROW_TYPES.items():
        value = record.get(name)
        if value is None:
            continue
        if type(value) is not kind and not (kind is float and type(value) is int):
            raise TypeError(f"row field {name} is {type(value).__name__}, expected {kind.__name__} or null")


def rows_to_frame(rows: Sequence[Mapping[str, Any]]) -> pl.DataFrame:
    """Rows (dicts with the schema's keys) as a DataFrame with exactly the row schema, in its column order."""
    return pl.from_dicts(list(rows), schema=RESPONSE_SCHEMA) if rows else empty_frame()


def empty_frame() -> pl.DataFrame:
    return pl.DataFrame(schema=RESPONSE_SCHEMA)
