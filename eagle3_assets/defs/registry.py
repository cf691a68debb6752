"""The registry of settings: every class that declares ``EAGLE3_*`` settings, the environment's values for them,
and the README's configuration table (``eagle3 config --markdown``).

Apart from the classes (``resources.py``, ``inference.py``, ``automation.py``) so that they import their base
classes and this module imports them, one way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from eagle3_assets.core import settings
from eagle3_assets.defs.automation import CodeLocationSettings
from eagle3_assets.defs.inference import RemoteVLLMResource
from eagle3_assets.defs.resources import (
    API_KEY_TABLE_ROW,
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


def settings_classes() -> list[type]:
    """Every class that declares ``EAGLE3_*`` settings: the resources, then the code location's own."""
    return [*settings_resources().values(), CodeLocationSettings]


def default_resources(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """Resources with the environment's valid values; never raises for a bad value (the run reports it). A URL
    holding a password is bound by its variable's name (``SettingsResource.for_definitions``): Dagster never
    stores or shows it."""
    return {key: cls.for_definitions(environ) for key, cls in settings_resources().items()}


def env_value(key: str, environ: Mapping[str, str] | None = None) -> Any:
    """The effective, validated value of one ``EAGLE3_*`` setting (raises ``ConfigError`` naming a bad one)."""
    return settings.effective_value(settings_classes(), key, environ)


def settings_markdown() -> str:
    """The README's configuration table (``eagle3 config --markdown``)."""
    table = settings.markdown_table(settings_classes()).splitlines()
    # after the first inference-server setting (the served model), where a field would stand
    at = next((i for i, line in enumerate(table) if "`RemoteVLLMResource." in line), len(table))
    return "\n".join([*table[: at + 1], API_KEY_TABLE_ROW, *table[at + 1 :]])
