"""Dagster's private API that the operations use, checked name by name (issue 16).

Everything private lives in ``eagle3_assets/operations/dagster_internals.py``. When a Dagster upgrade moves or
renames one of these, this test names it, instead of ``eagle3 backfill`` failing in front of a user.
"""

from __future__ import annotations

import importlib
import inspect

import dagster as dg
import pytest

# (module, attribute) of every private name the project uses
PRIVATE_NAMES = [
    ("dagster._core.definitions.assets.graph.asset_graph_subset", "AssetGraphSubset"),
    ("dagster._core.definitions.assets.graph.base_asset_graph", "BaseAssetGraph"),
    ("dagster._core.execution.backfill", "PartitionBackfill"),
    ("dagster._core.instance.ref", "InstanceRef"),
    ("dagster._core.instance.utils", "RUNLESS_RUN_ID"),
    ("dagster._serdes", "serialize_value"),
    ("dagster._serdes", "deserialize_value"),
    ("dagster._core.storage.partition_status_cache", "AssetPartitionStatus"),
    ("dagster._core.utils", "make_new_backfill_id"),
    ("dagster._time", "get_current_timestamp"),
]


@pytest.mark.parametrize(("module", "name"), PRIVATE_NAMES)
def test_private_name_still_exists(module: str, name: str) -> None:
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        pytest.fail(
            f"Dagster {dg.__version__} moved {module}.{name} ({error}); "
            "update eagle3_assets/operations/dagster_internals.py"
        )
    assert found is not None


def test_the_signatures_and_members_used_are_still_there() -> None:
    from dagster._core.execution.backfill import PartitionBackfill
    from dagster._core.storage.partition_status_cache import AssetPartitionStatus

    used = {"backfill_id", "backfill_timestamp", "tags", "dynamic_partitions_store", "asset_graph_subset", "title"}
    used |= {"description", "run_config"}
    params = set(inspect.signature(PartitionBackfill.from_asset_graph_subset).parameters)
    assert used <= params, f"PartitionBackfill.from_asset_graph_subset lost {sorted(used - params)}"
    assert {"MATERIALIZED", "FAILED", "IN_PROGRESS"} <= set(AssetPartitionStatus.__members__)
    for method in ("get_status_by_partition", "add_backfill", "get_backfill", "get_daemon_heartbeats"):
        assert callable(getattr(dg.DagsterInstance, method, None)), f"DagsterInstance.{method} is gone"


def test_a_backfill_round_trips_and_statuses_read_back() -> None:
    """The module's functions against a real instance: store a backfill, read its targets, read statuses."""
    from eagle3_assets.operations import dagster_internals as internals

    parts = dg.DynamicPartitionsDefinition(name="p")

    @dg.asset(partitions_def=parts)
    def a() -> None:
        return None

    graph = dg.Definitions(assets=[a]).resolve_asset_graph()
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("p", ["x", "y", "z"])
        assert dg.materialize([a], partition_key="x", instance=instance).success
        statuses = internals.partition_statuses(instance, a.key, parts, ["x", "y"])
        assert statuses == {"x": "materialized", "y": "missing"}
        subset = graph.get(a.key).partitions_def.subset_with_partition_keys(["y", "z"])
        backfill_id = internals.store_asset_backfill(instance, {a.key: subset}, {"t": "1"}, "title", "desc")
        assert internals.backfill_target_keys(instance, backfill_id) == {"a": ["y", "z"]}
        assert instance.get_backfill(backfill_id).tags["t"] == "1"


def test_nothing_else_imports_dagster_private_modules() -> None:
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "eagle3_assets"
    offenders = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path.name != "dagster_internals.py" and "dagster._" in path.read_text()
    ]
    assert not offenders, f"import Dagster internals through operations/dagster_internals.py: {offenders}"


def test_an_instance_reopens_from_its_serialized_ref() -> None:
    """What ``eagle3 demo``'s partition run processes do: open the parent's instance from its ref."""
    from eagle3_assets.operations.dagster_internals import instance_from_ref_json, instance_ref_json

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("p", ["00000"])
        with instance_from_ref_json(instance_ref_json(instance)) as reopened:
            assert reopened.get_dynamic_partitions("p") == ["00000"]
