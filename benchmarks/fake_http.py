"""The fake vLLM server's HTTP layer: a small asyncio protocol serving the OpenAI-compatible routes.

A framework is avoided on purpose: in the benchmark the server shares two cores with the client under test,
so every microsecond it spends per request or per SSE chunk skews the client's numbers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import time
from collections import Counter
from typing import Any

import fake_responses as responses
from fake_capacity import Scheduler
from fake_faults import LYING_FAULTS, NEVER_ENDING_FAULTS, FakeConfig, draw_fault, lie

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


def _head(status: int, content_type: str, length: int | None) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}", f"content-type: {content_type}"]
    lines.append(f"content-length: {length}" if length is not None else "transfer-encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _basic(pair: str) -> str:
    import base64

    return "Basic " + base64.b64encode(pair.encode()).decode()


def _error_body(status: int, message: str, kind: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()


def _delta(c: responses.Completion, field: str, start: int, end: int, lie: tuple[str, str]) -> str:
    """The choices of one SSE chunk carrying tokens ``start:end`` in ``delta[field]``, the JSON string wrapped in
    ``lie`` (a prefix and a suffix: the wrong-type faults)."""
    text = lie[0] + json.dumps(responses.token_text(c.key, start, end - start)) + lie[1]
    ids = c.ids_field(start, end)
    return f'[{{"index":0,"delta":{{"{field}":{text}}},"logprobs":null,"finish_reason":null{ids}}}]}}\n\n'


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
        basic = app.config.basic_auth
        if basic and path.startswith(("/v1/", "/metrics")) and headers.get("authorization") != _basic(basic):
            self.respond(401, _error_body(401, "Unauthorized (basic auth)", "Unauthorized"))
            return
        if method == "GET" and path == "/v1/models" and app.config.endless_models:
            app.stats.outcomes["endless_models"] += 1
            await self._never_ending("endless", stream=False)
        elif method == "GET" and path == "/v1/models":
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
        key = responses.prompt_key(messages)
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
        if config.outage_after and stats.total > config.outage_after:
            stats.outcomes["outage"] += 1
            status = config.outage_status
            self.respond(status, _error_body(status, "the engine is down", "ServiceUnavailable"))
            return
        model = request.get("model")
        if model != config.model:
            stats.outcomes["404"] += 1
            self.respond(404, _error_body(404, f"The model `{model}` does not exist.", "NotFoundError"))
            return
        n_prompt = responses.prompt_tokens(messages)
        if n_prompt > config.max_model_len:
            stats.outcomes["400"] += 1
            message = (
                f"This model's maximum context length is {config.max_model_len} tokens. However, your prompt "
                f"contains {n_prompt} input tokens. Please reduce the length of the input messages."
            )
            self.respond(400, _error_body(400, message, "BadRequestError"))
            return
        max_tokens = int(request.get("max_tokens") or request.get("max_completion_tokens") or 16)
        n, finish = responses.response_length(messages, config, max_tokens)
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
        if fault in NEVER_ENDING_FAULTS:
            await self._never_ending(fault, stream)
            return
        include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
        ctx = responses.Completion(
            key, n, n_prompt, finish, config, fault, include_usage, bool(request.get("return_token_ids"))
        )
        scheduler = app.scheduler
        await scheduler.admit()  # beyond max_num_seqs a request waits here, as in vLLM's waiting queue
        try:
            if stream:
                await self._stream(ctx)
            else:
                await self._complete(ctx)
        finally:
            scheduler.release()

    async def _never_ending(self, fault: str, stream: bool) -> None:
        """A 200 whose body never completes: a byte at a time ("trickle") or as fast as the client reads it
        ("endless": well-formed content that never closes, so only a size limit or a deadline ends it; its status
        is ``endless_status``, an error page can run away too). Ends when the client goes away, or after
        ``hang_s``."""
        config = self.app.config
        model = json.dumps(config.model)
        status = config.endless_status if fault == "endless" else 200
        if stream:
            self.write(_head(status, "text/event-stream; charset=utf-8", None))
            event = (
                f'data: {{"id":"chatcmpl-endless","object":"chat.completion.chunk","created":{self.app.created},'
                f'"model":{model},"choices":[{{"index":0,"delta":{{"content":"endless "}},"logprobs":null,'
                '"finish_reason":null}]}\n\n'
            ).encode()
            endless = _chunk(event * 256)
            trickle = _chunk(b"\n")  # an empty SSE line: valid, and it resets any idle timer
        else:
            opening = (
                f'{{"id":"chatcmpl-endless","object":"chat.completion","created":{self.app.created},'
                f'"model":{model},"choices":[{{"index":0,"message":{{"role":"assistant","content":"'
            ).encode()
            if fault == "trickle":
                # an ordinary Content-Length: the reply looks like a small, whole one that is slow to arrive
                self.write(_head(200, "application/json", 4096) + opening)
            else:
                # no length (chunked): only the bytes that arrive can tell the client it is too big
                self.write(_head(status, "application/json", None) + _chunk(opening))
            endless = _chunk(b"endless " * 8192)
            trickle = b"x"  # more of the content string, one byte at a time
        ends = time.monotonic() + config.hang_s
        while not self.closed and time.monotonic() < ends:
            if fault == "trickle":
                self.write(trickle)
                await asyncio.sleep(config.trickle_interval_s)
                continue
            transport = self.transport
            # only as fast as the client reads: the server's own send buffer must not grow without bound
            if transport is not None and transport.get_write_buffer_size() < 2**20:
                self.write(endless)
                await asyncio.sleep(0)
            else:
                await asyncio.sleep(0.001)
        self.abort(reset=False)

    async def _complete(self, c: responses.Completion) -> None:
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
            data["prompt_token_ids"] = responses.prompt_token_ids(c.key, c.n_prompt)
            for choice in data["choices"]:
                choice["token_ids"] = responses.token_ids(c.key, 0, c.n)
        if c.fault in LYING_FAULTS:
            lie(c.fault, message, c.config.reasoning_field)
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

    async def _stream(self, c: responses.Completion) -> None:
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
            first += b',"prompt_token_ids":' + json.dumps(responses.prompt_token_ids(c.key, c.n_prompt)).encode()
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
                    lie = ('{"text":', "}") if c.fault == "reasoning_object" else ("", "")
                    parts.append(_delta(c, field_name, sent, upto, lie))
                sent = upto
            if ready > sent:
                lie = ('[{"type":"text","text":', "}]") if c.fault == "content_list" else ("", "")
                parts.append(_delta(c, "content", sent, ready, lie))
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
