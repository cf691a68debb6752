"""How requests reach an endpoint (``EAGLE3_TRANSPORT``). Two interchangeable transports, one meaning:

- ``"aiohttp"`` (default): one ``aiohttp.ClientSession`` per endpoint (:func:`aiohttp_session`), the request
  body posted as the engine serialized it, the reply read whole and parsed by
  :mod:`eagle3_assets.generation.replies`. About 1 ms of client CPU per request at C=128
  (``benchmarks/generation_efficiency.py``).
- ``"openai"``: stock ``openai.AsyncOpenAI`` (``max_retries=0``) over the SDK's own aiohttp client
  (``openai.DefaultAioHttpClient``, the ``openai[aiohttp]`` extra), through its documented raw-request route
  (``client.post(..., cast_to=httpx2.Response)``). It costs more CPU per request (the SDK builds an options model
  and an httpx2 request and response each time); it is there for a setup that needs the SDK's HTTP stack.

Both only use their libraries' public APIs, send the same request and classify failures through
:mod:`eagle3_assets.generation.errors`; ``tests/unit/test_generation_transport.py`` pins them to identical results.

Both bound a reply in time and in size, streamed or not: the whole request (connection, request, every byte of the
reply) must end within ``deadline_s`` (a server or proxy that answers 200 and then trickles the body stays under any
per-read timeout), and a body beyond its limit (:func:`eagle3_assets.net.reply_limits.reply_limit`, from
``max_tokens``) fails as soon as it passes it, so a body that never ends cannot exhaust the run's memory. That holds
for every body, an error page's and GET /models' too (a fixed cap), whatever its status; an error status whose body
runs away is still classified by its status.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import urllib.request
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
import orjson

from eagle3_assets.generation.errors import (
    RequestFailed,
    _chain,
    classify,
    deadline_failure,
    status_failure,
    too_large_failure,
)
from eagle3_assets.generation.generation_config import GenerationConfig
from eagle3_assets.generation.replies import CHAT_PATH, Completion, parse_completion, parse_sse, read_sse
from eagle3_assets.net.bounded_http import ReplyTooLarge, capped_openai_http_client
from eagle3_assets.net.reply_limits import ReplyLimit, reply_limit

if TYPE_CHECKING:
    import httpx2

# The session's read buffer: the GET requests' (a chat reply sets its own, its size limit, see _read_body)
READ_BUFSIZE = 32 * 2**20
# GET /models: a list of a few served names; anything near this is no model list
MODEL_LIST_BYTES = 16 * 2**20
# A warm-up GET of /models, one per connection (up to the endpoint's cap, at once): its body is read only so the
# connection goes back to the pool, and an honest one is a few KB; a server that runs away must not cost
# connections x MODEL_LIST_BYTES
WARM_BODY_BYTES = 256 * 2**10
# How often a body read whole checks its size: aiohttp's flow control already stops reading at twice the limit, so
# this only sets how soon an oversized body fails; rarely enough to cost nothing beside a request's ~1 ms of CPU.
BODY_CHECK_S = 0.25
# keep-alive connections beyond the endpoint's cap: a slot freed and refilled at once never waits for a socket
EXTRA_CONNECTIONS = 8


@dataclass(frozen=True)
class Endpoint:
    """One base URL's connection settings, as :func:`make_transports` hands them to either transport."""

    url: str
    authorization: str | None  # the Authorization header's value, None: no header
    connect_s: float
    read_s: float  # the socket read timeout (see make_transports)
    max_connections: int  # the endpoint's cap on requests in flight
    reply_limit: ReplyLimit

    @property
    def pool_size(self) -> int:
        """Keep-alive connections to keep: the cap plus :data:`EXTRA_CONNECTIONS`."""
        return self.max_connections + EXTRA_CONNECTIONS


class Transport(Protocol):
    url: str

    async def complete(self, body: bytes, *, stream: bool, deadline_s: float) -> Completion: ...

    async def list_models(self) -> list[str]: ...

    async def warm(self, connections: int) -> None: ...

    async def close(self) -> None: ...


