"""The fake vLLM server's response model: prompt keys, response lengths and the deterministic token text.

Response length is a lognormal draw keyed by the prompt (:func:`prompt_key`) and the seed, capped at the
request's ``max_tokens``; the text is fixed-width words sliced from one prebuilt string, so producing n tokens
costs one slice (the server shares cores with the client it is measured against).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

from fake_faults import FakeConfig, uniform

_FORCED_TOKENS = re.compile(r"\[\[fake_tokens=(\d+)\]\]")
_TOKEN_WIDTH = 6
_VOCAB = 4096
_NORMAL = NormalDist()


def prompt_key(messages: Sequence[dict[str, Any]]) -> str:
    """The key the server identifies a prompt by (its counters, its length and fault draws)."""
    digest = hashlib.blake2b(digest_size=8)
    for message in messages:
        digest.update(str(message.get("role", "")).encode())
        digest.update(b"\x1e")
        digest.update(str(message.get("content", "")).encode())
        digest.update(b"\x1f")
    return digest.hexdigest()


def natural_length(key: str, config: FakeConfig) -> int:
    """Tokens the fake 'model' wants to produce for this prompt before any max_tokens cap."""
    z = _NORMAL.inv_cdf(uniform("length", config.seed, key))
    return max(config.min_tokens, round(config.median_tokens * math.exp(config.sigma * z)))


def response_length(messages: Sequence[dict[str, Any]], config: FakeConfig, max_tokens: int) -> tuple[int, str]:
    """(completion tokens, finish_reason) the server will produce for these messages."""
    forced = None
    for message in messages:
        match = _FORCED_TOKENS.search(str(message.get("content", "")))
        if match:
            forced = int(match.group(1))
    n = forced if forced is not None else natural_length(prompt_key(messages), config)
    if n >= max_tokens:
        return max_tokens, "length"
    return n, "stop"


def prompt_tokens(messages: Sequence[dict[str, Any]]) -> int:
    # A whitespace word count plus a small chat-template overhead per message: cheap and deterministic.
    return sum(len(str(m.get("content", "")).split()) + 4 for m in messages)


# Fixed-width tokens so a text of n tokens is one slice of a prebuilt string (no per-token work).
def _build_text() -> str:
    words = []
    for i in range(_VOCAB):
        h = hashlib.blake2b(str(i).encode(), digest_size=4).hexdigest()
        words.append(" " + "".join(chr(ord("a") + int(c, 16) % 26) for c in h[: _TOKEN_WIDTH - 1]))
    block = "".join(words)
    return block * 8  # 32k tokens, enough for any offset + the longest completion we test


_TEXT = _build_text()
_TEXT_TOKENS = len(_TEXT) // _TOKEN_WIDTH


def token_text(key: str, start: int, count: int) -> str:
    """Tokens [start, start+count) of the deterministic completion for ``key``."""
    offset = int(uniform("offset", key) * _VOCAB)
    begin = (offset + start) % (_TEXT_TOKENS - _VOCAB)
    out = []
    while count > 0:
        take = min(count, _TEXT_TOKENS - begin)
        out.append(_TEXT[begin * _TOKEN_WIDTH : (begin + take) * _TOKEN_WIDTH])
        count -= take
        begin = 0
    return "".join(out)


def token_ids(key: str, start: int, count: int) -> list[int]:
    """The ids of tokens [start, start+count) of ``key``'s completion: each fixed-width word's index in the
    vocabulary, so ids and text agree (``return_token_ids``)."""
    offset = int(uniform("offset", key) * _VOCAB)
    return [(offset + i) % _VOCAB for i in range(start, start + count)]


def prompt_token_ids(key: str, count: int) -> list[int]:
    offset = int(uniform("prompt", key) * _VOCAB)
    return [(offset + 7 * i) % _VOCAB for i in range(count)]


@dataclass
class Completion:
    key: str
    n: int
    n_prompt: int
    finish: str
    config: FakeConfig
    fault: str | None
    include_usage: bool
    return_token_ids: bool = False

    def ids_field(self, start: int, end: int) -> str:
        """The ``,"token_ids":[...]`` of a stream chunk carrying tokens [start, end), or nothing."""
        if not self.return_token_ids:
            return ""
        return ',"token_ids":' + json.dumps(token_ids(self.key, start, end - start))

    def usage(self) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": self.n_prompt, "completion_tokens": self.n}
        usage["total_tokens"] = self.n_prompt + self.n
        if self.fault == "usage_strings":
            return {k: str(v) for k, v in usage.items()}
        return usage

    @property
    def n_reasoning(self) -> int:
        return int(self.n * self.config.reasoning_share) if self.config.reasoning_field != "none" else 0

    def split_text(self) -> tuple[str, str]:
        k = self.n_reasoning  # without a reasoning field the whole completion is content
        return token_text(self.key, 0, k), token_text(self.key, k, self.n - k)
