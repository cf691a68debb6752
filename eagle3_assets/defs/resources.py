"""Dagster resources: the data store, the prompt dataset and the verifier, as Dagster sees them.

Each resource inherits its Dagster-free settings model (``core.data_settings``, ``prompts.dataset_settings``,
``local.verifier_settings``, ``evaluation.evaluation_settings``), where every field is declared once; this layer adds
only Dagster's lifecycle. When the definitions load, the valid environment values become the resources' values (the
launchpad shows them and can override them per run). A bad value never stops the code location from loading: it is
left out, and the run that uses the resource fails when it starts, with the message naming the variable
(``SettingsResource``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import dagster as dg
from pydantic import ValidationInfo, field_validator

from eagle3_assets.core import settings
from eagle3_assets.core.data_settings import DataStoreSettings
from eagle3_assets.core.settings import SettingsModel
from eagle3_assets.evaluation.evaluation_settings import EvaluationServersSettings
from eagle3_assets.local.verifier_settings import VerifierSettings
from eagle3_assets.prompts.dataset_settings import PromptDatasetSettings


class SettingsResource(dg.ConfigurableResource, SettingsModel):
    """A resource whose fields are declared settings: bad values name their key, env values checked at launch."""

    @field_validator("*", mode="wrap")
    @classmethod
    def _name_the_key(cls, value: Any, handler: Any, info: ValidationInfo) -> Any:
        if isinstance(value, dg.EnvVar):
            # bound by name (``for_definitions``): Dagster resolves it when a run starts and builds the resource
            # again from the value, which is checked then
            return value
        return settings.validate_field(cls, value, handler, str(info.field_name))

    @classmethod
    def for_definitions(cls, environ: Mapping[str, str] | None = None) -> Any:
        """The resource for the code location: as ``from_env``, but a value holding a URL's ``user:password@`` is
        bound by its variable's name (``dg.EnvVar``), never by value. Dagster stores a resource's configured values
        in every run's job snapshot and shows them in the UI; for an ``EnvVar`` it stores and shows only the name,
        and the run reads the process environment when it starts."""
        env = os.environ if environ is None else environ
        values, _errors = settings.from_environ(cls, env)
        for field in settings.declared(cls):
            if field.name in values and field.env and settings.has_url_credentials(env[field.env]):
                values[field.name] = dg.EnvVar(field.env)
        return cls(**values)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        settings.check_environ(type(self))


class SettingsConfig(dg.Config, SettingsModel):
    """An asset's run config whose fields are declared settings (same error shape as the resources)."""


class DataStoreResource(SettingsResource, DataStoreSettings):
    """Where every asset's files live (``DataStoreSettings``); checked writable when a run starts."""

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        super().setup_for_execution(context)
        self.check_usable()


class PromptDatasetResource(SettingsResource, PromptDatasetSettings):
    """The prompt dataset and how it is cut into partitions (``PromptDatasetSettings``); the file must exist when a
    run starts."""

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        super().setup_for_execution(context)
        self.dataset_file()


class VerifierResource(SettingsResource, VerifierSettings):
    """The verifier model (``VerifierSettings``); its folder must hold a config when a run starts."""

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        super().setup_for_execution(context)
        self.resolved_path()


class EvaluationServersResource(SettingsResource, EvaluationServersSettings):
    """draft_evaluation's running servers and prompt sets (``EvaluationServersSettings``)."""
