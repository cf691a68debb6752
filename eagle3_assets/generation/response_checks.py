"""Partition checks (pure functions; the Dagster asset checks wrap them): completeness and error rate."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import polars as pl

from eagle3_assets.core.check_outcome import CheckOutcome
from eagle3_assets.generation.records import STATUS_FAILED

DEFAULT_MAX_ERROR_RATE = 0.01


def completeness_check(path: Path, expected_ids: Collection[str]) -> CheckOutcome:
    """One row per prompt of the partition, no duplicate ``sample_id``, nothing foreign."""
    ids = pl.read_parquet(path, columns=["sample_id"])["sample_id"]
    expected = set(expected_ids)
    present = set(ids.to_list())
    duplicates = ids.len() - ids.n_unique()
    missing = sorted(expected - present)
    unexpected = sorted(present - expected)
    passed = not duplicates and not missing and not unexpected and ids.len() == len(expected)
    metadata = {
        "rows": ids.len(),
        "expected": len(expected),
        "duplicate_rows": duplicates,
        "missing": len(missing),
        "unexpected": len(unexpected),
        "missing_examples": missing[:5],
        "unexpected_examples": unexpected[:5],
    }
    description = f"{ids.len()} rows for {len(expected)} prompts" + (
        "" if passed else f": {len(missing)} missing, {duplicates} duplicate rows, {len(unexpected)} unexpected"
    )
    return CheckOutcome(passed, description, metadata)


def error_rate_check(path: Path, max_error_rate: float = DEFAULT_MAX_ERROR_RATE) -> CheckOutcome:
    """Share of ``failed`` rows at most ``max_error_rate``; truncated (finish_reason length) counted too."""
    frame = pl.read_parquet(path, columns=["status", "finish_reason", "error"])
    rows = frame.height
    failed = frame.filter(pl.col("status") == STATUS_FAILED)
    truncated = int((frame["finish_reason"] == "length").sum())
    rate = failed.height / rows if rows else 0.0
    top = failed["error"].fill_null("").str.slice(0, 200).value_counts(sort=True).head(3)
    errors = {row["error"]: int(row["count"]) for row in top.iter_rows(named=True)}
    passed = rate <= max_error_rate
    description = (
        f"{failed.height}/{rows} failed ({rate:.2%}, limit {max_error_rate:.2%}); {truncated} truncated at max_tokens"
    )
    return CheckOutcome(
        passed,
        description,
        {
            "rows": rows,
            "failed": failed.height,
            "error_rate": rate,
            "max_error_rate": max_error_rate,
            "truncated": truncated,
            "top_errors": errors,
        },
    )
