"""Typed, validated settings of one generation run (Dagster-free; the asset wrapper builds one)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from eagle3_assets.core.settings import OUTAGE_BUDGET_S, check_base_urls, redact_url_credentials
from eagle3_assets.core.settings import fail as _fail
from eagle3_assets.net.credentials import display_url, split_credentials

# Request fields the engine sets itself; extra sampling parameters must not override them.
_RESERVED = frozenset(
    {
        "model",
        "messages",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "return_token_ids",
    }
)


REGENERATE_MODES = ("last-turn", "all-turns")


@dataclass(frozen=True)
class GenerationConfig:
    base_urls: tuple[str, ...]
    model: str | None = None  # None: ask GET /v1/models once
    # What the served weights are, when known (a revision or a content hash of the model folder): part of every
    # row's request fingerprint, so other weights under the same served name are answered again.
    model_revision: str | None = None
    api_key: str | None = field(default=None, repr=False)  # never logged, never written
    # clean base URL -> Authorization header value, from credentials that were inside a base URL (filled in by
    # __post_init__, which strips them from base_urls); they win over api_key for that URL. Never logged or written.
    url_auth: Mapping[str, str] = field(default_factory=dict, repr=False)
    # Requests in flight for the whole run when no server reports its load (/metrics); otherwise each server's
    # default target (see server_targets and generation/capacity.py).
    concurrency: int = 128
    per_endpoint_cap: int | None = None  # in flight per base URL; None = concurrency
    # Per server: requests (running + waiting, every client together) to keep it at. One value for every base
    # URL or one per URL, in order; empty = per_endpoint_cap or concurrency. A server without /metrics uses it
    # as its fixed cap.
    server_targets: tuple[int, ...] = ()
    capacity_poll_s: float = 0.25  # how often each server's /metrics is read
    max_tokens: int = 8000
    # None: not sent, so vLLM applies the model's own generation_config defaults
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    extra_sampling: Mapping[str, Any] = field(default_factory=dict)  # e.g. top_k, min_p (vLLM extensions)
    request_timeout_s: float = 1800.0  # whole request (and the read timeout when not streaming)
    connect_timeout_s: float = 10.0
    stream: bool = False
    # Ask vLLM (>= 0.10.2) for the prompt and completion token ids and store them: hidden states are then
    # computed on exactly the tokens the server produced, where re-tokenizing the text differs at a quarter to a
    # third of positions. Servers that do not know the field ignore it (vLLM) or must be told False here.
    return_token_ids: bool = True
    # "aiohttp" (the project's own aiohttp client, ~1 ms CPU per request) or "openai" (stock openai.AsyncOpenAI over
    # the SDK's aiohttp client: same requests and results, more CPU); see generation/transport.py
    transport: str = "aiohttp"
    # streaming: no bytes for this long = retryable failure. Generous: a request queued behind a full batch
    # gets no bytes until it is scheduled.
    idle_timeout_s: float = 300.0
    max_attempts: int = 6
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    bench_after_failures: int = 5  # consecutive retryable failures before an endpoint is benched
    bench_s: float = 30.0  # first bench period; doubles while probes keep failing
    # every endpoint down (benched for outages) this long: the run stops with an error instead of probing on
    outage_budget_s: float = OUTAGE_BUDGET_S
    fsync_interval_s: float = 2.0
    progress_interval_s: float = 5.0
    # "last-turn": the model answers each conversation's last user turn (earlier turns are the dataset's history);
    # "all-turns": it answers every user turn in order, on top of its own earlier answers (generation/turns.py)
    regenerate: str = "last-turn"

    def __post_init__(self) -> None:
        urls = (self.base_urls,) if isinstance(self.base_urls, str) else tuple(self.base_urls)
        clean: list[str] = []
        auth = dict(self.url_auth)
        for url in check_base_urls("base_urls", urls):
            bare, header = split_credentials(url)
            clean.append(bare)
            if header is not None:
                auth[bare] = header
        if len(set(clean)) != len(clean):
            raise _fail("base_urls", [display_url(u) for u in clean], "lists the same server twice")
        object.__setattr__(self, "base_urls", tuple(clean))
        object.__setattr__(self, "url_auth", auth)
        if self.regenerate not in REGENERATE_MODES:
            raise _fail("regenerate", self.regenerate, f"must be one of {', '.join(REGENERATE_MODES)}")
        if self.model is not None and not str(self.model).strip():
            raise _fail("model", self.model, "must be a model name or None (ask /v1/models)")
        for name in ("concurrency", "max_tokens", "max_attempts", "bench_after_failures"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise _fail(name, value, "must be a positive integer")
        targets = (self.server_targets,) if isinstance(self.server_targets, int) else tuple(self.server_targets)
        object.__setattr__(self, "server_targets", targets)
        if any(isinstance(t, bool) or not isinstance(t, int) or t <= 0 for t in targets):
            raise _fail("server_targets", list(targets), "must be positive integers")
        if len(targets) not in (0, 1, len(urls)):
            why = f"needs one value for every server or one per base URL ({len(urls)})"
            raise _fail("server_targets", list(targets), why)
        cap = self.per_endpoint_cap
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
            raise _fail("per_endpoint_cap", cap, "must be a positive integer or None")
        for name in (
            "request_timeout_s",
            "connect_timeout_s",
            "idle_timeout_s",
            "backoff_max_s",
            "bench_s",
            "outage_budget_s",
            "fsync_interval_s",
            "progress_interval_s",
            "capacity_poll_s",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise _fail(name, value, "must be a positive number of seconds")
        if not isinstance(self.backoff_base_s, int | float) or not (0 <= self.backoff_base_s <= self.backoff_max_s):
            why = f"must be between 0 and backoff_max_s={self.backoff_max_s}"
            raise _fail("backoff_base_s", self.backoff_base_s, why)
        if self.temperature is not None and not (0 <= self.temperature <= 100):
            raise _fail("temperature", self.temperature, "must be >= 0")
        if self.top_p is not None and not (0 < self.top_p <= 1):
            raise _fail("top_p", self.top_p, "must be in (0, 1]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise _fail("seed", self.seed, "must be an integer or None")
        if self.transport not in ("openai", "aiohttp"):
            raise _fail("transport", self.transport, "must be 'openai' or 'aiohttp'")
        clash = _RESERVED & set(self.extra_sampling)
        if clash:
            raise _fail("extra_sampling", sorted(clash), "sets fields the engine owns; use the dedicated settings")
        object.__setattr__(self, "extra_sampling", dict(self.extra_sampling))

    @property
    def endpoint_cap(self) -> int:
        """The most requests one base URL may ever have in flight (sizes each connection pool)."""
        return max((self.per_endpoint_cap or self.concurrency, *self.server_targets))

    def server_target(self, url: str) -> int:
        """The target of one server: its configured value, else per_endpoint_cap or concurrency."""
        if not self.server_targets:
            return self.per_endpoint_cap or self.concurrency
        if len(self.server_targets) == 1:
            return self.server_targets[0]
        return self.server_targets[self.base_urls.index(url.strip().rstrip("/"))]

    def sampling_params(self) -> dict[str, Any]:
        """The sampling parameters sent with every request (stored with each row as JSON)."""
        params: dict[str, Any] = {"max_tokens": self.max_tokens}
        if self.temperature is not None:
            params["temperature"] = self.temperature
        if self.top_p is not None:
            params["top_p"] = self.top_p
        if self.seed is not None:
            params["seed"] = self.seed
        params.update(self.extra_sampling)
        return params

    def request_fields(self) -> dict[str, Any]:
        """Everything of the request body besides model, messages and the stream flags."""
        fields = self.sampling_params()
        if self.return_token_ids:
            fields["return_token_ids"] = True
        return fields

    def authorization(self, url: str) -> str | None:
        """The Authorization header value for one base URL: its own credentials, else the API key as a bearer."""
        if url in self.url_auth:
            return self.url_auth[url]
        return f"Bearer {self.api_key}" if self.api_key else None

    def redact(self, text: str) -> str:
        """Replace the API key in any text that may reach a log line, an error or a file.

        Texts may arrive already cut to a length (an error message): a key cut at the end leaves a prefix that a
        plain replace misses, so a trailing prefix of the key (8+ characters) is replaced too.
        """
        text = redact_url_credentials(text)
        for header in self.url_auth.values():
            text = text.replace(header.split(" ", 1)[-1], "***")
        key = self.api_key
        if not key:
            return text
        text = text.replace(key, "***")
        for size in range(min(len(key) - 1, len(text)), 7, -1):
            if text.endswith(key[:size]):
                return text[:-size] + "***"
        return text
