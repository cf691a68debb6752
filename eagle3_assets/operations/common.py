"""Shared pieces of the operations: the asset graph, per-partition status and latest materializations."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from eagle3_assets.core.lineage import verifier_fingerprint
from eagle3_assets.core.partition_keys import KEY_PATTERN

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    import dagster as dg

    from eagle3_assets.operations.dagster_internals import BaseAssetGraph

# Values of PartitionState.status
MATERIALIZED = "materialized"
FAILED = "failed"
IN_PROGRESS = "in_progress"
MISSING = "missing"


def load_asset_graph() -> BaseAssetGraph:
    """The asset graph of the code location (the same module ``workspace.yaml`` loads)."""
    # lazy: loads dagster (heavy), which only this path needs
    from eagle3_assets.definitions import defs

    return defs.resolve_asset_graph()


def asset_key(name: str) -> dg.AssetKey:
    # lazy: loads dagster (heavy), which only this path needs
    import dagster as dg

    return dg.AssetKey.from_user_string(name)


def partitions_def_of(graph: BaseAssetGraph, key: dg.AssetKey) -> Any:
    if not graph.has(key):
        known = ", ".join(sorted(k.to_user_string() for k in graph.get_all_asset_keys()))
        raise KeyError(f"no asset {key.to_user_string()!r} in the definitions (known: {known})")
    return graph.get(key).partitions_def


def registered_partition_keys(instance: dg.DagsterInstance, partitions_def: Any) -> list[str]:
    """All partition keys of ``partitions_def`` (dynamic ones are read from the instance)."""
    # lazy: loads dagster (heavy), which only this path needs
    import dagster as dg

    if isinstance(partitions_def, dg.DynamicPartitionsDefinition):
        assert partitions_def.name is not None
        keys = list(instance.get_dynamic_partitions(partitions_def.name))
    else:
        keys = list(partitions_def.get_partition_keys(dynamic_partitions_store=instance))
    invalid = [key for key in keys if not KEY_PATTERN.fullmatch(key)]
    if invalid:  # added by hand (the UI's "Add partition", the Python API): never turned into a path
        logger.warning(
            "ignoring partition keys that are not of this project's form (added by hand?): %s; %s",
            ", ".join(repr(key) for key in invalid),
            "delete them from the partitions of 'prompt_partitions' in the UI",
        )
    return [key for key in keys if KEY_PATTERN.fullmatch(key)]


def partition_status(
    instance: dg.DagsterInstance, key: dg.AssetKey, partitions_def: Any, partition_keys: Sequence[str]
) -> dict[str, str]:
    """materialized / failed / in_progress / missing per partition key, from the instance's status cache.

    This is the cache the UI's partition bar reads: it is derived from the event log (materializations,
    planned materializations of runs in progress, and failures of runs that planned a partition).
    """
    # lazy: loads dagster (heavy), which only this path needs
    from eagle3_assets.operations.dagster_internals import partition_statuses

    return partition_statuses(instance, key, partitions_def, partition_keys)


@dataclass(frozen=True)
class RecordedMaterialization:
    partition_key: str
    timestamp: float
    run_id: str  # "" for runless events (e.g. written by ``eagle3 sync``)
    row_count: int | None


def latest_materializations(
    instance: dg.DagsterInstance, key: dg.AssetKey, partition_keys: Sequence[str]
) -> dict[str, RecordedMaterialization]:
    """The newest materialization event per partition (one storage query per 100 partitions)."""
    # lazy: loads dagster (heavy), which only this path needs
    import dagster as dg

    # lazy: loads dagster (heavy), which only this path needs
    from eagle3_assets.operations.dagster_internals import RUNLESS_RUN_ID

    latest: dict[str, RecordedMaterialization] = {}
    keys = list(partition_keys)
    for start in range(0, len(keys), 100):
        chunk = keys[start : start + 100]
        wanted = set(chunk)
        cursor = None
        while wanted:
            result = instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=key, asset_partitions=chunk), limit=1000, cursor=cursor
            )
            for record in result.records:  # newest first
                partition = record.partition_key
                if partition not in wanted:
                    continue
                wanted.discard(partition)
                materialization = record.asset_materialization
                rows = (
                    materialization.metadata.get("dagster/partition_row_count")
                    or materialization.metadata.get("dagster/row_count")
                    if materialization
                    else None
                )
                run_id = record.run_id if record.run_id != RUNLESS_RUN_ID else ""
                latest[partition] = RecordedMaterialization(
                    partition, record.timestamp, run_id, int(rows.value) if rows is not None else None
                )
            if not result.has_more:
                break
            cursor = result.cursor
    return latest


def partitioned_downstream(graph: BaseAssetGraph, key: dg.AssetKey) -> list[dg.AssetKey]:
    """Descendants of ``key`` partitioned exactly like it, in topological order.

    A backfill of missing partitions carries them along: a regenerated response partition makes the hidden
    states of that partition stale. Unpartitioned descendants (vocab_mapping, draft_model) are left to the
    user: retraining is a decision, not a repair.
    """
    partitions_def = graph.get(key).partitions_def
    seen: set[dg.AssetKey] = set()
    frontier = list(graph.get(key).child_keys)
    while frontier:
        child = frontier.pop()
        if child in seen or graph.get(child).partitions_def != partitions_def:
            continue
        seen.add(child)
        frontier.extend(graph.get(child).child_keys)
    order = [k for level in graph.toposorted_asset_keys_by_level for k in sorted(level) if k in seen]
    return order


def current_extraction_settings(layout: Any) -> dict[str, Any]:
    """The verifier content and layer ids the environment's settings (``EAGLE3_VERIFIER_PATH``,
    ``EAGLE3_LAYER_IDS``) would extract hidden states with now; empty when no verifier is configured or readable
    (then only the responses are compared). max_seq_len and dtype are per-run config, so they are not compared."""

    # lazy: loads pydantic (heavy), which only this path needs
    from eagle3_assets.core.verifier import resolve_layer_ids

    # lazy: loads dagster (heavy), which only this path needs
    from eagle3_assets.defs.resources import VerifierResource

    try:
        verifier = VerifierResource.from_env()
        path = verifier.resolved_path()
        config = json.loads((path / "config.json").read_text())
        config = config.get("text_config", config)  # multimodal wrappers keep the LM config inside
        layer_ids = resolve_layer_ids(verifier.layer_id_list(), int(config["num_hidden_layers"]))
    except Exception:  # no verifier here: nothing to compare the settings with
        return {}
    return {
        "verifier": verifier_fingerprint(path, cache_dir=layout.asset_dir("hidden_states")),
        "layer_ids": layer_ids,
    }


def stale_downstream(layout: Any, keys: Sequence[str] | None, extraction: Any = None) -> dict[str, str]:
    """hidden_states partitions built from other responses or settings than the current ones (key -> why), after
    finishing any publish a kill interrupted (``publish.recover_idle``). ``extraction`` None: the environment's."""
    # lazy: loads pydantic (heavy), which only this path needs
    from eagle3_assets.hidden_states import publish
    from eagle3_assets.hidden_states.versions import stale_hidden_states

    publish.recover_idle(layout, keys)
    if extraction is None:
        extraction = current_extraction_settings(layout)
    return stale_hidden_states(layout, keys, extraction)
