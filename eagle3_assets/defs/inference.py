"""The inference server resource: where generation requests go and with which sampling settings.

``InferenceServerResource`` is the abstract base; ``RemoteVLLMResource`` talks to running vLLM
deployment(s), ``LocalVLLMResource`` starts the embedded CPU vLLM on the tiny verifier for the run.
The API key is never a config field (Dagster would show and store config): it is read from the
environment variable named by ``api_key_env`` when a run starts.
"""

from __future__ import annotations

import os
from abc import abstractmethod
from typing import TYPE_CHECKING, Any

import dagster as dg
from pydantic import PrivateAttr

from eagle3_assets import settings

if TYPE_CHECKING:
    from eagle3_assets.generation import GenerationConfig


class InferenceServerResource(dg.ConfigurableResource):
    """Common generation settings; subclasses say which server(s) answer."""

    model: str = ""  # served model name; empty: ask GET /v1/models
    api_key_env: str = "EAGLE3_API_KEY"
    concurrency: int = 128
    max_tokens: int = 8000
    request_timeout_s: float = 1800.0
    stream: bool = False
    idle_timeout_s: float = 300.0  # streaming only: no token for this long is a (retryable) failure
    max_attempts: int = 6
    temperature: float = 0.6
    top_p: float = 0.95
    seed: int | None = None
    extra_body_json: str = ""  # extra request fields for vLLM, e.g. '{"ignore_eos": true}'
    # "aiohttp" (the default: the project's own aiohttp client) or "openai" (stock openai.AsyncOpenAI: same
    # requests and results, more client CPU; see benchmarks/generation_efficiency.py)
    transport: str = "aiohttp"
    # store vLLM's prompt/completion token ids so hidden states use the served tokens (vLLM >= 0.10.2)
    return_token_ids: bool = True

    @abstractmethod
    def base_urls(self) -> list[str]:
        """The OpenAI-compatible base URL(s) to send requests to during this run."""

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) or None

    def validate_settings(self) -> None:
        settings.parse_positive_int("EAGLE3_CONCURRENCY", self.concurrency)
        settings.parse_positive_int("EAGLE3_MAX_TOKENS", self.max_tokens)
        settings.parse_positive_float("EAGLE3_REQUEST_TIMEOUT_S", self.request_timeout_s)
        settings.parse_positive_float("idle_timeout_s", self.idle_timeout_s)
        settings.parse_positive_int("max_attempts", self.max_attempts)
        if self.transport not in ("openai", "aiohttp"):
            raise settings.ConfigError(f"EAGLE3_TRANSPORT={self.transport!r}: must be 'aiohttp' or 'openai'")
        if self.extra_body_json.strip():
            import json

            try:
                body = json.loads(self.extra_body_json)
            except ValueError as error:
                raise settings.ConfigError(
                    f"extra_body_json={self.extra_body_json!r}: invalid JSON ({error})"
                ) from None
            if not isinstance(body, dict):
                raise settings.ConfigError(f"extra_body_json={self.extra_body_json!r}: must be a JSON object")

    def extra_body(self) -> dict[str, Any]:
        import json

        return json.loads(self.extra_body_json) if self.extra_body_json.strip() else {}

    def generation_config(self) -> GenerationConfig:
        from eagle3_assets.generation import GenerationConfig

        return GenerationConfig(
            base_urls=tuple(self.base_urls()),
            model=self.model or None,
            api_key=self.api_key(),
            concurrency=self.concurrency,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            extra_sampling=self.extra_body(),
            request_timeout_s=self.request_timeout_s,
            stream=self.stream,
            transport=self.transport,
            return_token_ids=self.return_token_ids,
            idle_timeout_s=self.idle_timeout_s,
            max_attempts=self.max_attempts,
        )


class RemoteVLLMResource(InferenceServerResource):
    """Running vLLM server(s): ``base_url`` is one URL or a comma-separated list (EAGLE3_VLLM_BASE_URL)."""

    base_url: str = "http://127.0.0.1:8000/v1"

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self.validate_settings()
        settings.parse_base_urls("EAGLE3_VLLM_BASE_URL", self.base_url)

    def base_urls(self) -> list[str]:
        return settings.parse_base_urls("EAGLE3_VLLM_BASE_URL", self.base_url)


class LocalVLLMResource(InferenceServerResource):
    """The embedded default: a CPU vLLM serving a local model folder, started for the run if not running."""

    model_path: str = ""
    port: int = 8000
    log_dir: str = ""
    startup_timeout_s: float = 600.0
    _server: Any = PrivateAttr(default=None)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self.validate_settings()
        from eagle3_assets.local.vllm_server import LocalVLLMServer

        if not self.model_path:
            raise settings.ConfigError("model_path='': LocalVLLMResource needs the model folder to serve")
        self._server = LocalVLLMServer(
            model_dir=self.model_path,
            port=self.port,
            served_model_name=self.model or None,
            log_dir=self.log_dir or None,
            startup_timeout_s=self.startup_timeout_s,
            reuse_running=True,
        )
        self._server.start()

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._server is not None:
            self._server.stop()

    def base_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.port}/v1"]


def inference_resource_from_env() -> InferenceServerResource:
    """The remote resource with the environment's values (a bad value raises ConfigError naming it)."""
    env = settings.read_env
    return RemoteVLLMResource(
        base_url=",".join(env("EAGLE3_VLLM_BASE_URL")),
        model=env("EAGLE3_MODEL") or "",
        concurrency=env("EAGLE3_CONCURRENCY"),
        max_tokens=env("EAGLE3_MAX_TOKENS"),
        request_timeout_s=env("EAGLE3_REQUEST_TIMEOUT_S"),
        stream=env("EAGLE3_STREAM"),
        temperature=env("EAGLE3_TEMPERATURE"),
        extra_body_json=env("EAGLE3_EXTRA_BODY"),
        transport=env("EAGLE3_TRANSPORT"),
        return_token_ids=env("EAGLE3_RETURN_TOKEN_IDS"),
    )
