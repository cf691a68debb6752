"""Opt-in declarative automation: partitions flow down the graph by themselves (``EAGLE3_AUTOMATION=true``).

With it on, ``hidden_states`` carries an ``AutomationCondition``: a partition is materialized once its
``synthetic_responses`` partition has landed (newly updated, nothing upstream missing or in progress) and the
upstream's blocking checks passed. A sensor of its own evaluates the condition (the UI's Automation page
lists it, running); it needs the daemon (``make dev`` runs one). Off by default: generation is expensive, and
whoever operates the pipeline decides when hidden states are computed. ``vocab_mapping`` and ``draft_model``
stay manual: they read every partition, and retraining after each new partition is rarely wanted.

The setting is read when the definitions load (Dagster fixes automation conditions at load): a bad value
leaves automation off and logs a warning naming the key; the code location still loads.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import dagster as dg

from eagle3_assets.environment import CodeLocationSettings

logger = logging.getLogger(__name__)

AUTOMATED_ASSETS = ("hidden_states",)
SENSOR_NAME = "eagle3_automation"


def automation_condition() -> dg.AutomationCondition:
    """Eager on the upstream partition, gated on the upstream's blocking checks.

    Dagster 1.13 keeps one result per check, not one per partition, so the gate is the latest result of the
    upstream's blocking checks: after a partition fails one, nothing flows until a partition passes it again.

    ``eager()`` alone only reacts to changes *between* two evaluations: on the sensor's first evaluation (a fresh
    DAGSTER_HOME, automation just turned on, or this condition changed, which resets its cursor) its
    ``newly_missing``/``any_deps_updated`` triggers are empty by design, so an upstream partition that landed
    before that first tick would never be picked up (the daemon needs seconds to load the code location, so
    this is the common case, not a corner one). The ``initial_evaluation`` branch catches those: on that first
    tick, every missing partition whose upstream is present (and not in progress) is requested once; after it,
    ``newly_requested`` marks them handled for ``eager``.
    """
    condition = dg.AutomationCondition
    landed_before_first_tick = (
        condition.initial_evaluation()
        & condition.missing()
        & ~condition.any_deps_missing()
        & ~condition.any_deps_in_progress()
        & ~condition.in_progress()
    ).with_label("missing on the first evaluation, upstream present")
    return ((condition.eager() | landed_before_first_tick) & condition.all_deps_blocking_checks_passed()).with_label(
        "eager once the upstream partition lands and its blocking checks pass"
    )


def with_automation(
    assets: Sequence[Any], config: CodeLocationSettings
) -> tuple[list[Any], list[dg.AutomationConditionSensorDefinition]]:
    """The assets, with the condition on ``AUTOMATED_ASSETS`` when automation is on, and the sensor for them."""
    if not config.automation:
        return list(assets), []
    condition = automation_condition()

    def attach(spec: dg.AssetSpec) -> dg.AssetSpec:
        if spec.key.to_user_string() in AUTOMATED_ASSETS:
            return spec.replace_attributes(automation_condition=condition)
        return spec

    sensor = dg.AutomationConditionSensorDefinition(
        SENSOR_NAME,
        target=dg.AssetSelection.assets(*AUTOMATED_ASSETS),
        default_status=dg.DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=config.automation_interval_s,
        description="Materializes hidden_states partitions once their synthetic_responses partitions land.",
    )
    return list(dg.map_asset_specs(attach, list(assets))), [sensor]
