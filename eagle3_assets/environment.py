"""Every ``EAGLE3_*`` setting the project declares, Dagster-free: the settings models in the README table's order,
one setting's effective value from the environment, and the configuration table (``eagle3 config --markdown``).

The CLI, the demo and the benchmarks read settings here, so none of them imports the Dagster layer to read an
environment variable; ``defs/registry.py`` builds the Dagster resources on the same models. The code location's own
settings (automation, read when the definitions load) are declared here because no stage uses them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from eagle3_assets.core import settings
from eagle3_assets.core.data_settings import DataStoreSettings
from eagle3_assets.core.settings import API_KEY_TABLE_ROW, SettingsModel, setting
from eagle3_assets.evaluation.evaluation_settings import EvaluationServersSettings
from eagle3_assets.generation.inference_settings import RemoteVLLMSettings
from eagle3_assets.local.verifier_settings import VerifierSettings
from eagle3_assets.prompts.dataset_settings import PromptDatasetSettings

logger = logging.getLogger(__name__)


class CodeLocationSettings(SettingsModel):
    """Settings that shape the definitions themselves, so they are read when the code location loads."""

    automation: bool = setting(False, env="EAGLE3_AUTOMATION")
    """Declarative automation: `hidden_states` materializes a partition by itself once its `synthetic_responses`
    partition lands and its blocking checks pass (the daemon of `make dev` runs it). Read when the code location
    loads."""
    automation_interval_s: int = setting(30, env="EAGLE3_AUTOMATION_INTERVAL_S", ge=5)
    """Seconds between two evaluations of the automation conditions. Read when the code location loads."""


def code_location_settings(environ: Mapping[str, str] | None = None) -> CodeLocationSettings:
    """The environment's valid values; a bad one is logged (naming the key) and left at its default."""
    values, errors = settings.from_environ(CodeLocationSettings, environ)
    for error in errors:
        logger.warning("%s; using the default", error)
    return CodeLocationSettings(**values)


def settings_classes() -> list[type[SettingsModel]]:
    """Every model that declares ``EAGLE3_*`` settings, in the order of the README table: the resources' (data
    store, prompt dataset, inference server, verifier, evaluation servers), then the code location's own."""
    return [
        DataStoreSettings,
        PromptDatasetSettings,
        RemoteVLLMSettings,
        VerifierSettings,
        EvaluationServersSettings,
        CodeLocationSettings,
    ]


def env_value(key: str, environ: Mapping[str, str] | None = None) -> Any:
    """The effective, validated value of one ``EAGLE3_*`` setting (raises ``ConfigError`` naming a bad one)."""
    return settings.effective_value(settings_classes(), key, environ)


def settings_markdown() -> str:
    """The README's configuration table (``eagle3 config --markdown``)."""
    table = settings.markdown_table(settings_classes()).splitlines()
    # after the first inference-server setting (the served model), where a field would stand
    at = next((i for i, line in enumerate(table) if f"`{RemoteVLLMSettings.__name__}." in line), len(table))
    return "\n".join([*table[: at + 1], API_KEY_TABLE_ROW, *table[at + 1 :]])
