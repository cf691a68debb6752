"""One chat-completion request through ``openai.AsyncOpenAI``, classified into a result or an error.

The SDK is the transport (auth, headers, base URL, httpx connection pool) with its own retries off
(``max_retries=0``) so they never stack with the engine's. The response body is read raw and parsed
here: building the SDK's pydantic models costs several ms of CPU per request, which at C=128 on two
cores is the difference between a saturated server and an idle one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx2
import openai

try:
    import orjson

    _loads = orjson.loads
    _dumps = orjson.dumps
except ImportError:  # pragma: no cover - depends on the environment
    _loads = json.loads

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()

RETRYABLE_STATUS = frozenset({408, 409, 429})
_MAX_ERROR_CHARS = 2000


@dataclass(frozen=True)
class Completion:
    reasoning: str | None
    content: str | None
    finish_reason: str
    prompt_tokens: int | None
    completion_tokens: int | None
    model: str | None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids; None when not sent
    completion_token_ids: list[int] | None = None


def _token_ids(value: Any, what: str) -> list[int] | None:
    """A token-id list from the body, or None when absent; anything else is a body we cannot trust (retryable)."""
    if value is None:
        return None
    if not isinstance(value, list) or (value and (set(map(type, value)) != {int} or min(value) < 0)):
        raise RequestFailed(f"{what} is not a list of non-negative integers: {str(value)[:200]}", True)
    return value


def _checked(completion: Completion) -> Completion:
    """Token ids must agree with the usage counts they come with: a server whose two accounts differ lies in one."""
    for ids, count, what in (
        (completion.prompt_token_ids, completion.prompt_tokens, "prompt_token_ids"),
        (completion.completion_token_ids, completion.completion_tokens, "token_ids"),
    ):
        if ids is not None and count is not None and len(ids) != count:
            raise RequestFailed(f"{what} has {len(ids)} ids but usage says {count} tokens", True)
    return completion


class RequestFailed(Exception):
    """A request that did not produce a completion. ``retryable`` says whether trying again can help."""

    def __init__(self, message: str, retryable: bool, status: int | None = None, retry_after_s: float | None = None,
                 kind: str | None = None):
        super().__init__(message)
        self.message = message[:_MAX_ERROR_CHARS]
        self.retryable = retryable
        self.status = status
        self.retry_after_s = retry_after_s
        # "connection" or "timeout" when the endpoint could not be reached at all (set by classify)
        self.kind = kind

    @property
    def unreachable(self) -> bool:
        return self.kind in ("connection", "timeout")


def make_client(base_url: str, api_key: str | None, *, connect_s: float, read_s: float, max_connections: int,
                ) -> openai.AsyncOpenAI:
    """An SDK client for one endpoint: no SDK retries, the given timeouts, a pool as big as the cap.

    The SDK's aiohttp transport (``openai.DefaultAioHttpClient``) is used when aiohttp is installed: on
    these machines it costs about half the CPU per request of the default httpx2 pool, whose connection
    scan grows with the number of open connections.
    """
    timeout = httpx2.Timeout(connect=connect_s, read=read_s, write=60.0, pool=None)
    limits = httpx2.Limits(max_connections=max_connections + 8, max_keepalive_connections=max_connections + 8)
    try:
        import aiohttp  # noqa: F401

        http_client = openai.DefaultAioHttpClient(timeout=timeout, limits=limits)
    except ImportError:  # pragma: no cover - depends on the environment
        http_client = openai.DefaultAsyncHttpxClient(timeout=timeout, limits=limits)
    return openai.AsyncOpenAI(
        base_url=base_url,
        # vLLM without --api-key accepts anything; the SDK insists on a value
        api_key=api_key or "EMPTY",
        max_retries=0,
        timeout=timeout,
        http_client=http_client,
    )


def _server_message(error: openai.APIStatusError) -> str:
    body = error.body
    if isinstance(body, Mapping):
        inner = body.get("error", body)
        if isinstance(inner, Mapping) and inner.get("message"):
            return str(inner["message"])
        if body.get("message"):
            return str(body["message"])
    try:
        text = error.response.text
    except Exception:
        text = ""
    return text.strip()[:_MAX_ERROR_CHARS] or error.message


def _retry_after(headers: Any) -> float | None:
    try:
        value = headers.get("retry-after")
        return float(value) if value is not None else None
    except (TypeError, ValueError, AttributeError):
        return None


def status_failure(status: int, body: bytes, headers: Any = None) -> RequestFailed:
    """A failure for an HTTP error status, carrying the server's own message (vLLM's error JSON)."""
    message = ""
    try:
        data = _loads(body)
        inner = data.get("error", data) if isinstance(data, dict) else None
        if isinstance(inner, dict) and inner.get("message"):
            message = str(inner["message"])
        elif isinstance(data, dict) and data.get("message"):
            message = str(data["message"])
    except ValueError:
        pass
    if not message:
        message = body.decode(errors="replace").strip()[:_MAX_ERROR_CHARS] or "(empty body)"
    retryable = status in RETRYABLE_STATUS or status >= 500
    return RequestFailed(f"HTTP {status}: {message}", retryable, status, _retry_after(headers))


def classify(error: BaseException) -> RequestFailed:
    """Map any exception of a request attempt to a :class:`RequestFailed` (retryable or not)."""
    if isinstance(error, RequestFailed):
        return error
    if isinstance(error, openai.APIStatusError):
        status = error.status_code
        retryable = status in RETRYABLE_STATUS or status >= 500
        return RequestFailed(f"HTTP {status}: {_server_message(error)}", retryable, status,
                             _retry_after(error.response.headers))
    # Before the timeout branch: the SDK's aiohttp adapter turns a refused connection into APITimeoutError,
    # and "timeout" would send the operator looking at a slow server instead of a down one.
    refused = _connection_cause(error)
    if refused is not None:
        return RequestFailed(f"connection error ({type(refused).__name__}: {refused})", True, kind="connection")
    if isinstance(error, openai.APITimeoutError | httpx2.TimeoutException | TimeoutError):
        return RequestFailed(f"timeout ({type(error).__name__})", True, kind="timeout")
    if isinstance(error, openai.APIConnectionError):
        cause = error.__cause__ or error.__context__
        detail = f"{type(cause).__name__}: {cause}" if cause else str(error)
        return RequestFailed(f"connection error ({detail})", True, kind="connection")
    # httpx errors raised while reading a streamed body, socket errors, anything unexpected: a retry may help,
    # and the message ends up in the failed row if it never does.
    return RequestFailed(f"{type(error).__name__}: {error}", True)


def _connection_cause(error: BaseException) -> BaseException | None:
    """The first ConnectionError / aiohttp.ClientConnectorError in the ``__cause__``/``__context__`` chain
    of ``error`` (itself included), or None. Guards against cycles in the chain."""
    try:
        from aiohttp import ClientConnectorError
    except ImportError:  # pragma: no cover - depends on the environment
        connector_errors: tuple[type[BaseException], ...] = (ConnectionError,)
    else:
        connector_errors = (ConnectionError, ClientConnectorError)
    seen: set[int] = set()
    pending: list[BaseException] = [error]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, connector_errors):
            return current
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return None


def parse_completion(body: bytes) -> Completion:
    """A non-streamed chat completion body -> :class:`Completion`, or a retryable RequestFailed."""
    try:
        data = _loads(body)
    except ValueError as error:
        raise RequestFailed(f"invalid JSON in response body ({len(body)} bytes): {error}", True) from None
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
        raise RequestFailed(f"200 response is not a chat completion: {body[:200]!r}", True)
    choices = data["choices"]
    if not choices:
        raise RequestFailed("chat completion has no choices", True)
    choice = choices[0]
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise RequestFailed("chat completion choice has no message", True)
    finish = choice.get("finish_reason")
    if not finish:
        raise RequestFailed("chat completion has no finish_reason", True)
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")  # vLLM before the rename
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
    return _checked(Completion(
        reasoning, message.get("content"), str(finish), usage.get("prompt_tokens"), usage.get("completion_tokens"),
        data.get("model"), _token_ids(data.get("prompt_token_ids"), "prompt_token_ids"),
        _token_ids(choice.get("token_ids"), "token_ids"),
    ))


class _StreamState:
    __slots__ = ("completion_ids", "content", "done", "finish", "model", "prompt_ids", "reasoning", "usage")

    def __init__(self) -> None:
        self.reasoning: list[str] = []
        self.content: list[str] = []
        # vLLM sends prompt_token_ids in the first chunk and each chunk's new ids in choices[].token_ids
        self.prompt_ids: list[int] | None = None
        self.completion_ids: list[int] | None = None
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.model: str | None = None
        self.done = False

    def feed(self, payload: bytes) -> None:
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            data = _loads(payload)
        except ValueError as error:
            raise RequestFailed(f"invalid JSON in stream event: {error}", True) from None
        if not isinstance(data, dict):
            raise RequestFailed(f"stream event is not a chat completion chunk: {payload[:200]!r}", True)
        if "error" in data:  # vLLM reports a failure inside an already-started stream this way
            err = data["error"]
            message = err.get("message") if isinstance(err, dict) else err
            raise RequestFailed(f"error in stream: {message}", True)
        choices = data.get("choices")
        if not isinstance(choices, list):
            raise RequestFailed(f"stream event is not a chat completion chunk: {payload[:200]!r}", True)
        if self.model is None:
            self.model = data.get("model")
        if self.prompt_ids is None and data.get("prompt_token_ids") is not None:
            self.prompt_ids = _token_ids(data["prompt_token_ids"], "prompt_token_ids")
        for choice in choices:
            ids = choice.get("token_ids")
            if ids is not None:
                if self.completion_ids is None:
                    self.completion_ids = []
                self.completion_ids.extend(_token_ids(ids, "token_ids") or ())
            delta = choice.get("delta") or {}
            piece = delta.get("reasoning")
            if piece is None:
                piece = delta.get("reasoning_content")
            if piece:
                self.reasoning.append(piece)
            piece = delta.get("content")
            if piece:
                self.content.append(piece)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        usage = data.get("usage")
        if isinstance(usage, dict):
            self.usage = usage

    def result(self) -> Completion:
        if self.finish is None:
            raise RequestFailed("truncated stream: it ended without a finish_reason", True)
        usage = self.usage or {}
        return _checked(Completion(
            "".join(self.reasoning) if self.reasoning else None, "".join(self.content) if self.content else None,
            self.finish, usage.get("prompt_tokens"), usage.get("completion_tokens"), self.model, self.prompt_ids,
            self.completion_ids,
        ))


def build_body(model: str, messages: Sequence[Mapping[str, str]], params: Mapping[str, Any], stream: bool,
               ) -> bytes:
    """The request JSON, serialized once here (orjson) instead of by the SDK on every attempt."""
    body: dict[str, Any] = {"model": model, "messages": messages, **params}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return _dumps(body)


async def request_completion(client: openai.AsyncOpenAI, body: bytes, *, stream: bool, deadline_s: float,
                             ) -> Completion:
    """One attempt of POST /chat/completions with the JSON ``body``. Raises :class:`RequestFailed` (classified).

    ``client.post(..., cast_to=httpx2.Response)`` is the SDK's documented route for a raw response: it keeps
    the SDK's transport, auth and error mapping and skips both its request-param transform and its
    response models (several ms of CPU per request together).

    Not streaming, the client's read timeout (``request_timeout_s``) bounds a silent server; streaming, the
    read timeout is the idle timeout and ``deadline_s`` bounds the whole response.
    """
    try:
        if not stream:
            # the SDK's default headers already say Content-Type: application/json
            response = await client.post("/chat/completions", content=body, cast_to=httpx2.Response)
            return parse_completion(response.content)
        async with asyncio.timeout(deadline_s):
            response = await client.post("/chat/completions", content=body, cast_to=httpx2.Response, stream=True)
            try:
                return await read_sse(response.aiter_bytes())
            finally:
                await response.aclose()
    except asyncio.CancelledError:
        raise
    except Exception as error:
        raise classify(error) from error


def parse_sse(data: bytes) -> Completion:
    """Assemble a streamed chat completion from its whole SSE body (see :func:`read_sse`)."""
    state = _StreamState()
    for line in data.split(b"\n"):
        if line.startswith(b"data:"):
            state.feed(line[5:].strip())
            if state.done:
                return state.result()
    raise RequestFailed("truncated stream: it ended without data: [DONE]", True)


async def read_sse(chunks: AsyncIterator[bytes]) -> Completion:
    """Assemble a streamed chat completion from raw SSE bytes (any chunking)."""
    state = _StreamState()
    buffer = b""
    # Split SSE lines by hand: only "data:" lines matter, and the SDK's event objects cost CPU per chunk.
    async for chunk in chunks:
        buffer += chunk
        if b"\n" not in chunk:
            continue
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                state.feed(line[5:].strip())
                if state.done:
                    return state.result()
    if buffer.startswith(b"data:"):
        state.feed(buffer[5:].strip())
    if not state.done:
        raise RequestFailed("truncated stream: it ended without data: [DONE]", True)
    return state.result()
