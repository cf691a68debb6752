"""``eagle3 status``: partition files on disk beside Dagster's record of them, per partition.

``where`` is ``both`` (file and materialization agree), ``disk only`` (a file Dagster does not count as
materialized: run ``eagle3 sync``), ``dagster only`` (a recorded materialization whose file is gone: the next
missing-only backfill will NOT regenerate it; wipe the partition in the UI or materialize it again) or
``neither``. A ``synthetic_responses`` file that no longer answers its partition's prompt set (prompts appended
to a half-full partition, edited or dropped) is noted ``prompts changed``: ``eagle3 backfill --missing`` plans
it; so is a partition whose recorded (blocking) checks failed (noted ``checks failed``), and a ``hidden_states``
partition built from other responses than the file on disk, or with another verifier or other layer ids than the
environment's (noted ``built from other responses`` / ``built with other settings``). Listing first finishes a
publish a kill interrupted (``publish.recover_idle``: a missing pointer beside a complete version is restored).
``rows`` compares the file's footer with the ``dagster/partition_row_count`` of the latest materialization.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from eagle3_assets.core.lineage import PartitionLineage, prompt_drift
from eagle3_assets.core.storage import PARTITIONED_ASSETS, DataLayout, footer_row_counts
from eagle3_assets.operations.common import (
    MATERIALIZED,
    asset_key,
    latest_materializations,
    load_asset_graph,
    partition_status,
    registered_partition_keys,
    stale_downstream,
)

if TYPE_CHECKING:
    import dagster as dg

    from eagle3_assets.operations.dagster_internals import BaseAssetGraph

BOTH, DISK_ONLY, DAGSTER_ONLY, NEITHER = "both", "disk only", "dagster only", "neither"


@dataclass(frozen=True)
class PartitionRow:
    asset: str
    partition_key: str
    where: str
    dagster_status: str  # materialized / failed / in_progress / missing / unregistered
    disk_rows: int | None  # None: no file, or a file that is not readable Parquet (see error)
    dagster_rows: int | None  # dagster/partition_row_count of the latest materialization
    synced: bool  # the latest materialization was recorded by `eagle3 sync`, not by a run
    error: str = ""  # why the file on disk is unreadable
    stale: str = ""  # why the file is out of date (prompts changed) or unusable (checks failed); empty: current

    @property
    def rows_agree(self) -> bool | None:
        if self.disk_rows is None or self.dagster_rows is None:
            return None
        return self.disk_rows == self.dagster_rows

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "rows_agree": self.rows_agree}


def partition_table(
    instance: dg.DagsterInstance,
    layout: DataLayout,
    graph: BaseAssetGraph | None = None,
    extraction: Mapping[str, Any] | None = None,
) -> list[PartitionRow]:
    """One row per partition of each partitioned asset. ``extraction``: the hidden-states settings to compare
    with (None: the environment's, see ``common.current_extraction_settings``)."""
    graph = graph or load_asset_graph()

    rows: list[PartitionRow] = []
    drift = {k: d.describe() for k, d in prompt_drift(layout).items()}
    downstream = stale_downstream(layout, None, extraction)  # also restores a publish a kill interrupted
    for name in PARTITIONED_ASSETS:
        key = asset_key(name)
        files = layout.partition_files(name)
        on_disk, errors = footer_row_counts(files)
        if not graph.has(key):
            if on_disk:  # files of an asset this code location does not define (yet)
                rows += [
                    PartitionRow(name, k, DISK_ONLY, "unknown asset", on_disk.get(k), None, False, errors.get(k, ""))
                    for k in files
                ]
            continue
        partitions_def = graph.get(key).partitions_def
        registered = registered_partition_keys(instance, partitions_def)
        states = partition_status(instance, key, partitions_def, registered)
        latest = latest_materializations(instance, key, [k for k, s in states.items() if s == MATERIALIZED])
        for partition in sorted(set(registered) | set(files)):
            state = states.get(partition, "unregistered")
            recorded = state == MATERIALIZED
            present = partition in files
            where = {(True, True): BOTH, (True, False): DISK_ONLY, (False, True): DAGSTER_ONLY}.get(
                (present, recorded), NEITHER
            )
            record = latest.get(partition)
            rows.append(
                PartitionRow(
                    name,
                    partition,
                    where,
                    state,
                    on_disk.get(partition),
                    record.row_count if record else None,
                    bool(record and not record.run_id),
                    errors.get(partition, ""),
                    drift.get(partition)
                    or _failed_checks(layout, name, partition)
                    or (downstream.get(partition, "") if name == "hidden_states" else ""),
                )
            )
    return rows


def _failed_checks(layout: DataLayout, asset: str, partition: str) -> str:
    lineage = PartitionLineage.load(layout, asset, partition)
    if lineage is None or not lineage.checks or lineage.checks_passed:
        return ""
    return "checks failed: " + ", ".join(sorted(k for k, ok in lineage.checks.items() if not ok))


def render(rows: list[PartitionRow]) -> str:
    header = ["asset", "partition", "where", "dagster", "disk_rows", "dagster_rows", "note"]
    table = [header]
    for row in rows:
        note = []
        if row.error:
            note.append(f"UNREADABLE: {row.error[:60]}")
        if row.stale:
            note.append(f"{row.stale.upper()} (eagle3 backfill --missing)")
        if row.rows_agree is False:
            note.append("ROW COUNTS DIFFER")
        if row.synced:
            note.append("synced")
        if row.where == DISK_ONLY:
            note.append("eagle3 sync")
        if row.where == DAGSTER_ONLY:
            note.append("file gone")
        table.append(
            [
                row.asset,
                row.partition_key,
                row.where,
                row.dagster_status,
                "-" if row.disk_rows is None else str(row.disk_rows),
                "-" if row.dagster_rows is None else str(row.dagster_rows),
                ", ".join(note),
            ]
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in table]
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.where] = counts.get(row.where, 0) + 1
    lines.append("summary: " + (", ".join(f"{n} {w}" for w, n in sorted(counts.items())) or "no partitions"))
    return "\n".join(lines)
