"""The fake vLLM server's configuration and fault injection.

:class:`FakeConfig` is everything a fake server can be told (also as command-line flags, see
:func:`config_to_args`); :func:`draw_fault` picks the fault a request gets, deterministically from
(seed, prompt, how many times that prompt was seen before), and :func:`lie` gives a well-formed body a field
of the wrong type. Kept apart from the HTTP layer (:mod:`fake_http`) and the response model
(:mod:`fake_responses`) so each stays readable.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, fields
from typing import Any

FAULT_KINDS = (
    "error_500",
    "error_429",
    "reset",
    "hang",
    "truncate",
    "invalid_json",
    "non_completion",
    "empty_choices",
    # a 200 that lies about its types (vLLM never does; a proxy or another server might)
    "content_list",  # content as a list of parts
    "reasoning_object",  # reasoning as an object
    "usage_strings",  # usage counts as strings
    # a 200 whose body never completes (a stuck proxy, a runaway server): one byte every trickle_interval_s,
    # always under a client's idle timeout; or an endless body sent as fast as the client reads it
    "trickle",
    "endless",
)
# the lying kinds: the body is whole and well-formed JSON, only a field's type is wrong
LYING_FAULTS = frozenset({"content_list", "reasoning_object", "usage_strings"})
# the kinds whose 200 body never ends (until hang_s): a client must bound it in time and size itself
NEVER_ENDING_FAULTS = frozenset({"trickle", "endless"})


@dataclass
class FakeConfig:
    model: str = "fake-model"
    token_rate: float = 500.0  # tokens per second per sequence
    ttft_s: float = 0.0  # time to first token
    median_tokens: float = 800.0
    sigma: float = 0.8  # lognormal sigma of response lengths
    min_tokens: int = 1
    max_model_len: int = 32768
    seed: int = 0
    reasoning_field: str = "reasoning"  # "reasoning" | "reasoning_content" | "none"
    reasoning_share: float = 0.6  # share of the completion tokens that are chain of thought
    stream_interval_s: float = 0.02  # SSE chunks carry the tokens produced in this interval (>= 1 token)
    api_key: str | None = None
    basic_auth: str | None = None  # "user:password": /v1/* requires "Authorization: Basic ..." (a proxy in front)
    hang_s: float = 3600.0  # also how long a trickling or endless body lasts at most
    trickle_interval_s: float = 1.0  # the "trickle" fault: seconds between the body's bytes
    # the status line of every "endless" body: a runaway error page (500, 400) must be bounded like a runaway 200
    endless_status: int = 200
    endless_models: bool = False  # GET /v1/models answers an endless body too (a model list that never ends)
    revoke_after: int = 0  # > 0: chat requests after this many are refused with revoke_status (key revoked)
    revoke_status: int = 401
    outage_after: int = 0  # > 0: chat requests after this many are answered outage_status (the server went down)
    outage_status: int = 503
    max_num_seqs: int = 0  # sequences generating at once; beyond it requests wait (0 = no limit)
    metrics: bool = True  # serve GET /metrics (vLLM's scheduler gauges)
    # "" (honest) or a lie in the gauges: "nan" (running NaN), "negative" (running -50), "huge" (waiting 1e9)
    metrics_lie: str = ""
    faults: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.faults) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {FAULT_KINDS}")
        if sum(self.faults.values()) > 1.0:
            raise ValueError(f"fault rates sum above 1: {self.faults}")
        if self.reasoning_field not in {"reasoning", "reasoning_content", "none"}:
            raise ValueError(f"reasoning_field={self.reasoning_field!r}")
        if self.max_num_seqs < 0:
            raise ValueError(f"max_num_seqs={self.max_num_seqs!r}: must be >= 0 (0 = no limit)")
        if not 200 <= self.endless_status <= 599:
            raise ValueError(f"endless_status={self.endless_status!r}: must be an HTTP status (200-599)")


def uniform(*parts: object) -> float:
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    # (0, 1): never exactly 0 so inv_cdf stays finite
    return (int.from_bytes(digest, "big") + 0.5) / 2.0**64


def draw_fault(key: str, seen_before: int, config: FakeConfig) -> str | None:
    if not config.faults:
        return None
    u = uniform("fault", config.seed, key, seen_before)
    edge = 0.0
    for kind in FAULT_KINDS:
        edge += config.faults.get(kind, 0.0)
        if u < edge:
            return kind
    return None


def lie(fault: str, message: dict[str, Any], reasoning_field: str) -> None:
    """Give one field of a whole, well-formed completion body the wrong type (usage: see Completion.usage)."""
    if fault == "content_list":
        message["content"] = [{"type": "text", "text": message["content"]}]
    elif fault == "reasoning_object":
        name = "reasoning" if reasoning_field == "none" else reasoning_field
        message[name] = {"text": message.get(name) or ""}


def config_to_args(config: FakeConfig) -> list[str]:
    """Command-line arguments that reproduce ``config`` in a subprocess."""
    args: list[str] = []
    for f in fields(FakeConfig):
        value = getattr(config, f.name)
        if f.name == "faults":
            for kind, rate in value.items():
                args += [f"--{kind.replace('_', '-')}", str(rate)]
        elif value is not None:
            args += [f"--{f.name.replace('_', '-')}", str(value)]
    return args
