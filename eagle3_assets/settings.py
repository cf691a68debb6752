"""Typed settings read from ``EAGLE3_*`` environment variables, validated with errors that name the key.

This is the one place that knows the environment variables, their types and defaults. Dagster resources
(``eagle3_assets.defs.resources``) take their defaults from here, so the UI launchpad shows the values the
environment chose and can override them per run. Everything else receives typed values.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

PACKAGE_DIR = Path(__file__).resolve().parent
SAMPLE_PROMPTS_PATH = PACKAGE_DIR / "data" / "sample_prompts.jsonl"


class ConfigError(ValueError):
    """A configuration value is wrong. The message names the key and the offending value."""


def _fail(key: str, value: object, why: str) -> ConfigError:
    return ConfigError(f"{key}={value!r}: {why}")


def parse_positive_int(key: str, value: object) -> int:
    try:
        number = int(str(value).strip())
    except (TypeError, ValueError):
        raise _fail(key, value, "must be a positive integer") from None
    if number <= 0:
        raise _fail(key, value, "must be a positive integer")
    return number


def parse_positive_float(key: str, value: object) -> float:
    try:
        number = float(str(value).strip())
    except (TypeError, ValueError):
        raise _fail(key, value, "must be a positive number") from None
    if not math.isfinite(number) or number <= 0:
        raise _fail(key, value, "must be a positive number")
    return number


def parse_non_negative_float(key: str, value: object) -> float:
    try:
        number = float(str(value).strip())
    except (TypeError, ValueError):
        raise _fail(key, value, "must be a number >= 0") from None
    if not math.isfinite(number) or number < 0:
        raise _fail(key, value, "must be a number >= 0")
    return number


def parse_fraction(key: str, value: object) -> float:
    try:
        number = float(str(value).strip())
    except (TypeError, ValueError):
        raise _fail(key, value, "must be a number between 0 and 1") from None
    if not (0.0 <= number <= 1.0):
        raise _fail(key, value, "must be a number between 0 and 1")
    return number


def parse_bool(key: str, value: object) -> bool:
    text = str(value).strip().lower()
    if text in {"1", "true", "yes", "on"}:
        return True
    if text in {"0", "false", "no", "off", ""}:
        return False
    raise _fail(key, value, "must be true or false")


def parse_base_urls(key: str, value: object) -> list[str]:
    """A comma-separated list of OpenAI-compatible base URLs (``http(s)://host:port/v1``)."""
    urls = [part.strip().rstrip("/") for part in str(value).split(",") if part.strip()]
    if not urls:
        raise _fail(key, value, "needs at least one http(s) URL")
    for url in urls:
        parsed = urlparse(url)
        if parsed.scheme not in {"http", "https"} or not parsed.netloc:
            raise _fail(key, value, f"{url!r} is not an http(s) URL like http://127.0.0.1:8000/v1")
    if len(set(urls)) != len(urls):
        raise _fail(key, value, "lists the same URL twice")
    return urls


def parse_layer_ids(key: str, value: object) -> list[int] | None:
    """``""`` means the EAGLE-3 default [2, N//2, N-3]; otherwise comma-separated layer ids."""
    text = str(value).strip()
    if not text:
        return None
    try:
        ids = [int(part) for part in text.replace(" ", ",").split(",") if part]
    except ValueError:
        raise _fail(key, value, "must be comma-separated integers, e.g. 1,2,3") from None
    if len(ids) < 1 or len(set(ids)) != len(ids) or any(i < 0 for i in ids):
        raise _fail(key, value, "must be distinct non-negative integers")
    return ids


@dataclass(frozen=True)
class EnvSetting:
    key: str
    default: str
    description: str
    parse: Callable[[str, object], Any]
    secret: bool = False


def _as_str(key: str, value: object) -> str:
    return str(value).strip()


def _as_optional_str(key: str, value: object) -> str | None:
    text = str(value).strip()
    return text or None


# One table: the README's configuration table is generated from it (``eagle3 config --markdown``).
ENV_SETTINGS: dict[str, EnvSetting] = {
    s.key: s
    for s in [
        EnvSetting("EAGLE3_DATA_DIR", "./data", "Root of every asset's files (one folder per asset).", _as_str),
        EnvSetting(
            "EAGLE3_PROMPTS_PATH",
            str(SAMPLE_PROMPTS_PATH),
            "Prompt dataset, JSONL or Parquet (OpenAI `messages`, ShareGPT `conversations` or `prompt`).",
            _as_str,
        ),
        EnvSetting("EAGLE3_PARTITION_SIZE", "1000", "Samples per partition.", parse_positive_int),
        EnvSetting(
            "EAGLE3_MAX_REJECT_SHARE",
            "0.05",
            "raw_prompts fails when more than this share of dataset rows is rejected.",
            parse_fraction,
        ),
        EnvSetting(
            "EAGLE3_VLLM_BASE_URL",
            "http://127.0.0.1:8000/v1",
            "OpenAI-compatible base URL(s) of the vLLM server(s); comma-separated for several.",
            parse_base_urls,
        ),
        EnvSetting("EAGLE3_MODEL", "", "Served model name; empty: ask `/v1/models`.", _as_optional_str),
        EnvSetting(
            "EAGLE3_API_KEY", "", "API key for the server(s); never logged or stored.", _as_optional_str, secret=True
        ),
        EnvSetting("EAGLE3_CONCURRENCY", "128", "Requests in flight per partition run.", parse_positive_int),
        EnvSetting("EAGLE3_MAX_TOKENS", "8000", "max_tokens per completion.", parse_positive_int),
        EnvSetting("EAGLE3_REQUEST_TIMEOUT_S", "1800", "Read timeout per request, seconds.", parse_positive_float),
        EnvSetting("EAGLE3_STREAM", "false", "Stream responses (idle timeout instead of one long read).", parse_bool),
        EnvSetting(
            "EAGLE3_TRANSPORT",
            "aiohttp",
            "HTTP client: `aiohttp` (the project's own, ~1 ms client CPU per request) or `openai` (stock `AsyncOpenAI` "
            "over the SDK's aiohttp client: same requests and results, more CPU).",
            _as_str,
        ),
        EnvSetting(
            "EAGLE3_RETURN_TOKEN_IDS",
            "true",
            "Ask vLLM for prompt/completion token ids and train on exactly those (false for servers without them).",
            parse_bool,
        ),
        EnvSetting("EAGLE3_TEMPERATURE", "0.6", "Sampling temperature for generation.", parse_non_negative_float),
        EnvSetting(
            "EAGLE3_EXTRA_BODY", "", 'Extra JSON fields for each request, e.g. `{"ignore_eos": true}`.', _as_str
        ),
        EnvSetting(
            "EAGLE3_VERIFIER_PATH",
            "",
            "Local Hugging Face model folder of the verifier (hidden states, training). Empty: the demo's tiny model.",
            _as_optional_str,
        ),
        EnvSetting(
            "EAGLE3_LAYER_IDS",
            "",
            "Verifier layers for EAGLE-3's auxiliary hidden states, e.g. `1,2,3`; empty: `[2, N//2, N-3]`.",
            parse_layer_ids,
        ),
    ]
}


def read_env(key: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of one ``EAGLE3_*`` setting, from ``environ`` (default: ``os.environ``)."""
    setting = ENV_SETTINGS[key]
    env = os.environ if environ is None else environ
    raw = env.get(key, setting.default)
    return setting.parse(key, raw)


def settings_markdown() -> str:
    lines = ["| Variable | Default | Meaning |", "|---|---|---|"]
    for s in ENV_SETTINGS.values():
        if s.key == "EAGLE3_PROMPTS_PATH":
            default = "the shipped sample (`eagle3_assets/data/sample_prompts.jsonl`)"
        else:
            default = f"`{s.default}`" if s.default else "(empty)"
        lines.append(f"| `{s.key}` | {default} | {s.description} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Redactor:
    """Replaces secret values in text before it reaches a log line, an error or metadata."""

    secrets: tuple[str, ...] = field(default_factory=tuple)

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            if secret:
                text = text.replace(secret, "***")
        return text
