"""Every use of Dagster's private API (``dagster._core``, ``dagster._time``) in the project, in one place.

``eagle3 backfill --missing``, ``eagle3 status`` and ``eagle3 sync`` need what Dagster's public API does not
offer (Dagster 1.13): the per-partition status cache the UI's partition bar reads, storing an asset backfill
for the daemon with exactly the chosen partitions, and reading a stored backfill's targets; ``eagle3 demo``'s partition
run processes open the instance their parent uses from its serialized ``InstanceRef`` (what a run launcher hands its
run process). Nothing else in
the project imports ``dagster._*``; ``tests/integration/test_dagster_internals.py`` checks every name and signature used
here and fails with the name that moved when a Dagster upgrade moves one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import dagster as dg
from dagster._core.definitions.assets.graph.asset_graph_subset import AssetGraphSubset
from dagster._core.definitions.assets.graph.base_asset_graph import BaseAssetGraph
from dagster._core.execution.backfill import PartitionBackfill
from dagster._core.instance.ref import InstanceRef
from dagster._core.instance.utils import RUNLESS_RUN_ID
from dagster._core.storage.partition_status_cache import AssetPartitionStatus
from dagster._core.utils import make_new_backfill_id
from dagster._serdes import deserialize_value, serialize_value
from dagster._time import get_current_timestamp

if TYPE_CHECKING:
    from dagster._core.definitions.partitions.subset import PartitionsSubset

__all__ = [
    "RUNLESS_RUN_ID",
    "BaseAssetGraph",
    "backfill_target_keys",
    "instance_from_ref_json",
    "instance_ref_json",
    "partition_statuses",
    "store_asset_backfill",
]

# AssetPartitionStatus -> the project's names (anything else, including no entry, is "missing").
_STATUS_NAMES = {
    AssetPartitionStatus.MATERIALIZED: "materialized",
    AssetPartitionStatus.FAILED: "failed",
    AssetPartitionStatus.IN_PROGRESS: "in_progress",
}


def partition_statuses(
    instance: dg.DagsterInstance, key: dg.AssetKey, partitions_def: Any, partition_keys: Sequence[str]
) -> dict[str, str]:
    """materialized / failed / in_progress / missing per partition key, from the UI's status cache."""
    by_key = instance.get_status_by_partition(key, list(partition_keys), partitions_def) or {}
    return {k: _STATUS_NAMES.get(by_key.get(k), "missing") for k in partition_keys}  # type: ignore[arg-type]


def store_asset_backfill(
    instance: dg.DagsterInstance,
    subsets: Mapping[dg.AssetKey, PartitionsSubset],
    tags: Mapping[str, str],
    title: str,
    description: str,
) -> str:
    """Store an asset backfill of exactly these partition subsets for the daemon; returns its id."""
    backfill = PartitionBackfill.from_asset_graph_subset(
        backfill_id=make_new_backfill_id(),
        backfill_timestamp=get_current_timestamp(),
        tags=dict(tags),
        dynamic_partitions_store=instance,
        asset_graph_subset=AssetGraphSubset(partitions_subsets_by_asset_key=dict(subsets)),
        title=title,
        description=description,
        run_config=None,
    )
    instance.add_backfill(backfill)
    return backfill.backfill_id


def backfill_target_keys(instance: dg.DagsterInstance, backfill_id: str) -> dict[str, list[str]]:
    """Partition keys per asset that a stored backfill targets (what the UI lists for it)."""
    backfill = instance.get_backfill(backfill_id)
    if backfill is None:
        raise KeyError(f"no backfill {backfill_id}")
    data = backfill.asset_backfill_data
    if data is None:
        raise ValueError(f"backfill {backfill_id} is not an asset backfill")
    return {
        key.to_user_string(): sorted(subset.get_partition_keys())
        for key, subset in data.target_subset.partitions_subsets_by_asset_key.items()
    }


def instance_ref_json(instance: dg.DagsterInstance) -> str:
    """The instance's ``InstanceRef`` as JSON: another process opens the same storage with it."""
    return serialize_value(instance.get_ref())


def instance_from_ref_json(text: str) -> dg.DagsterInstance:
    return dg.DagsterInstance.from_ref(deserialize_value(text, InstanceRef))
