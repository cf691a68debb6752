"""The verifier's settings: its local folder, where and in which precision the hf backend and training run, the
layers EAGLE-3 reads, how hidden states are extracted, and the reasoning parser of every local server started on it.

Here, beside the local servers and verifiers, because generation's local server, hidden states, training and
evaluation all read them.
"""

from __future__ import annotations

from pathlib import Path

from eagle3_assets.core import settings
from eagle3_assets.core.precision import AUTO, PRECISIONS
from eagle3_assets.core.settings import ConfigError, SettingsModel, setting
from eagle3_assets.local import reasoning
from eagle3_assets.local.reasoning import check_reasoning_parser


class VerifierSettings(SettingsModel):
    """The verifier (target) model as a local Hugging Face folder, for hidden states and training."""

    path: str = setting("", env="EAGLE3_VERIFIER_PATH")
    """Local Hugging Face model folder of the verifier (hidden states, training). Empty: the demo's tiny model."""
    device: str = setting(AUTO, env="EAGLE3_DEVICE", check=settings.check_device)
    """Where the hf backend and training run: `auto` is every visible GPU, else the CPU."""
    precision: str = setting(AUTO, env="EAGLE3_PRECISION", check=settings.one_of(*PRECISIONS))
    """Compute precision of the hf backend and training: `auto` is bfloat16 on GPUs, float32 on the CPU (as the CPU vLLM
    serves); `bfloat16` on a CPU with AVX512-BF16/AMX is ~2.6x faster (demo --real picks it)."""
    layer_ids: str = setting("", env="EAGLE3_LAYER_IDS", check=settings.parse_layer_ids)
    """Verifier layers for EAGLE-3's auxiliary hidden states, e.g. `1,2,3`; empty: `[2, N//2, N-3]`."""
    hidden_states_backend: str = setting("hf", env="EAGLE3_HIDDEN_STATES_BACKEND", check=settings.one_of("hf", "vllm"))
    """`hf` (transformers in the Dagster process) or `vllm` (vLLM extraction servers)."""
    hidden_states_url: str = setting("", env="EAGLE3_HIDDEN_STATES_URL", check=settings.check_optional_base_urls)
    """`vllm` backend: extraction server base URL(s); empty: start the embedded CPU vLLM."""
    hidden_states_storage: str = setting("", env="EAGLE3_HIDDEN_STATES_STORAGE")
    """`vllm` backend: local mount of the servers' `shared_storage_path`; empty: the server's path."""
    hidden_states_outage_budget_s: float = setting(
        settings.OUTAGE_BUDGET_S, env="EAGLE3_HIDDEN_STATES_OUTAGE_BUDGET_S", gt=0
    )
    """`vllm` backend: seconds every extraction server may stay down (refused, reset, timed out, 5xx) before the run
    stops with an error; stored samples are kept."""
    train_procs: int = setting(1, env="EAGLE3_TRAIN_PROCS", gt=0)
    """draft_model training processes (torchrun ranks)."""
    reasoning_parser: str = setting(reasoning.AUTO, env="EAGLE3_REASONING_PARSER", check=check_reasoning_parser)
    """vLLM `--reasoning-parser` of every local server started on the verifier (generation, evaluation, demo): `auto` is
    `deepseek_r1` when its tokenizer has `<think>` and `</think>`, else none; `none`; or a parser."""

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
