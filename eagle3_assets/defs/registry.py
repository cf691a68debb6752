"""The Dagster resources built from the environment, by resource key (the definitions bind them).

Their settings, the environment's values and the configuration table are Dagster-free, in
``eagle3_assets.environment``; this module only maps resource keys to the Dagster classes that inherit those models.
"""

from __future__ import annotations

from collections.abc import Mapping

from eagle3_assets.defs.inference import RemoteVLLMResource
from eagle3_assets.defs.resources import (
    DataStoreResource,
    EvaluationServersResource,
    PromptDatasetResource,
    SettingsResource,
    VerifierResource,
)


def settings_resources() -> dict[str, type[SettingsResource]]:
    """Resource key -> class, for every resource built from the environment (the order of the README table)."""
    return {
        "data_store": DataStoreResource,
        "prompt_dataset": PromptDatasetResource,
        "inference_server": RemoteVLLMResource,
        "verifier": VerifierResource,
        "evaluation_servers": EvaluationServersResource,
    }


def default_resources(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """Resources with the environment's valid values; never raises for a bad value (the run reports it). A URL
    holding a password is bound by its variable's name (``SettingsResource.for_definitions``): Dagster never
    stores or shows it."""
    return {key: cls.for_definitions(environ) for key, cls in settings_resources().items()}