def aiohttp_session(
    *, limit: int, connect_s: float, read_s: float, headers: Mapping[str, str] | None = None
) -> aiohttp.ClientSession:
    """The one way this project opens an aiohttp session to a server (call it inside the running event loop:
    a session binds to it).

    ``read_s`` is the socket read timeout: with whole-body reads it bounds a silent server, and while a stream
    arrives it is the idle timeout. Proxy environment variables (and NO_PROXY) are honoured when set; when none
    is, aiohttp is not asked to look them up on every request.
    """
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_s, sock_read=read_s)
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=0, keepalive_timeout=60)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        headers=headers,
        read_bufsize=READ_BUFSIZE,
        trust_env=bool(urllib.request.getproxies()),
    )


async def _read_reply(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body of a 2xx ``response`` (within ``limit`` bytes, see :func:`_read_body`); an error status is a
    :func:`status_failure`, also when its body runs past the limit (a runaway error page still says 500 or 401)."""
    try:
        data = await _read_body(response, limit)
    except RequestFailed as too_large:
        if response.status >= 300:
            raise _status_too_large(response.status, too_large, response.headers) from None
        raise
    if response.status >= 300:
        raise status_failure(response.status, data, response.headers)
    return data


def _status_too_large(status: int, too_large: RequestFailed, headers: Mapping[str, str] | None) -> RequestFailed:
    """An error status whose body passed its size limit: classified by the status (retried, benched or stopping the
    run as that status is), the size named in place of the server's message."""
    return status_failure(status, too_large.message.encode(), headers)


async def _read_body(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body of ``response``, or a :class:`RequestFailed` once it passes ``limit`` bytes.

    The task waits for the body's end once (not once per SSE chunk: see AiohttpTransport.complete). The response
    must have been requested with ``read_bufsize=limit``: aiohttp then stops reading the socket once twice the limit
    is buffered, so memory stays bounded between two size checks.
    """
    if response.content_length is not None and response.content_length > limit:
        raise too_large_failure(limit, response.content_length)
    content = response.content
    loop = asyncio.get_running_loop()
    check: asyncio.TimerHandle

    def check_size() -> None:
        nonlocal check
        if content.total_bytes > limit:
            content.set_exception(too_large_failure(limit))  # wakes wait_eof with it
        else:
            check = loop.call_later(BODY_CHECK_S, check_size)

    check = loop.call_later(BODY_CHECK_S, check_size)
    try:
        await content.wait_eof()
    finally:
        check.cancel()
    if content.total_bytes > limit:
        raise too_large_failure(limit)
    return await response.read()


class AiohttpTransport:
    """The default transport: POST /chat/completions over one aiohttp session, the body read in one piece."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.url = endpoint.url
        self._endpoint = endpoint
        self._chat_url = f"{endpoint.url}{CHAT_PATH}"
        self._models_url = f"{endpoint.url}/models"
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if endpoint.authorization:
            self._headers["Authorization"] = endpoint.authorization
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # lazily: the session binds to the running event loop
            endpoint = self._endpoint
            self._session = aiohttp_session(
                limit=endpoint.pool_size, connect_s=endpoint.connect_s, read_s=endpoint.read_s, headers=self._headers
            )
        return self._session

    async def complete(self, body: bytes, *, stream: bool, deadline_s: float) -> Completion:
        limit = self._endpoint.reply_limit.bytes_for(body)
        deadline = asyncio.timeout(deadline_s)
        response: aiohttp.ClientResponse | None = None
        try:
            async with deadline, self._client().post(self._chat_url, data=body, read_bufsize=limit) as response:
                # The whole body at once: a stream still streams and the socket read timeout still is its idle
                # timeout, but this task wakes once per response instead of once per SSE chunk.
                data = await _read_reply(response, limit)
                return parse_sse(data) if stream else parse_completion(data)
        except Exception as error:  # not a cancellation: CancelledError is no Exception
            if deadline.expired():
                received = response.content.total_bytes if response is not None else None
                raise deadline_failure(deadline_s, received) from error
            raise classify(error) from error

    async def list_models(self) -> list[str]:
        try:
            async with self._client().get(self._models_url, read_bufsize=MODEL_LIST_BYTES) as response:
                data = await _read_reply(response, MODEL_LIST_BYTES)
            return _model_ids(data)
        except Exception as error:
            raise classify(error) from error

    async def warm(self, connections: int) -> None:
        async def one() -> None:
            async with self._client().get(self._models_url, read_bufsize=WARM_BODY_BYTES) as response:
                await _read_body(response, WARM_BODY_BYTES)

        await asyncio.gather(*[one() for _ in range(connections)], return_exceptions=True)

    async def close(self) -> None:
        if self._session is not None:
            with contextlib.suppress(Exception):
                await self._session.close()


def _model_ids(data: bytes) -> list[str]:
    try:
        value = orjson.loads(data)
    except ValueError as error:
        raise RequestFailed(f"GET /models: invalid JSON ({error})", True) from None
    models = value.get("data") if isinstance(value, dict) else None
    if not isinstance(models, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in models):
        raise RequestFailed(f"GET /models did not return a model list: {data[:200]!r}", True)
    return [m["id"] for m in models]


@dataclass
class _Meter:
    """Bytes of a body read so far (for the deadline's message)."""

    received: int | None = None


async def _metered(chunks: AsyncIterator[bytes], meter: _Meter) -> AsyncIterator[bytes]:
    """``chunks``, counted into ``meter`` (their size limit is the client's, see OpenAITransport)."""
    meter.received = 0
    async for chunk in chunks:
        meter.received += len(chunk)
        yield chunk


# The size limit of a GET body through the openai transport's client: the model list's, or a warm-up's
_GET_BODY_BYTES: contextvars.ContextVar[int] = contextvars.ContextVar("get_body_bytes", default=MODEL_LIST_BYTES)


class OpenAITransport:
    """Stock ``openai.AsyncOpenAI`` over ``openai.DefaultAioHttpClient``; the reply parsed as raw bytes.

    Every body, whatever its status, is capped as it arrives by the client's response hook
    (:func:`eagle3_assets.net.bounded_http.capped_openai_http_client`): the SDK itself reads an error body whole before
    it raises, and a model list or a warm-up GET whole, where no code of ours could bound it afterwards.
    """

    def __init__(self, endpoint: Endpoint) -> None:
        # lazy: loads httpx2 (heavy), which only this path needs
        import httpx2

        # lazy: loads openai (heavy), which only this path needs
        import openai

        self.url = endpoint.url
        self._reply_limit = endpoint.reply_limit
        self._httpx = httpx2
        timeout = httpx2.Timeout(connect=endpoint.connect_s, read=endpoint.read_s, write=60.0, pool=None)
        limits = httpx2.Limits(max_connections=endpoint.pool_size, max_keepalive_connections=endpoint.pool_size)
        authorization = endpoint.authorization
        self.client = openai.AsyncOpenAI(
            base_url=endpoint.url,
            api_key="EMPTY",  # the SDK insists on a value; the real header (if any) replaces its bearer below
            default_headers={"Authorization": authorization} if authorization else None,
            max_retries=0,  # the engine retries; the SDK's own retries would stack on top
            timeout=timeout,
            http_client=capped_openai_http_client(self._limit_for, aiohttp=True, timeout=timeout, limits=limits),
        )

    def _limit_for(self, request: httpx2.Request) -> int:
        """A chat reply's size limit from its request's max_tokens; GET /models a fixed one (the warm-up's smaller:
        set in its tasks' context, the hook runs in the task that sends the request)."""
        if request.url.path.endswith(CHAT_PATH):
            return self._reply_limit.bytes_for(request.content)
        return _GET_BODY_BYTES.get()

    async def complete(self, body: bytes, *, stream: bool, deadline_s: float) -> Completion:
        raw = self._httpx.Response
        deadline = asyncio.timeout(deadline_s)
        meter = _Meter()
        try:
            async with deadline:
                # stream=True also for a plain reply: the body is then read here (counted for the deadline's
                # message) instead of by the SDK (its default headers already say Content-Type: application/json)
                response = await self.client.post(CHAT_PATH, content=body, cast_to=raw, stream=True)  # type: ignore[call-overload]
                try:
                    chunks = _metered(response.aiter_bytes(), meter)
                    if stream:
                        return await read_sse(chunks)
                    return parse_completion(b"".join([chunk async for chunk in chunks]))
                finally:
                    await response.aclose()
        except Exception as error:  # not a cancellation: CancelledError is no Exception
            if deadline.expired():
                raise deadline_failure(deadline_s, meter.received) from error
            raise sdk_failure(error) from error

    async def list_models(self) -> list[str]:
        try:
            page = await self.client.models.list()
        except Exception as error:
            raise sdk_failure(error) from error
        return [model.id for model in page.data]

    async def warm(self, connections: int) -> None:
        warming = _GET_BODY_BYTES.set(WARM_BODY_BYTES)  # gather's tasks copy this context as they start
        try:
            calls = [self.client.get("/models", cast_to=self._httpx.Response) for _ in range(connections)]
            await asyncio.gather(*calls, return_exceptions=True)
        finally:
            _GET_BODY_BYTES.reset(warming)

    async def close(self) -> None:
        await self.client.close()


def sdk_failure(error: BaseException) -> RequestFailed:
    """The SDK's exceptions as the aiohttp transport reports the same event (:func:`classify` for the rest)."""
    # lazy: loads openai (heavy), which only this path needs
    import openai

    # the client's size cap, raised as the body arrived, or by its hook (and then wrapped by the SDK as a
    # connection error) on a Content-Length or Content-Encoding it refused
    too_large = next((e for e in _chain(error) if isinstance(e, ReplyTooLarge)), None)
    if too_large is not None:
        if too_large.encoding is not None:
            failure = RequestFailed(str(too_large), True)
        else:  # the aiohttp transport's text
            failure = too_large_failure(too_large.limit, too_large.declared)
        if too_large.status is not None and too_large.status >= 300:
            return _status_too_large(too_large.status, failure, None)
        return failure
    if isinstance(error, openai.APIStatusError):
        response: Any = error.response
        try:
            body = response.content  # the SDK reads an error body before it raises
        except Exception:
            body = str(error.message).encode()
        return status_failure(error.status_code, body, response.headers)
    failure = classify(error)
    if failure.kind is None and isinstance(error, openai.APITimeoutError):
        return RequestFailed(f"timeout ({type(error).__name__})", True, kind="timeout")
    if failure.kind is None and isinstance(error, openai.APIConnectionError):
        return RequestFailed(f"connection error ({failure.message})", True, kind="connection")
    return failure


TRANSPORT_KINDS: dict[str, type[AiohttpTransport] | type[OpenAITransport]] = {
    "aiohttp": AiohttpTransport,
    "openai": OpenAITransport,
}


def make_transports(config: GenerationConfig) -> dict[str, Transport]:
    """One transport per base URL.

    Streaming: the read timeout is the idle timeout (no bytes for N s). Not streaming: one read may legitimately last
    the whole request. Either way the whole request is bounded by request_timeout_s (the engine's ``deadline_s``).
    """
    kind = TRANSPORT_KINDS[config.transport]
    read_s = config.idle_timeout_s if config.stream else config.request_timeout_s
    limit = reply_limit(config.max_tokens, config.stream, config.extra_sampling)
    return {
        url: kind(
            Endpoint(
                url,
                config.authorization(url),
                connect_s=config.connect_timeout_s,
                read_s=read_s,
                max_connections=config.endpoint_cap,
                reply_limit=limit,
            )
        )
        for url in config.base_urls
    }


async def close_all(transports: Mapping[str, Transport]) -> None:
    for transport in transports.values():
        with contextlib.suppress(Exception):
            await transport.close()
