"""The inference server's settings: where generation requests go and with which sampling settings.

``InferenceServerSettings`` is the abstract base (``base_urls`` says where this run's requests go);
``RemoteVLLMSettings`` names running vLLM deployment(s). The API key is never a field (Dagster would show and store
config), and neither is the name of the variable it comes from (a launchpad user could otherwise send any environment
variable of the run's process as a bearer token): it is read from ``EAGLE3_API_KEY`` (``settings.API_KEY_ENV``) when
a run starts, by generation and by ``draft_evaluation`` alike.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

from eagle3_assets.core import settings
from eagle3_assets.core.settings import SettingsModel, setting
from eagle3_assets.generation.generation_config import GenerationConfig


class InferenceServerSettings(SettingsModel):
    """Common generation settings; subclasses say which server(s) answer."""

    model: str = setting("", env="EAGLE3_MODEL")
    """Served model name; empty: ask `/v1/models`."""
    concurrency: int = setting(GenerationConfig.concurrency, env="EAGLE3_CONCURRENCY", gt=0)
    """Requests in flight per partition run; for a server that reports its load (`/metrics`), the default
    `EAGLE3_SERVER_TARGET`."""
    server_target: str = setting("", env="EAGLE3_SERVER_TARGET", check=settings.check_server_targets)
    """Requests (running + waiting, every client together) to keep each server at, read from its `/metrics`: one number,
    or one per base URL; empty: `EAGLE3_CONCURRENCY`. Set it to the server's `--max-num-seqs`."""
    max_tokens: int = setting(GenerationConfig.max_tokens, env="EAGLE3_MAX_TOKENS", gt=0)
    """max_tokens per completion."""
    request_timeout_s: float = setting(GenerationConfig.request_timeout_s, env="EAGLE3_REQUEST_TIMEOUT_S", gt=0)
    """Read timeout per request, seconds."""
    stream: bool = setting(GenerationConfig.stream, env="EAGLE3_STREAM")
    """Stream responses (idle timeout instead of one long read)."""
    idle_timeout_s: float = setting(GenerationConfig.idle_timeout_s, gt=0)
    """Streaming only: no token for this long is a (retryable) failure, seconds."""
    max_attempts: int = setting(GenerationConfig.max_attempts, gt=0)
    """Attempts per request before the sample is recorded failed."""
    outage_budget_s: float = setting(GenerationConfig.outage_budget_s, env="EAGLE3_OUTAGE_BUDGET_S", gt=0)
    """Seconds every server may stay down (refused, reset, timed out, 5xx) before a generation run stops with an error;
    finished rows are kept."""
    temperature: float | None = setting(GenerationConfig.temperature, env="EAGLE3_TEMPERATURE", ge=0.0)
    """Sampling temperature; empty: not sent, the server applies the model's generation_config."""
    top_p: float | None = setting(GenerationConfig.top_p, gt=0.0, le=1.0)
    """Top-p; empty: the model's default."""
    seed: int | None = setting(GenerationConfig.seed)
    """Sampling seed per request; empty: none. Refused for the embedded CPU build of vLLM (0.32): its engine dies on a
    seeded request whose prompt it prefills in chunks."""
    extra_body_json: str = setting("", env="EAGLE3_EXTRA_BODY", check=settings.check_json_object)
    """Extra JSON fields for each request, e.g. `{"ignore_eos": true}`."""
    # see benchmarks/generation_efficiency.py for the client CPU of each
    transport: str = setting(
        GenerationConfig.transport, env="EAGLE3_TRANSPORT", check=settings.one_of("openai", "aiohttp")
    )
    """HTTP client: `aiohttp` (the project's own, ~1 ms client CPU per request) or `openai` (stock `AsyncOpenAI` over
    the SDK's aiohttp client: same requests and results, more CPU)."""
    return_token_ids: bool = setting(GenerationConfig.return_token_ids, env="EAGLE3_RETURN_TOKEN_IDS")
    """Ask vLLM for prompt/completion token ids and train on exactly those (false for servers without them)."""
    regenerate: str = setting(
        GenerationConfig.regenerate, env="EAGLE3_REGENERATE", check=settings.one_of("last-turn", "all-turns")
    )
    """Which assistant turns the model writes: `last-turn` (it answers the last user turn; earlier turns stay the
    dataset's) or `all-turns` (it answers every user turn in order on top of its own earlier answers; n user turns
    cost n requests, each re-sending the history)."""

    @abstractmethod
    def base_urls(self) -> list[str]:
        """The OpenAI-compatible base URL(s) to send requests to during this run."""

    def api_key(self) -> str | None:
        return settings.read_api_key()

    def extra_body(self) -> dict[str, Any]:
        return settings.check_json_object("EAGLE3_EXTRA_BODY", self.extra_body_json)

    def generation_config(self) -> GenerationConfig:
        """The core's GenerationConfig from these settings (same-named fields by name; the rest converted here)."""
        return settings.core_config(
            GenerationConfig,
            self,
            base_urls=tuple(self.base_urls()),
            model=self.model or None,
            api_key=self.api_key(),
            server_targets=settings.check_server_targets("EAGLE3_SERVER_TARGET", self.server_target),
            extra_sampling=self.extra_body(),
        )


class RemoteVLLMSettings(InferenceServerSettings):
    """Running vLLM server(s): ``base_url`` is one URL or a comma-separated list (EAGLE3_VLLM_BASE_URL)."""

    base_url: str = setting("http://127.0.0.1:8000/v1", env="EAGLE3_VLLM_BASE_URL", check=settings.check_base_urls)
    """OpenAI-compatible base URL(s) of the vLLM server(s); comma-separated for several."""

    def base_urls(self) -> list[str]:
        return settings.check_base_urls("EAGLE3_VLLM_BASE_URL", self.base_url)
