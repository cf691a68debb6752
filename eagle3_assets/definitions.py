"""The Dagster code location: ``dagster dev -w workspace.yaml`` loads ``defs`` from here.

Every module of the ``defs/`` folder is loaded the way Dagster's project layout does it, so a new asset file needs no
second edit: the component tree of ``eagle3_assets.defs`` (what ``dg.load_from_defs_folder`` builds once it has read
``[tool.dg]`` from pyproject.toml), built from the module itself, because an installed wheel has no pyproject.toml
beside it (``load_from_defs_folder`` fails there: a deployment's image or a ``pip install .``). ``[tool.dg]`` stays for
the ``dg`` CLI in a checkout. This module adds what is the code location's own: the resources, the opt-in automation
and the executor.

Nothing heavy is imported at load (no torch, transformers or speculators): the assets import them
inside their bodies, so the UI and the daemon load the code in a couple of seconds.
"""

from __future__ import annotations

import warnings

import dagster as dg

import eagle3_assets.defs
from eagle3_assets.core.settings import PACKAGE_DIR
from eagle3_assets.defs.automation import with_automation
from eagle3_assets.defs.registry import default_resources
from eagle3_assets.environment import code_location_settings


def _unique(items: object) -> list:  # type: ignore[type-arg]
    # a defs module that imports another's asset (to depend on it) makes the loader see that object twice
    return list({id(item): item for item in (items or [])}.values())  # type: ignore[attr-defined]


def build_definitions(resources: dict[str, object] | None = None) -> dg.Definitions:
    with warnings.catch_warnings():
        # as load_from_defs_folder does: the loader calls preview functions of its own
        warnings.simplefilter("ignore", dg.PreviewWarning)
        tree = dg.ComponentTree.from_module(defs_module=eagle3_assets.defs, project_root=PACKAGE_DIR.parent)
        found = tree.build_defs()
    assets, sensors = with_automation(_unique(found.assets), code_location_settings())
    return dg.Definitions(
        assets=assets,
        asset_checks=_unique(found.asset_checks),
        sensors=[*_unique(found.sensors), *sensors],
        jobs=_unique(found.jobs),
        schedules=_unique(found.schedules),
        resources=resources if resources is not None else default_resources(),
        # One partition is one process: the steps of a partition run share it instead of paying a
        # subprocess start each (see benchmarks/partition_overhead.py).
        executor=dg.in_process_executor,
    )


defs = build_definitions()
