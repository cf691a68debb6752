"""``eagle3 counts``: rows per partition of every partitioned asset and the responses' status sums, by DuckDB
over the partition files (the demo prints the same table at its end)."""

from __future__ import annotations

import json
import sys

import duckdb

from eagle3_assets.core import storage

STATUS_COLUMNS = ("ok", "failed", "truncated", "prompt_tokens", "completion_tokens")


def print_counts(layout: storage.DataLayout, as_json: bool = False) -> int:
    """Print the table (or JSON with ``as_json``); 1 when a partition file cannot be read."""
    try:
        rows = storage.partition_row_counts(layout)
        status = storage.response_status_counts(layout)
    except (duckdb.Error, storage.UnreadablePartitionError) as error:
        print(f"eagle3 counts: {str(error).splitlines()[0]}", file=sys.stderr)
        print("`eagle3 status` lists each partition file and which one is unreadable", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps({"data_dir": str(layout.root), "rows": rows, "synthetic_responses": status}, indent=2))
        return 0
    if not rows:
        print(f"nothing materialized yet under {layout.root} (no partition files)")
        return 0
    keys = sorted({key for per_asset in rows.values() for key in per_asset})
    assets = list(rows)
    # ok/failed/truncated and the token sums are those of synthetic_responses (rows = ok + failed).
    header = ["partition", *assets, *STATUS_COLUMNS]
    table = [header]
    for key in keys:
        s = status.get(key, {})
        table.append(
            [key, *(str(rows[a].get(key, "-")) for a in assets)] + [str(s.get(k, "-")) for k in STATUS_COLUMNS]
        )
    totals = ["total", *(str(sum(rows[a].values())) for a in assets)] + [
        str(sum(s.get(k, 0) for s in status.values())) for k in STATUS_COLUMNS
    ]
    table.append(totals)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    print(f"data: {layout.root}")
    for row in table:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))
    return 0
