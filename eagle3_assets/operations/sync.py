"""``eagle3 sync``: record partition files found on disk as materialized when the instance does not know them.

Partition status lives in Dagster's event log, not on disk: after losing ``DAGSTER_HOME`` (a new machine,
a wiped SQLite) every partition shows as missing, and a missing-only backfill would regenerate hours of
responses that are sitting in ``EAGLE3_DATA_DIR``. Sync validates each file and writes a runless
``AssetMaterialization`` (``DagsterInstance.report_runless_asset_event``, the "report materialization" of the
UI) with its row counts, after registering the dynamic partition keys ``raw_prompts`` defines.

A file that fails validation is reported and not recorded, so the next backfill regenerates it:
unreadable Parquet, missing columns, or (responses) not exactly one row per prompt of the partition in
``raw_prompts``, (hidden states) not one row per ok response of the partition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_assets.core.lineage import prompt_drift
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.operations.common import (
    FAILED,
    MATERIALIZED,
    MISSING,
    asset_key,
    load_asset_graph,
    partition_status,
    registered_partition_keys,
)

if TYPE_CHECKING:
    import dagster as dg

    from eagle3_assets.operations.dagster_internals import BaseAssetGraph

SYNC_TAG = "eagle3/synced_from_disk"
HIDDEN_STATES_INDEX_COLUMNS = ("sample_id", "row", "seq_len", "file")


@dataclass
class FileVerdict:
    asset: str
    partition_key: str | None
    path: Path
    valid: bool
    reason: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class SyncReport:
    registered_partitions: list[str] = field(default_factory=list)
    recorded: list[FileVerdict] = field(default_factory=list)
    already: list[FileVerdict] = field(default_factory=list)  # Dagster already has them materialized
    skipped_failed: list[FileVerdict] = field(default_factory=list)  # valid, but Dagster records a failure
    invalid: list[FileVerdict] = field(default_factory=list)


# Rows of the file (Parquet footer); recorded under Dagster's row-count key of the asset's kind.
ROWS = "rows"


def _quote(path: Path) -> str:
    return str(path).replace("'", "''")


def _parquet_facts(path: Path) -> tuple[int, set[str]]:
    """Row count (footer only) and column names; raises on a file that is not readable Parquet."""
    # lazy: loads duckdb (heavy), which only this path needs
    import duckdb

    with duckdb.connect() as con:
        rows = con.execute(f"SELECT sum(num_rows) FROM parquet_file_metadata('{_quote(path)}')").fetchone()
        columns = con.execute(f"SELECT name FROM parquet_schema('{_quote(path)}')").fetchall()
    return int(rows[0] or 0) if rows else 0, {c[0] for c in columns}


def validate_prompts(layout: DataLayout) -> FileVerdict:
    path = layout.prompts_path
    try:
        rows, columns = _parquet_facts(path)
    except Exception as error:  # duckdb raises its own types: any failure means not usable
        return FileVerdict("raw_prompts", None, path, False, f"unreadable Parquet: {_first_line(error)}")
    needed = {"sample_id", "position", "partition_key", "messages"}
    if not needed <= columns:
        return FileVerdict("raw_prompts", None, path, False, f"missing columns {sorted(needed - columns)}")
    return FileVerdict("raw_prompts", None, path, True, metadata={ROWS: rows})


def validate_responses(layout: DataLayout, key: str, expected_ids: list[str] | None) -> FileVerdict:
    # lazy: loads duckdb (heavy), which only this path needs
    import duckdb

    # lazy: loads aiohttp (heavy), which only this path needs
    from eagle3_assets.generation.records import COLUMNS
    from eagle3_assets.generation.response_checks import completeness_check

    path = layout.responses_path(key)
    try:
        rows, columns = _parquet_facts(path)
    except Exception as error:
        return FileVerdict("synthetic_responses", key, path, False, f"unreadable Parquet: {_first_line(error)}")
    if not set(COLUMNS) <= columns:
        return FileVerdict("synthetic_responses", key, path, False, f"missing columns {sorted(set(COLUMNS) - columns)}")
    if expected_ids is None:
        return FileVerdict("synthetic_responses", key, path, False, "no prompts for this partition in raw_prompts")
    outcome = completeness_check(path, expected_ids)
    if not outcome.passed:
        return FileVerdict("synthetic_responses", key, path, False, f"incomplete: {outcome.description}")

    drift = prompt_drift(layout, [key]).get(key)  # same ids, other prompts: the rows answer old questions
    if drift is not None:
        return FileVerdict("synthetic_responses", key, path, False, drift.describe())
    with duckdb.connect() as con:
        ok, failed, truncated, prompt_tokens, completion_tokens = con.execute(
            f"""SELECT count(*) FILTER (WHERE status = 'ok'), count(*) FILTER (WHERE status = 'failed'),
                       count(*) FILTER (WHERE finish_reason = 'length'),
                       coalesce(sum(prompt_tokens) FILTER (WHERE status = 'ok'), 0),
                       coalesce(sum(completion_tokens) FILTER (WHERE status = 'ok'), 0)
                FROM read_parquet('{_quote(path)}')"""
        ).fetchone()
    return FileVerdict(
        "synthetic_responses",
        key,
        path,
        True,
        metadata={
            ROWS: rows,
            "ok": int(ok),
            "failed": int(failed),
            "truncated": int(truncated),
            "prompt_tokens": int(prompt_tokens),
            "completion_tokens": int(completion_tokens),
        },
    )


def validate_hidden_states(layout: DataLayout, key: str) -> FileVerdict:
    # lazy: loads polars (heavy), which only this path needs
    import polars as pl

    path = layout.hidden_states_index_path(key)
    try:
        rows, columns = _parquet_facts(path)
    except Exception as error:
        return FileVerdict("hidden_states", key, path, False, f"unreadable Parquet: {_first_line(error)}")
    missing = set(HIDDEN_STATES_INDEX_COLUMNS) - columns
    if missing:
        return FileVerdict("hidden_states", key, path, False, f"missing columns {sorted(missing)}")
    responses = layout.responses_path(key)
    if not responses.exists():
        return FileVerdict("hidden_states", key, path, False, "no synthetic_responses file for this partition")
    ok_ids = pl.read_parquet(responses, columns=["sample_id", "status"]).filter(pl.col("status") == "ok")
    index_ids = pl.read_parquet(path, columns=["sample_id"])["sample_id"]
    if index_ids.n_unique() != index_ids.len() or set(index_ids.to_list()) != set(ok_ids["sample_id"].to_list()):
        return FileVerdict(
            "hidden_states",
            key,
            path,
            False,
            f"{index_ids.len()} index rows for {ok_ids.height} ok responses (not one per ok response)",
        )
    if not layout.hidden_states_dir(key).is_dir():
        return FileVerdict("hidden_states", key, path, False, f"no data folder {layout.hidden_states_dir(key)}")
    return FileVerdict("hidden_states", key, path, True, metadata={ROWS: rows})


def sync(
    instance: dg.DagsterInstance,
    layout: DataLayout,
    dry_run: bool = False,
    include_failed: bool = False,
    graph: BaseAssetGraph | None = None,
) -> SyncReport:
    """Validate every partition file and record the valid ones Dagster lacks (see the module docstring)."""
    # lazy: loads polars (heavy), which only this path needs
    import polars as pl

    graph = graph or load_asset_graph()
    report = SyncReport()
    prompts = validate_prompts(layout) if layout.prompts_path.exists() else None
    ids_by_key: dict[str, list[str]] = {}
    if prompts is not None and not prompts.valid:
        report.invalid.append(prompts)
    elif prompts is not None:
        frame = pl.read_parquet(layout.prompts_path, columns=["sample_id", "partition_key"])
        for (key,), group in frame.group_by("partition_key"):
            ids_by_key[str(key)] = group["sample_id"].to_list()

    responses_def = graph.get(asset_key("synthetic_responses")).partitions_def
    # Register the keys raw_prompts defines (what raw_prompts itself does when it runs), so backfills and
    # the UI see every partition, synced or still to generate.
    known = set(registered_partition_keys(instance, responses_def))
    new_keys = sorted(set(ids_by_key) - known)
    if new_keys and not dry_run:
        instance.add_dynamic_partitions(responses_def.name, new_keys)
    report.registered_partitions = new_keys

    if prompts is not None and prompts.valid:
        _record_if_missing(instance, prompts, None, report, dry_run, include_failed)

    verdicts = [
        validate_responses(layout, key, ids_by_key.get(key)) for key in layout.partition_files("synthetic_responses")
    ]
    if graph.has(asset_key("hidden_states")):
        verdicts += [validate_hidden_states(layout, key) for key in layout.partition_files("hidden_states")]
    for name in ("synthetic_responses", "hidden_states"):
        mine = [v for v in verdicts if v.asset == name]
        report.invalid += [v for v in mine if not v.valid]
        valid = [v for v in mine if v.valid]
        if not valid:
            continue
        key = asset_key(name)
        states = partition_status(instance, key, responses_def, [v.partition_key for v in valid])  # type: ignore[misc]
        for verdict in valid:
            _record_if_missing(
                instance, verdict, states.get(verdict.partition_key or ""), report, dry_run, include_failed
            )
    return report


def _record_if_missing(
    instance: dg.DagsterInstance,
    verdict: FileVerdict,
    state: str | None,
    report: SyncReport,
    dry_run: bool,
    include_failed: bool,
) -> None:
    # lazy: loads dagster (heavy), which only this path needs
    import dagster as dg

    # lazy: loads dagster (heavy), which only this path needs
    from eagle3_assets.defs.metadata import parquet_table

    key = asset_key(verdict.asset)
    if state is None:  # unpartitioned: materialized when any materialization exists
        state = MATERIALIZED if instance.get_latest_materialization_event(key) is not None else MISSING
    if state == MATERIALIZED:
        report.already.append(verdict)
        return
    if state == FAILED and not include_failed:
        report.skipped_failed.append(verdict)
        return
    if state not in (MISSING, FAILED):  # in progress: the running run will record it
        report.already.append(verdict)
        return
    if not dry_run:
        partitioned = verdict.partition_key is not None
        instance.report_runless_asset_event(
            dg.AssetMaterialization(
                asset_key=key,
                partition=verdict.partition_key,
                description=f"recorded by `eagle3 sync` from {verdict.path}",
                metadata={
                    **{k: v for k, v in verdict.metadata.items() if k != ROWS},
                    **parquet_table(verdict.path, verdict.metadata[ROWS], partitioned=partitioned),
                    "path": dg.MetadataValue.path(str(verdict.path)),
                    "file_modified_at": dg.MetadataValue.timestamp(verdict.path.stat().st_mtime),
                    SYNC_TAG: True,
                },
            )
        )
    report.recorded.append(verdict)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
