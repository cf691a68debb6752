"""The Dagster code location: ``dagster dev -w workspace.yaml`` loads ``defs`` from here.

Nothing heavy is imported at load (no torch, transformers or speculators): the assets import them
inside their bodies, so the UI and the daemon load the code in a couple of seconds.
"""

from __future__ import annotations

import dagster as dg

from eagle3_assets.defs import ablation, draft, evaluation, hidden_states, prompts, responses
from eagle3_assets.defs.automation import code_location_settings, with_automation
from eagle3_assets.defs.registry import default_resources


def build_definitions(resources: dict[str, object] | None = None) -> dg.Definitions:
    modules = [prompts, responses, hidden_states, draft, evaluation, ablation]  # ablation: opt-in, see its module
    assets, sensors = with_automation(dg.load_assets_from_modules(modules), code_location_settings())
    return dg.Definitions(
        assets=assets,
        asset_checks=dg.load_asset_checks_from_modules(modules),
        sensors=sensors,
        resources=resources if resources is not None else default_resources(),
        # One partition is one process: the steps of a partition run share it instead of paying a
        # subprocess start each (see benchmarks/partition_overhead.py).
        executor=dg.in_process_executor,
    )


defs = build_definitions()
