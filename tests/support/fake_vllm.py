"""A fake vLLM OpenAI-compatible server for tests and benchmarks.

Run it with ``python -m support.fake_vllm --port 8000`` (``--port 0`` picks a free port; the first
stdout line is ``READY <port>``), or start it from Python with :class:`FakeServerProcess` (a subprocess,
so its CPU time is not charged to the client being measured) or :func:`serve_in_thread`.

What it imitates:

- ``POST /v1/chat/completions``, streaming (SSE, ``stream_options.include_usage``) and not. The chain of
  thought is in ``message.reasoning`` / ``delta.reasoning`` (``--reasoning-field reasoning_content`` gives
  the legacy shape, ``none`` leaves it out).
- Response length is deterministic: a lognormal draw keyed by the prompt (see :func:`prompt_key`) and the
  seed, capped at the request's ``max_tokens`` (then ``finish_reason == "length"``). A prompt containing
  ``[[fake_tokens=N]]`` forces N tokens. Every sequence is produced at ``token_rate`` tokens/s after
  ``ttft_s``, so latency follows length like a real server that is not saturated.
- ``return_token_ids`` (vLLM >= 0.10.2): ``prompt_token_ids`` and ``choices[].token_ids`` (in streaming, the
  prompt ids in the first chunk and each chunk's new ids), one id per fixed-width word of the text.
- ``GET /v1/models``; a 400 with vLLM's message when the prompt exceeds ``max_model_len``; a 401 when an
  API key is configured and the request lacks it.
- Fault injection, drawn per request from (seed, prompt, how many times that prompt was seen before), so a
  run is reproducible and a retried request usually succeeds: HTTP 500, 429, connection reset part-way
  through the body, hang (never answers), truncated body / stream, invalid JSON, a 200 whose body is not a
  chat completion, empty ``choices``, and a 200 whose fields have the wrong type (``content`` a list,
  ``reasoning`` an object, usage counts as strings).
- A key revoked mid-run: with ``revoke_after`` > 0, every chat request after the first ``revoke_after``
  is answered ``revoke_status`` (401 or 403) as if the key had been withdrawn.
- Capacity like vLLM's ``--max-num-seqs``: with ``max_num_seqs`` > 0 at most that many requests generate at
  once and the rest wait in arrival order (their tokens start when they are scheduled); ``GET /metrics``
  exports ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` in vLLM's Prometheus text format
  (``--metrics false``: a server without ``/metrics``, answering 404).
- ``GET /stats`` (requests per prompt key, outcomes, in-flight, running and waiting peaks, the integral of
  running sequences over time, first request and last response) and ``POST /stats/reset``.

The HTTP layer is a small asyncio protocol instead of a framework: in the benchmark the server shares two
cores with the client under test, so every microsecond it spends per request or per SSE chunk skews the
client's numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from statistics import NormalDist
from typing import Any

from support.fake_capacity import Scheduler

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
)
# the lying kinds: the body is whole and well-formed JSON, only a field's type is wrong
LYING_FAULTS = frozenset({"content_list", "reasoning_object", "usage_strings"})

_FORCED_TOKENS = re.compile(r"\[\[fake_tokens=(\d+)\]\]")
_TOKEN_WIDTH = 6
_VOCAB = 4096
_NORMAL = NormalDist()


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
    hang_s: float = 3600.0
    revoke_after: int = 0  # > 0: chat requests after this many are refused with revoke_status (key revoked)
    revoke_status: int = 401
    max_num_seqs: int = 0  # sequences generating at once; beyond it requests wait (0 = no limit)
    metrics: bool = True  # serve GET /metrics (vLLM's scheduler gauges)
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


def prompt_key(messages: Sequence[dict[str, Any]]) -> str:
    """The key the server identifies a prompt by (its counters, its length and fault draws)."""
    digest = hashlib.blake2b(digest_size=8)
    for message in messages:
        digest.update(str(message.get("role", "")).encode())
        digest.update(b"\x1e")
        digest.update(str(message.get("content", "")).encode())
        digest.update(b"\x1f")
    return digest.hexdigest()


def _uniform(*parts: object) -> float:
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    # (0, 1): never exactly 0 so inv_cdf stays finite
    return (int.from_bytes(digest, "big") + 0.5) / 2.0**64


def natural_length(key: str, config: FakeConfig) -> int:
    """Tokens the fake 'model' wants to produce for this prompt before any max_tokens cap."""
    z = _NORMAL.inv_cdf(_uniform("length", config.seed, key))
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


def draw_fault(key: str, seen_before: int, config: FakeConfig) -> str | None:
    if not config.faults:
        return None
    u = _uniform("fault", config.seed, key, seen_before)
    edge = 0.0
    for kind in FAULT_KINDS:
        edge += config.faults.get(kind, 0.0)
        if u < edge:
            return kind
    return None


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
    offset = int(_uniform("offset", key) * _VOCAB)
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
    offset = int(_uniform("offset", key) * _VOCAB)
    return [(offset + i) % _VOCAB for i in range(start, start + count)]


def prompt_token_ids(key: str, count: int) -> list[int]:
    offset = int(_uniform("prompt", key) * _VOCAB)
    return [(offset + 7 * i) % _VOCAB for i in range(count)]


# --------------------------------------------------------------------------------------------- HTTP

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    429: "Too Many Requests",
    500: "Internal Server Error",
}


def _head(status: int, content_type: str, length: int | None) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}", f"content-type: {content_type}"]
    lines.append(f"content-length: {length}" if length is not None else "transfer-encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _error_body(status: int, message: str, kind: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()


class _Stats:
    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0
        self.total = 0
        self.completed = 0  # successful responses fully written to the socket
        self.max_running = 0
        self.max_waiting = 0
        self.busy_seq_s = 0.0  # integral of running sequences over time (sequence-seconds)
        self.first_request_at: float | None = None  # wall clock (time.time()) of the first chat request
        self.last_response_at: float | None = None  # ... and of the last finished generation

    def as_json(self) -> dict[str, Any]:
        return {
            "total_requests": self.total,
            "completed": self.completed,
            "requests": dict(self.requests),
            "outcomes": dict(self.outcomes),
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "max_running": self.max_running,
            "max_waiting": self.max_waiting,
            "busy_seq_s": self.busy_seq_s,
            "first_request_at": self.first_request_at,
            "last_response_at": self.last_response_at,
        }


class FakeVLLM:
    """The server state shared by all connections."""

    def __init__(self, config: FakeConfig) -> None:
        self.config = config
        self.stats = _Stats()
        self.scheduler = Scheduler(self)
        self.created = int(time.time())

    async def serve(self, host: str, port: int) -> asyncio.base_events.Server:
        loop = asyncio.get_running_loop()
        return await loop.create_server(lambda: _Connection(self), host, port, backlog=4096, reuse_address=True)


class _Connection(asyncio.Protocol):
    def __init__(self, app: FakeVLLM) -> None:
        self.app = app
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._maybe_dispatch()

    def _maybe_dispatch(self) -> None:
        if self.task is not None and not self.task.done():
            return  # one request at a time per connection (clients do not pipeline)
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
        method, path, _ = head[0].split(" ", 2)
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        if len(self.buffer) < end + 4 + length:
            return
        body = bytes(self.buffer[end + 4 : end + 4 + length])
        del self.buffer[: end + 4 + length]
        self.task = asyncio.get_running_loop().create_task(self._handle(method, path, headers, body))
        self.task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None and not self.closed:
            self.abort(reset=False)
        elif not self.closed and self.buffer:
            self._maybe_dispatch()

    def write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    def respond(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.write(_head(status, content_type, len(body)) + body)

    def abort(self, reset: bool) -> None:
        if self.closed or self.transport is None:
            return
        self.closed = True
        if reset:
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    # linger 0: close() sends RST instead of FIN, like a crashed worker
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()
        else:
            self.transport.close()

    # ------------------------------------------------------------------------------------- routes

    async def _handle(self, method: str, path: str, headers: dict[str, str], body: bytes) -> None:
        app = self.app
        path = path.split("?", 1)[0]
        key = app.config.api_key
        if key and path.startswith("/v1/") and headers.get("authorization") != f"Bearer {key}":
            self.respond(401, _error_body(401, "Unauthorized", "Unauthorized"))
            return
        if method == "GET" and path == "/v1/models":
            data = {
                "object": "list",
                "data": [
                    {
                        "id": app.config.model,
                        "object": "model",
                        "created": app.created,
                        "owned_by": "fake",
                        "max_model_len": app.config.max_model_len,
                    }
                ],
            }
            self.respond(200, json.dumps(data).encode())
        elif method == "GET" and path in {"/health", "/ping"}:
            self.respond(200, b"{}")
        elif method == "GET" and path == "/metrics" and app.config.metrics:
            self.respond(200, app.scheduler.metrics_text(), "text/plain; version=0.0.4; charset=utf-8")
        elif method == "GET" and path == "/stats":
            self.respond(200, json.dumps(app.stats.as_json()).encode())
        elif method == "POST" and path == "/stats/reset":
            app.stats = _Stats()
            self.respond(200, b"{}")
        elif method == "POST" and path == "/v1/chat/completions":
            stats = app.stats
            stats.in_flight += 1
            stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
            try:
                await self._chat(body)
            finally:
                stats.in_flight -= 1
        else:
            self.respond(404, _error_body(404, f"no route {method} {path}", "NotFoundError"))

    async def _chat(self, body: bytes) -> None:
        app, config = self.app, self.app.config
        try:
            request = json.loads(body)
            messages = request["messages"]
        except (ValueError, KeyError, TypeError):
            self.respond(400, _error_body(400, "invalid request body", "BadRequestError"))
            return
        stats = app.stats
        key = prompt_key(messages)
        seen = stats.requests[key]
        stats.requests[key] += 1
        stats.total += 1
        if stats.first_request_at is None:
            stats.first_request_at = time.time()
        if config.revoke_after and stats.total > config.revoke_after:
            stats.outcomes["revoked"] += 1
            status = config.revoke_status
            self.respond(status, _error_body(status, "the API key was revoked", "AuthenticationError"))
            return
        model = request.get("model")
        if model != config.model:
            stats.outcomes["404"] += 1
            self.respond(404, _error_body(404, f"The model `{model}` does not exist.", "NotFoundError"))
            return
        n_prompt = prompt_tokens(messages)
        if n_prompt > config.max_model_len:
            stats.outcomes["400"] += 1
            message = (
                f"This model's maximum context length is {config.max_model_len} tokens. However, your prompt "
                f"contains {n_prompt} input tokens. Please reduce the length of the input messages."
            )
            self.respond(400, _error_body(400, message, "BadRequestError"))
            return
        max_tokens = int(request.get("max_tokens") or request.get("max_completion_tokens") or 16)
        n, finish = response_length(messages, config, max_tokens)
        fault = draw_fault(key, seen, config)
        stats.outcomes[fault or "ok"] += 1
        if fault == "error_500":
            self.respond(500, _error_body(500, "fake internal server error", "InternalServerError"))
            return
        if fault == "error_429":
            self.respond(429, _error_body(429, "fake rate limit: too many requests", "RateLimitError"))
            return
        if fault == "hang":
            await asyncio.sleep(config.hang_s)
            self.abort(reset=False)
            return
        stream = bool(request.get("stream"))
        include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
        ctx = _Completion(key, n, n_prompt, finish, config, fault, include_usage, bool(request.get("return_token_ids")))
        scheduler = app.scheduler
        await scheduler.admit()  # beyond max_num_seqs a request waits here, as in vLLM's waiting queue
        try:
            if stream:
                await self._stream(ctx)
            else:
                await self._complete(ctx)
        finally:
            scheduler.release()

    async def _complete(self, c: _Completion) -> None:
        await asyncio.sleep(c.config.ttft_s + c.n / c.config.token_rate)
        if c.fault == "non_completion":
            self.respond(200, b'{"status": "ok", "detail": "this is not a chat completion"}')
            return
        reasoning, content = c.split_text()
        message: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": []}
        if c.config.reasoning_field != "none":
            message[c.config.reasoning_field] = reasoning
        data = {
            "id": f"chatcmpl-{c.key}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": c.config.model,
            "choices": []
            if c.fault == "empty_choices"
            else [{"index": 0, "message": message, "logprobs": None, "finish_reason": c.finish, "stop_reason": None}],
            "usage": c.usage(),
            "prompt_logprobs": None,
        }
        if c.return_token_ids:  # vLLM's shape: prompt ids at the top, completion ids in the choice
            data["prompt_token_ids"] = prompt_token_ids(c.key, c.n_prompt)
            for choice in data["choices"]:
                choice["token_ids"] = token_ids(c.key, 0, c.n)
        if c.fault in LYING_FAULTS:
            _lie(c.fault, message, c.config.reasoning_field)
        body = json.dumps(data).encode()
        if c.fault == "invalid_json":
            self.respond(200, body[: len(body) // 2])
        elif c.fault == "truncate":
            # the header promises the whole body; the connection closes cleanly half-way
            self.write(_head(200, "application/json", len(body)) + body[: len(body) // 2])
            self.abort(reset=False)
        elif c.fault == "reset":
            self.write(_head(200, "application/json", len(body)) + body[: len(body) // 2])
            await asyncio.sleep(0.01)  # let the half body leave before the RST overtakes it
            self.abort(reset=True)
        else:
            self.respond(200, body)
            if c.fault is None:
                self.app.stats.completed += 1

    async def _stream(self, c: _Completion) -> None:
        config = c.config
        self.write(_head(200, "text/event-stream; charset=utf-8", None))
        created = int(time.time())
        prefix = (
            f'data: {{"id":"chatcmpl-{c.key}","object":"chat.completion.chunk","created":{created},'
            f'"model":"{config.model}","choices":'
        ).encode()
        first = b'[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]'
        if c.fault == "reasoning_object":  # also when the answer has no reasoning tokens to carry the lie
            first = first.replace(b'"content":""', b'"content":"","reasoning":{}')
        if c.return_token_ids:  # vLLM sends the prompt's ids once, in the first chunk
            first += b',"prompt_token_ids":' + json.dumps(prompt_token_ids(c.key, c.n_prompt)).encode()
        self.write(_chunk(prefix + first + b"}\n\n"))
        n_reasoning = c.n_reasoning
        field_name = config.reasoning_field
        start = time.monotonic() + config.ttft_s
        sent = 0
        cut = c.n // 2 if c.fault in {"reset", "truncate", "invalid_json", "non_completion"} else None
        while sent < c.n:
            await asyncio.sleep(config.stream_interval_s)
            ready = min(c.n, int((time.monotonic() - start) * config.token_rate))
            if ready <= sent:
                continue
            if cut is not None and ready >= cut:
                break
            parts = []
            if sent < n_reasoning:
                upto = min(ready, n_reasoning)
                if field_name != "none":
                    text = json.dumps(token_text(c.key, sent, upto - sent))
                    if c.fault == "reasoning_object":
                        text = f'{{"text":{text}}}'
                    parts.append(
                        f'[{{"index":0,"delta":{{"{field_name}":{text}}},'
                        f'"logprobs":null,"finish_reason":null{c.ids_field(sent, upto)}}}]}}\n\n'
                    )
                sent = upto
            if ready > sent:
                text = json.dumps(token_text(c.key, sent, ready - sent))
                if c.fault == "content_list":
                    text = f'[{{"type":"text","text":{text}}}]'
                parts.append(
                    f'[{{"index":0,"delta":{{"content":{text}}},'
                    f'"logprobs":null,"finish_reason":null{c.ids_field(sent, ready)}}}]}}\n\n'
                )
                sent = ready
            if c.fault == "empty_choices":
                parts = ["[]}\n\n"]
            self.write(b"".join(_chunk(prefix + p.encode()) for p in parts))
        if cut is not None:
            if c.fault == "reset":
                await asyncio.sleep(0.01)
                self.abort(reset=True)
            elif c.fault == "truncate":
                self.write(b"0\r\n\r\n")  # a clean end of the HTTP body, but no finish_reason and no [DONE]
            elif c.fault == "invalid_json":
                self.write(_chunk(prefix + b'[{"index":0,"delta":{"content":"x\n\n'))
                self.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            else:
                self.write(_chunk(b'data: {"status": "ok"}\n\n') + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            return
        tail = []
        if c.fault != "empty_choices":
            tail.append(
                prefix
                + f'[{{"index":0,"delta":{{}},"logprobs":null,"finish_reason":"{c.finish}",'
                f'"stop_reason":null}}]}}\n\n'.encode()
            )
        if c.include_usage:
            tail.append(prefix + b'[],"usage":' + json.dumps(c.usage()).encode() + b"}\n\n")
        tail.append(b"data: [DONE]\n\n")
        self.write(b"".join(_chunk(t) for t in tail) + b"0\r\n\r\n")
        if c.fault is None:
            self.app.stats.completed += 1


def _lie(fault: str, message: dict[str, Any], reasoning_field: str) -> None:
    """Give one field of a whole, well-formed completion body the wrong type (usage: see _Completion.usage)."""
    if fault == "content_list":
        message["content"] = [{"type": "text", "text": message["content"]}]
    elif fault == "reasoning_object":
        name = "reasoning" if reasoning_field == "none" else reasoning_field
        message[name] = {"text": message.get(name) or ""}


@dataclass
class _Completion:
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


# ------------------------------------------------------------------------------------------ running


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is optional, asyncio's loop works, slower
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


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


def _parse_bool(text: str) -> bool:
    if text.lower() in {"1", "true", "yes"}:
        return True
    if text.lower() in {"0", "false", "no"}:
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true/false)")


def parse_args(argv: Sequence[str] | None = None) -> tuple[FakeConfig, str, int]:
    parser = argparse.ArgumentParser(prog="python -m support.fake_vllm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    defaults = FakeConfig()
    for f in fields(FakeConfig):
        if f.name == "faults":
            continue
        default = getattr(defaults, f.name)
        kind: Any = type(default) if default is not None else str
        if kind is bool:
            kind = _parse_bool
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=default)
    for kind in FAULT_KINDS:
        parser.add_argument(f"--{kind.replace('_', '-')}", type=float, default=0.0, help=f"rate of {kind} faults")
    ns = parser.parse_args(argv)
    values = {f.name: getattr(ns, f.name) for f in fields(FakeConfig) if f.name != "faults"}
    faults = {kind: getattr(ns, kind) for kind in FAULT_KINDS if getattr(ns, kind) > 0}
    return FakeConfig(**values, faults=faults), ns.host, ns.port


def main(argv: Sequence[str] | None = None) -> None:
    config, host, port = parse_args(argv)
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    app = FakeVLLM(config)
    server = loop.run_until_complete(app.serve(host, port))
    bound = server.sockets[0].getsockname()[1]
    print(f"READY {bound}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.run_until_complete(stop.wait())
    server.close()
    loop.close()


def _python_path() -> str:
    tests_dir = Path(__file__).resolve().parent.parent
    inherited = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join([str(tests_dir.parent), str(tests_dir)] + ([inherited] if inherited else []))


class FakeServerProcess:
    """The fake server in a subprocess: ``with FakeServerProcess(config) as server: server.base_url``."""

    def __init__(self, config: FakeConfig | None = None, host: str = "127.0.0.1") -> None:
        self.config = config or FakeConfig()
        self.host = host
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> FakeServerProcess:
        cmd = [sys.executable, "-m", "support.fake_vllm", "--host", self.host, "--port", "0"]
        self.proc = subprocess.Popen(
            cmd + config_to_args(self.config),
            stdout=subprocess.PIPE,
            text=True,
            # tests/ on the path, so the child finds this module as ``support.fake_vllm``
            env={**os.environ, "PYTHONPATH": _python_path(), "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            self.stop()
            raise RuntimeError(f"fake vLLM server did not start: {line!r}")
        self.port = int(line.split()[1])
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def cpu_seconds(self) -> float:
        """User + system CPU time the server process has used so far (Linux /proc)."""
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/stat") as handle:
            parts = handle.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")

    def stats(self) -> dict[str, Any]:
        return get_json(f"{self.root_url}/stats")

    def reset_stats(self) -> None:
        post_json(f"{self.root_url}/stats/reset")

    def __enter__(self) -> FakeServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def serve_in_thread(config: FakeConfig | None = None, host: str = "127.0.0.1") -> Iterator[str]:
    """The fake server on a background thread's event loop; yields its base URL (``http://h:p/v1``)."""
    app = FakeVLLM(config or FakeConfig())
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, Any] = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        holder["server"] = loop.run_until_complete(app.serve(host, 0))
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True, name="fake-vllm")
    thread.start()
    ready.wait(10)
    port = holder["server"].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{port}/v1"
    finally:
        loop.call_soon_threadsafe(holder["server"].close)
        for task in asyncio.all_tasks(loop):
            loop.call_soon_threadsafe(task.cancel)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def get_json(url: str) -> Any:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def post_json(url: str, payload: Any = None) -> Any:
    import urllib.request

    request = urllib.request.Request(
        url, data=json.dumps(payload or {}).encode(), method="POST", headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


__all__ = [
    "FAULT_KINDS",
    "FakeConfig",
    "FakeServerProcess",
    "FakeVLLM",
    "asdict",
    "main",
    "natural_length",
    "prompt_key",
    "response_length",
    "serve_in_thread",
]

if __name__ == "__main__":
    main()
