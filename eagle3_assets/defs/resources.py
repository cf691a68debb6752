"""Dagster resources: typed configuration for the data store, the prompt dataset and the verifier.

Defaults come from ``EAGLE3_*`` environment variables when the definitions load (see ``settings.py``)
and every field can be overridden per run in the launchpad. Values are validated when a run starts, so
a wrong value fails that run with a message naming the key, before any expensive work.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from eagle3_assets import settings
from eagle3_assets.settings import ConfigError
from eagle3_assets.storage import DataLayout


class DataStoreResource(dg.ConfigurableResource):
    """Where every asset's files live (``EAGLE3_DATA_DIR``). One folder per asset, one file per partition."""

    data_dir: str = "./data"

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        if not str(self.data_dir).strip():
            raise ConfigError("EAGLE3_DATA_DIR='': must be a directory path")
        root = Path(self.data_dir).expanduser()
        if root.exists() and not root.is_dir():
            raise ConfigError(f"EAGLE3_DATA_DIR={self.data_dir!r}: exists and is not a directory")

    @property
    def layout(self) -> DataLayout:
        return DataLayout.at(self.data_dir)


class PromptDatasetResource(dg.ConfigurableResource):
    """The prompt dataset and how it is cut into partitions."""

    path: str = str(settings.SAMPLE_PROMPTS_PATH)
    partition_size: int = 1000
    max_reject_share: float = 0.05

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        settings.parse_positive_int("EAGLE3_PARTITION_SIZE", self.partition_size)
        settings.parse_fraction("EAGLE3_MAX_REJECT_SHARE", self.max_reject_share)
        if not Path(self.path).expanduser().is_file():
            raise ConfigError(f"EAGLE3_PROMPTS_PATH={self.path!r}: no such file")


class VerifierResource(dg.ConfigurableResource):
    """The verifier (target) model as a local Hugging Face folder, for hidden states and training."""

    path: str = ""
    device: str = "auto"  # "auto" picks CUDA when present, else CPU
    # Aux layers whose hidden states EAGLE-3 trains on; empty: [2, N//2, N-3], checked against the model
    layer_ids: str = ""

    # How its hidden states are computed and where it trains (EAGLE3_HIDDEN_STATES_*, EAGLE3_TRAIN_PROCS)
    hidden_states_backend: str = "hf"
    hidden_states_url: str = ""  # comma-separated extraction servers; empty with "vllm": the embedded CPU vLLM
    hidden_states_storage: str = ""  # local mount of the servers' shared_storage_path; empty: the server's path
    train_procs: int = 1

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self.resolved_path()
        self.layer_id_list()
        settings.parse_device("EAGLE3_DEVICE", self.device)
        settings.parse_hidden_states_backend("EAGLE3_HIDDEN_STATES_BACKEND", self.hidden_states_backend)
        self.hidden_states_urls()
        settings.parse_positive_int("EAGLE3_TRAIN_PROCS", self.train_procs)

    def hidden_states_urls(self) -> list[str]:
        return settings.parse_optional_base_urls("EAGLE3_HIDDEN_STATES_URL", self.hidden_states_url)

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


def default_resources() -> dict[str, object]:
    """Resources with defaults taken from the environment at definition load."""
    from eagle3_assets.defs.inference import inference_resource_from_env

    env = settings.read_env
    return {
        "data_store": DataStoreResource(data_dir=env("EAGLE3_DATA_DIR")),
        "prompt_dataset": PromptDatasetResource(
            path=env("EAGLE3_PROMPTS_PATH"),
            partition_size=env("EAGLE3_PARTITION_SIZE"),
            max_reject_share=env("EAGLE3_MAX_REJECT_SHARE"),
        ),
        "verifier": VerifierResource(
            path=env("EAGLE3_VERIFIER_PATH") or "",
            layer_ids=",".join(map(str, env("EAGLE3_LAYER_IDS") or [])),
            device=env("EAGLE3_DEVICE"),
            hidden_states_backend=env("EAGLE3_HIDDEN_STATES_BACKEND"),
            hidden_states_url=",".join(env("EAGLE3_HIDDEN_STATES_URL")),
            hidden_states_storage=env("EAGLE3_HIDDEN_STATES_STORAGE") or "",
            train_procs=env("EAGLE3_TRAIN_PROCS"),
        ),
        "inference_server": inference_resource_from_env(),
    }
