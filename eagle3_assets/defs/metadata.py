"""Dagster's standard metadata for the assets: row counts, column schemas, and tables the UI can sort.

Dagster knows a handful of metadata keys (``TableMetadataSet``): ``dagster/row_count`` for an unpartitioned
table, ``dagster/partition_row_count`` for one partition (the catalog's row-count column and the partition
row-count plot read them) and ``dagster/column_schema`` (the catalog's Columns tab). The schema is read
from the Parquet file that was written, so it cannot drift from the data.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import dagster as dg

ROW_COUNT = "dagster/row_count"
PARTITION_ROW_COUNT = "dagster/partition_row_count"
COLUMN_SCHEMA = "dagster/column_schema"

# What the columns people look at mean; the others are listed with their type only.
COLUMN_DESCRIPTIONS = {
    "sample_id": "Stable id of the prompt (hash of its normalized conversation).",
    "partition_key": "The 1k-sample partition the prompt belongs to.",
    "position": "Fixed position in the dataset; partition k holds positions [k*size, (k+1)*size).",
    "messages": "The normalized conversation sent to the server (role, content).",
    "reasoning": "The target model's reasoning text, if the server separates it.",
    "content": "The target model's answer.",
    "finish_reason": "stop, or length when max_tokens cut the answer.",
    "prompt_token_ids": "Token ids of the prompt as the server tokenized it (vLLM return_token_ids).",
    "completion_token_ids": "Token ids the server generated.",
    "status": "ok or failed (failed rows carry the error).",
    "error": "Why the sample failed after its retries.",
    "seq_len": "Tokens of the stored sample (prompt + answer, cut at max_seq_len).",
    "loss_tokens": "Assistant tokens the draft is trained on.",
}


def column_schema(path: Path, descriptions: Mapping[str, str] = COLUMN_DESCRIPTIONS) -> dg.TableSchema:
    """The column schema of a Parquet file, from its footer (types as polars names them)."""
    # lazy: loads polars (heavy), which only this path needs
    import polars as pl

    return dg.TableSchema(
        columns=[
            dg.TableColumn(name=name, type=str(dtype), description=descriptions.get(name))
            for name, dtype in pl.read_parquet_schema(path).items()
        ]
    )


def parquet_table(path: Path, rows: int, *, partitioned: bool) -> dict[str, Any]:
    """Row count (per partition when partitioned) and column schema of one written Parquet file."""
    return {
        (PARTITION_ROW_COUNT if partitioned else ROW_COUNT): dg.MetadataValue.int(int(rows)),
        COLUMN_SCHEMA: dg.MetadataValue.table_schema(column_schema(path)),
    }


def same_named(result: Any, *fields: str) -> dict[str, Any]:
    """Metadata entries named as the core result's own fields, with their values: one name from engine to UI."""
    return {name: getattr(result, name) for name in fields}


def table(records: Iterable[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]]) -> dg.TableMetadataValue:
    """A sortable table: ``columns`` are (name, dagster type, description); NaN becomes an empty cell."""
    schema = dg.TableSchema(columns=[dg.TableColumn(name, kind, description) for name, kind, description in columns])
    rows = [
        dg.TableRecord({name: _cell(record.get(name)) for name, _kind, _description in columns}) for record in records
    ]
    return dg.MetadataValue.table(records=rows, schema=schema)


def _cell(value: Any) -> Any:
    if isinstance(value, float) and value != value:
        return None
    return value


def counts_table(counts: Mapping[str, int], what: str) -> dg.TableMetadataValue:
    """A (what, count) table, e.g. reject reasons or retry reasons."""
    return table(
        ({what: key, "count": int(n)} for key, n in counts.items()),
        [(what, "string", f"The {what}."), ("count", "int", "How many.")],
    )
