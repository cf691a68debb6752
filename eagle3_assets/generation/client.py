"""One chat-completion request through ``openai.AsyncOpenAI``, classified into a result or an error.

The SDK is the transport (auth, headers, base URL, connection pool) with its own retries off (``max_retries=0``) so
they never stack with the engine's. The response body is read raw and parsed here: building the SDK's pydantic
models costs several ms of CPU per request, which at C=128 on two cores is the difference between a saturated
server and an idle one. For the same reason the request goes through ``AsyncOpenAI.request`` with options and
headers built once per client (:class:`EngineAsyncOpenAI`), over an httpx2 client whose transport reads each body
in one piece (:class:`AiohttpBodyTransport`): 0.4-0.8 ms of client CPU per request less than ``client.post`` over
the SDK's own aiohttp client (more on a busier machine), the same request on the wire, the same errors
(``tests/unit/test_generation_transport.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import urllib.request
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx2
import openai
from openai import NotGiven
from openai._models import FinalRequestOptions

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

    def __init__(
        self,
        message: str,
        retryable: bool,
        status: int | None = None,
        retry_after_s: float | None = None,
        kind: str | None = None,
    ):
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


CHAT_PATH = "/chat/completions"


@dataclass(frozen=True)
class _ChatTemplate:
    """What the SDK builds for every POST /chat/completions of one client, but the body."""

    key: tuple[Any, ...]  # (api_key, base_url, timeout, security) it was built for: any change rebuilds it
    url: httpx2.URL
    headers: httpx2.Headers  # auth included; no Content-Length
    extensions: dict[str, Any]


class EngineAsyncOpenAI(openai.AsyncOpenAI):
    """``openai.AsyncOpenAI`` with a lean path for its one hot request, POST /chat/completions with a body the
    caller serialized: :meth:`post_chat`.

    Per call the SDK's ``post`` builds a pydantic options model (~35 us here), and ``_build_request`` merges header
    dicts, parses and re-joins the URL three times and normalizes the header list twice (~0.25 ms), for a URL and
    headers that never change between these requests. So the first one is built by the SDK's own
    ``_build_request`` and its URL, headers and timeout extension are kept; later ones copy them and add the body.
    Anything else (other paths, per-call headers, timeouts or options, an SDK retry, an idempotency header, a
    changed API key, base URL or timeout) takes the SDK's own path. All the rest (``AsyncOpenAI.request``: auth
    hooks, the send, status and transport error mapping) is the SDK's.
    """

    _chat_template: _ChatTemplate | None = None
    _chat_options: FinalRequestOptions | None = None

    @property
    def user_agent(self) -> str:
        # the SDK names the class in its User-Agent: say AsyncOpenAI, as the stock client does
        return super().user_agent.replace(type(self).__name__, openai.AsyncOpenAI.__name__, 1)

    async def post_chat(self, body: bytes, *, stream: bool) -> httpx2.Response:
        """``post(CHAT_PATH, content=body, cast_to=httpx2.Response, stream=stream)``, without building the options
        model from keyword arguments on every call."""
        if self._chat_options is None:
            # The SDK draws a uuid4 idempotency key per request for a header that this client (OpenAI's) never sends
            # (_idempotency_header is None); a fixed key spares that, and is only set when nothing would send it.
            key = "unsent" if self._idempotency_header is None else None
            self._chat_options = FinalRequestOptions.construct(
                method="post", url=CHAT_PATH, content=b"", idempotency_key=key
            )
        options = self._chat_options.model_copy(update={"content": body})
        return await self.request(httpx2.Response, options, stream=stream)

    def _build_request(self, options: FinalRequestOptions, *, retries_taken: int = 0) -> httpx2.Request:
        body = options.content
        if (
            type(body) is not bytes
            or options.url != CHAT_PATH
            or options.method != "post"
            or retries_taken != 0
            or not isinstance(options.headers, NotGiven)
            or not isinstance(options.timeout, NotGiven)
            or options.params
            or options.json_data is not None
            or options.extra_json is not None
            or options.files is not None
            or self._idempotency_header is not None
        ):
            return super()._build_request(options, retries_taken=retries_taken)
        key = (self.api_key, self.base_url, self.timeout, options.security)
        template = self._chat_template
        if template is None or template.key != key:
            template = self._chat_template = self._make_chat_template(options, key)
        headers = template.headers.copy()  # a list copy, the encoding carried over
        headers["Content-Length"] = str(len(body))  # last, where httpx2 puts it
        # stream=: httpx2 adds no headers of its own then (Host and the rest are in the template already)
        request = httpx2.Request(
            "POST", template.url, headers=headers, stream=httpx2.ByteStream(body), extensions=template.extensions
        )
        request.read()  # the body as .content, as httpx2 does for content=bytes
        return request

    def _make_chat_template(self, options: FinalRequestOptions, key: tuple[Any, ...]) -> _ChatTemplate:
        request = super()._build_request(options.model_copy(update={"content": b""}), retries_taken=0)
        headers = httpx2.Headers([(k, v) for k, v in request.headers.raw if k.lower() != b"content-length"])
        headers.encoding  # noqa: B018 - worked out once here, then carried by every copy
        return _ChatTemplate(key, request.url, headers, dict(request.extensions))


def make_client(
    base_url: str,
    api_key: str | None,
    *,
    connect_s: float,
    read_s: float,
    max_connections: int,
) -> openai.AsyncOpenAI:
    """An SDK client for one endpoint: no SDK retries, the given timeouts, a pool as big as the cap.

    Its HTTP client is an ``httpx2.AsyncClient`` (the SDK's documented ``http_client`` hook) over
    :class:`AiohttpBodyTransport`; measured here, the SDK's default httpx2 pool costs about twice the CPU per
    request, and its own aiohttp adapter (``openai.DefaultAioHttpClient``) iterates each body in 16 KiB pieces
    through httpx2's stream layers. With proxy environment variables set, that adapter is used as it is: it
    applies them (and NO_PROXY) per URL.
    """
    timeout = httpx2.Timeout(connect=connect_s, read=read_s, write=60.0, pool=None)
    limits = httpx2.Limits(max_connections=max_connections + 8, max_keepalive_connections=max_connections + 8)
    if urllib.request.getproxies():
        http_client: httpx2.AsyncClient = openai.DefaultAioHttpClient(timeout=timeout, limits=limits)
    else:
        ssl_context = httpx2.create_ssl_context() if base_url.startswith("https:") else None
        transport = AiohttpBodyTransport(max_connections + 8, ssl_context)
        # follow_redirects as the SDK's own clients
        http_client = httpx2.AsyncClient(timeout=timeout, limits=limits, transport=transport, follow_redirects=True)
    return EngineAsyncOpenAI(
        base_url=base_url,
        # vLLM without --api-key accepts anything; the SDK insists on a value
        api_key=api_key or "EMPTY",
        max_retries=0,
        timeout=timeout,
        http_client=http_client,
    )


# A read buffer far above any response (8k tokens streamed one per chunk, token ids included, is ~2 MB): reading
# a body whole after wait_eof() relies on aiohttp never pausing the socket for a full buffer.
READ_BUFSIZE = 32 * 2**20


class AiohttpBodyTransport(httpx2.AsyncBaseTransport):
    """An httpx2 transport over one ``aiohttp.ClientSession`` that hands over each response body in one piece.

    Like the SDK's vendored aiohttp transport (same error mapping, same request: the SDK's headers, no redirects,
    no decompression, httpx2's timeouts as aiohttp's socket timeouts) with less work per request: the headers are
    converted to aiohttp's once per distinct header set, and the body is read when the server has sent all of it,
    so a request wakes its task once instead of once per 16 KiB (streaming: once per SSE chunk). The socket read
    timeout is still the idle timeout.
    """

    def __init__(self, limit: int, ssl_context: Any = None) -> None:
        self._limit = limit
        self._ssl = ssl_context
        self._session: Any = None
        self._headers: dict[tuple[tuple[bytes, bytes], ...], Any] = {}
        self._timeouts: dict[tuple[Any, ...], Any] = {}

    def _client(self) -> Any:
        # created lazily: an aiohttp session binds to the running event loop
        if self._session is None:
            import aiohttp

            connector = aiohttp.TCPConnector(
                limit=self._limit,
                limit_per_host=0,
                keepalive_timeout=60,
                ssl=self._ssl if self._ssl is not None else True,
            )
            self._session = aiohttp.ClientSession(connector=connector, read_bufsize=READ_BUFSIZE)
        return self._session

    def _aiohttp_headers(self, headers: httpx2.Headers) -> Any:
        # without Content-Length, which differs per body: aiohttp sets it from the payload
        key = tuple(pair for pair in headers.raw if pair[0].lower() != b"content-length")
        converted = self._headers.get(key)
        if converted is None:
            from multidict import CIMultiDict

            if len(self._headers) >= 64:
                self._headers.clear()
            encoding = headers.encoding
            converted = CIMultiDict((k.decode(encoding), v.decode(encoding)) for k, v in key)
            self._headers[key] = converted  # aiohttp copies it for each request, never changes it
        return converted

    def _aiohttp_timeout(self, timeout: Mapping[str, Any]) -> Any:
        key = (timeout.get("connect"), timeout.get("read"), timeout.get("pool"))
        converted = self._timeouts.get(key)
        if converted is None:
            import aiohttp

            converted = aiohttp.ClientTimeout(total=None, sock_connect=key[0], sock_read=key[1], connect=key[2])
            self._timeouts[key] = converted
        return converted

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        with _mapped_errors():
            response = await self._client().request(
                request.method,
                str(request.url),
                headers=self._aiohttp_headers(request.headers),
                data=request.content or None,
                allow_redirects=False,
                auto_decompress=False,
                compress=False,
                timeout=self._aiohttp_timeout(request.extensions.get("timeout", {})),
            )
            if not response.headers.get("Content-Type", "").startswith("text/event-stream"):
                # A JSON body (a completion, a model list, an error): read here, where the SDK would read it right
                # away too, which spares httpx2's chain of body iterators on the way up.
                try:
                    await response.content.wait_eof()
                    data = await response.read()
                finally:
                    response.release()
                return httpx2.Response(
                    status_code=response.status, headers=response.raw_headers, content=data, request=request
                )
        # SSE: read when the caller iterates the body (a stream's errors surface there, as with any httpx2 transport)
        return httpx2.Response(
            status_code=response.status, headers=response.raw_headers, stream=_WholeBody(response), request=request
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class _WholeBody(httpx2.AsyncByteStream):
    """A response body as one chunk, read once the server has sent all of it."""

    __slots__ = ("_response",)

    def __init__(self, response: Any) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _mapped_errors():
            await self._response.content.wait_eof()
            data = await self._response.read()
        if data:
            yield data

    async def aclose(self) -> None:
        with _mapped_errors():
            await self._response.__aexit__(None, None, None)


@contextlib.contextmanager
def _mapped_errors() -> Iterator[None]:
    """aiohttp errors as httpx2 errors, mapped as the SDK's vendored aiohttp transport maps them (the SDK then
    raises APITimeoutError / APIConnectionError; :func:`classify` looks through to the aiohttp cause)."""
    try:
        yield
    except Exception as error:
        mapped = None
        for source, target in _aiohttp_error_map():
            if isinstance(error, source) and (mapped is None or issubclass(target, mapped)):
                mapped = target
        if mapped is None:
            raise
        raise mapped(str(error)) from error


@functools.cache
def _aiohttp_error_map() -> tuple[tuple[type[BaseException], type[Exception]], ...]:
    import aiohttp

    return (
        (aiohttp.ServerTimeoutError, httpx2.TimeoutException),
        (aiohttp.SocketTimeoutError, httpx2.ReadTimeout),
        (aiohttp.ClientConnectionError, httpx2.ConnectTimeout),
        (aiohttp.ClientConnectorError, httpx2.ConnectError),
        (aiohttp.ClientPayloadError, httpx2.ReadError),
        (aiohttp.ClientProxyConnectionError, httpx2.ProxyError),
        (aiohttp.ClientHttpProxyError, httpx2.ProxyError),
        (aiohttp.NonHttpUrlClientError, httpx2.UnsupportedProtocol),
        (aiohttp.InvalidUrlClientError, httpx2.UnsupportedProtocol),
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
        return RequestFailed(
            f"HTTP {status}: {_server_message(error)}", retryable, status, _retry_after(error.response.headers)
        )
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
    return _checked(
        Completion(
            reasoning,
            message.get("content"),
            str(finish),
            usage.get("prompt_tokens"),
            usage.get("completion_tokens"),
            data.get("model"),
            _token_ids(data.get("prompt_token_ids"), "prompt_token_ids"),
            _token_ids(choice.get("token_ids"), "token_ids"),
        )
    )


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
                # each chunk's list is only checked for being one here; its items once, whole, in result()
                if type(ids) is not list:
                    raise RequestFailed(f"token_ids is not a list of non-negative integers: {str(ids)[:200]}", True)
                if self.completion_ids is None:
                    self.completion_ids = ids  # a fresh list from the parser: extended in place from here on
                else:
                    self.completion_ids += ids
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
        return _checked(
            Completion(
                "".join(self.reasoning) if self.reasoning else None,
                "".join(self.content) if self.content else None,
                self.finish,
                usage.get("prompt_tokens"),
                usage.get("completion_tokens"),
                self.model,
                self.prompt_ids,
                _token_ids(self.completion_ids, "token_ids"),
            )
        )


def build_body(
    model: str,
    messages: Sequence[Mapping[str, str]],
    params: Mapping[str, Any],
    stream: bool,
) -> bytes:
    """The request JSON, serialized once here (orjson) instead of by the SDK on every attempt."""
    body: dict[str, Any] = {"model": model, "messages": messages, **params}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return _dumps(body)


async def request_completion(
    client: openai.AsyncOpenAI,
    body: bytes,
    *,
    stream: bool,
    deadline_s: float,
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
            response = await _post_chat(client, body, stream=False)
            return parse_completion(response.content)
        async with asyncio.timeout(deadline_s):
            response = await _post_chat(client, body, stream=True)
            try:
                return await read_sse(response.aiter_bytes())
            finally:
                await response.aclose()
    except asyncio.CancelledError:
        raise
    except Exception as error:
        raise classify(error) from error


async def _post_chat(client: openai.AsyncOpenAI, body: bytes, *, stream: bool) -> httpx2.Response:
    if isinstance(client, EngineAsyncOpenAI):
        return await client.post_chat(body, stream=stream)
    return await client.post(CHAT_PATH, content=body, cast_to=httpx2.Response, stream=stream)


def parse_sse(data: bytes) -> Completion:
    """Assemble a streamed chat completion from its whole SSE body (see :func:`read_sse`)."""
    state = _StreamState()
    if _feed_lines(state, data):
        return state.result()
    raise RequestFailed("truncated stream: it ended without data: [DONE]", True)


def _feed_lines(state: _StreamState, data: bytes) -> bool:
    """Feed the ``data:`` lines of ``data`` (whole lines); True once ``data: [DONE]`` came."""
    # SSE lines split by hand: only "data:" lines matter, and the SDK's event objects cost CPU per event
    for line in data.split(b"\n"):
        if line[:5] == b"data:":
            state.feed(line[5:].strip())
            if state.done:
                return True
    return False


async def read_sse(chunks: AsyncIterator[bytes]) -> Completion:
    """Assemble a streamed chat completion from raw SSE bytes (any chunking; the engine's transport hands over a
    whole body as one chunk)."""
    state = _StreamState()
    pending = b""
    async for chunk in chunks:
        if pending:
            chunk = pending + chunk
        end = chunk.rfind(b"\n")
        if end < 0:
            pending = chunk
            continue
        pending = chunk[end + 1 :]
        if _feed_lines(state, chunk[:end]):
            return state.result()
    if _feed_lines(state, pending):
        return state.result()
    raise RequestFailed("truncated stream: it ended without data: [DONE]", True)
