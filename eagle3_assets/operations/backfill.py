"""``eagle3 backfill --missing``: one daemon-run asset backfill over the missing or failed partitions.

How the partitions are found: the instance's partition status cache (``DagsterInstance.get_status_by_partition``,
the one the UI's partition bars read, derived from the event log) over every registered key of the dynamic
partitions. ``missing`` = never materialized, ``failed`` = the latest run that planned it failed; partitions
in progress are left alone (a second run would fight the first for the partition lock). Given the data
layout, a ``synthetic_responses`` partition whose file no longer answers its prompt set (prompts appended to a
half-full last partition, edited or dropped: ``lineage.prompt_drift``) is planned too, though Dagster records it
as materialized.

How it is launched: a ``PartitionBackfill`` written with ``DagsterInstance.add_backfill``, exactly what the
UI's launch dialog and the GraphQL ``launchPartitionBackfill`` mutation store. It needs no running webserver;
``dagster-daemon`` (started by ``dagster dev``) picks it up, launches one run per partition through the run
queue and the ``vllm`` pool, and the backfill appears under Overview > Backfills.

A ``hidden_states`` partition built from other responses than the file on disk, or with another verifier or other
layer ids than the environment's, is planned too (``versions.stale_hidden_states``); planning first finishes a
publish a kill interrupted (``publish.recover_idle``).

Downstream: descendants partitioned like the anchor asset (hidden_states) get the anchor's targets plus
their own missing/failed partitions, so a partition whose responses exist is not regenerated just because
its hidden states are missing.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from eagle3_assets.core.lineage import PartitionLineage, prompt_drift
from eagle3_assets.core.partition_keys import check_partition_key
from eagle3_assets.operations.common import (
    FAILED,
    IN_PROGRESS,
    MISSING,
    asset_key,
    load_asset_graph,
    partition_status,
    partitioned_downstream,
    partitions_def_of,
    registered_partition_keys,
    stale_downstream,
)

if TYPE_CHECKING:
    import dagster as dg

    from eagle3_assets.core.storage import DataLayout
    from eagle3_assets.operations.dagster_internals import BaseAssetGraph

DEFAULT_ASSET = "synthetic_responses"
LAUNCHED_BY_TAG = "eagle3/launched_by"


@dataclass
class BackfillPlan:
    asset: str
    registered: list[str]  # every known partition key of the asset
    status: dict[str, dict[str, str]]  # asset -> partition -> materialized/failed/in_progress/missing
    targets: dict[str, list[str]] = field(default_factory=dict)  # asset -> partitions to (re)materialize
    stale: dict[str, str] = field(default_factory=dict)  # anchor partition -> why its file is out of date
    stale_downstream: dict[str, str] = field(default_factory=dict)  # hidden_states partition -> why it is stale

    @property
    def empty(self) -> bool:
        return not any(self.targets.values())

    def describe(self) -> str:
        lines = []
        for name, keys in self.targets.items():
            states = self.status.get(name, {})
            why = self.stale_downstream if name == "hidden_states" else {}
            detail = (
                ", ".join(f"{k} ({why.get(k) or self.stale.get(k) or states.get(k, MISSING)})" for k in keys)
                or "nothing"
            )
            lines.append(f"{name}: {len(keys)} partition(s): {detail}")
        busy = sorted(k for k, s in self.status.get(self.asset, {}).items() if s == IN_PROGRESS)
        if busy:
            lines.append(f"left alone, in progress: {', '.join(busy)}")
        return "\n".join(lines)


def plan_missing(
    instance: dg.DagsterInstance,
    asset: str = DEFAULT_ASSET,
    partitions: Sequence[str] | None = None,
    downstream: bool = True,
    graph: BaseAssetGraph | None = None,
    layout: DataLayout | None = None,
    extraction: Mapping[str, Any] | None = None,
) -> BackfillPlan:
    """Which partitions of ``asset`` (and its partitioned descendants) are missing or failed, or (given
    ``layout``) hold responses to another prompt set than the partition has now, or hidden states built from
    other responses or settings (``extraction``; None: the environment's) than the current ones."""
    graph = graph or load_asset_graph()
    anchor = asset_key(asset)
    partitions_def = partitions_def_of(graph, anchor)
    if partitions_def is None:
        raise ValueError(f"{asset} is not partitioned; materialize it from the UI or `dagster asset materialize`")
    registered = registered_partition_keys(instance, partitions_def)
    scope = registered
    if partitions:
        for key in partitions:
            check_partition_key(key)  # a path-like key is refused by name before anything else
        unknown = [k for k in partitions if k not in set(registered)]
        if unknown:
            raise ValueError(
                f"--partitions {','.join(unknown)}: not registered partition keys of {asset} "
                f"(known: {_short(registered)}); materialize raw_prompts or run `eagle3 sync` first"
            )
        scope = [k for k in registered if k in set(partitions)]
    plan = BackfillPlan(asset=asset, registered=registered, status={})
    if layout is not None and asset == DEFAULT_ASSET:
        plan.stale = {k: d.describe() for k, d in prompt_drift(layout, scope).items()}
    if layout is not None:
        plan.stale_downstream = stale_downstream(layout, scope, extraction)
    chosen: set[str] = set()
    failed_checks = _failed_checks(layout, [anchor, *partitioned_downstream(graph, anchor)], scope)
    for key in [anchor, *(partitioned_downstream(graph, anchor) if downstream else [])]:
        states = partition_status(instance, key, partitions_def, scope)
        name = key.to_user_string()
        plan.status[name] = states
        own = {k for k, s in states.items() if s in (MISSING, FAILED)}
        own |= {k for k in failed_checks.get(name, {}) if states.get(k) != IN_PROGRESS}
        if name == "hidden_states":  # built from other responses or settings: Dagster may still call it fresh
            own |= {k for k in plan.stale_downstream if states.get(k) != IN_PROGRESS}
        if key == anchor:
            for k, why in failed_checks.get(name, {}).items():
                plan.stale.setdefault(k, why)
            own |= {k for k in plan.stale if states.get(k) != IN_PROGRESS}
        else:  # a descendant also follows what is regenerated upstream of it
            own |= {k for k in chosen if states.get(k) != IN_PROGRESS}
        plan.targets[name] = [k for k in scope if k in own]
        chosen |= own
    return plan


def _failed_checks(
    layout: DataLayout | None, keys: Sequence[dg.AssetKey], scope: Sequence[str]
) -> dict[str, dict[str, str]]:
    """asset -> partition -> "checks failed: ..." for partitions whose recorded (blocking) checks failed: Dagster
    counts them as materialized (the output was written before its checks ran), but nothing downstream uses them."""
    if layout is None:
        return {}

    found: dict[str, dict[str, str]] = {}
    for key in keys:
        name = key.to_user_string()
        for partition in scope:
            lineage = PartitionLineage.load(layout, name, partition)
            if lineage is not None and lineage.checks and not lineage.checks_passed:
                failed = sorted(check for check, passed in lineage.checks.items() if not passed)
                found.setdefault(name, {})[partition] = f"checks failed: {', '.join(failed)}"
    return found


def launch(
    instance: dg.DagsterInstance, plan: BackfillPlan, graph: BaseAssetGraph | None = None, title: str | None = None
) -> str:
    """Store the backfill for the daemon; returns its id (Overview > Backfills > id in the UI)."""
    # lazy: loads dagster (heavy), which only this path needs
    import dagster as dg

    # lazy: loads dagster (heavy), which only this path needs
    from eagle3_assets.operations.dagster_internals import store_asset_backfill

    if plan.empty:
        raise ValueError("nothing to backfill")
    graph = graph or load_asset_graph()
    subsets = {
        dg.AssetKey.from_user_string(name): graph.get(
            dg.AssetKey.from_user_string(name)
        ).partitions_def.subset_with_partition_keys(keys)
        for name, keys in plan.targets.items()
        if keys
    }
    return store_asset_backfill(
        instance,
        subsets,
        tags={LAUNCHED_BY_TAG: "eagle3 backfill --missing"},
        title=title or f"missing {plan.asset} ({len(plan.targets[plan.asset])} partitions)",
        description=plan.describe(),
    )


def backfill_targets(instance: dg.DagsterInstance, backfill_id: str) -> dict[str, list[str]]:
    """Partition keys per asset that a stored backfill targets (what the UI lists for it)."""
    # lazy: loads dagster (heavy), which only this path needs
    from eagle3_assets.operations.dagster_internals import backfill_target_keys

    return backfill_target_keys(instance, backfill_id)


def daemon_running(instance: dg.DagsterInstance, within_s: float = 120.0) -> bool:
    """Whether a dagster-daemon sent a backfill heartbeat recently (else a backfill would just wait)."""
    beats = instance.get_daemon_heartbeats()
    beat = beats.get("BACKFILL")
    return beat is not None and time.time() - beat.timestamp < within_s


def _short(keys: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "") if keys else "none"
