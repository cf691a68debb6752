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
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections.abc import Mapping
from typing import Any, Protocol

import aiohttp
import orjson

from eagle3_assets.generation.config import GenerationConfig
from eagle3_assets.generation.errors import RequestFailed, classify, status_failure
from eagle3_assets.generation.replies import CHAT_PATH, Completion, parse_completion, parse_sse, read_sse

# A read buffer far above any response (8k tokens streamed one per chunk, token ids included, is ~2 MB): reading a
# body whole after wait_eof() relies on aiohttp never pausing the socket for a full buffer, as nothing drains it.
READ_BUFSIZE = 32 * 2**20
# keep-alive connections beyond the endpoint's cap: a slot freed and refilled at once never waits for a socket
EXTRA_CONNECTIONS = 8


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


class AiohttpTransport:
    """The default transport: POST /chat/completions over one aiohttp session, the body read in one piece."""

    def __init__(
        self, url: str, authorization: str | None, *, connect_s: float, read_s: float, max_connections: int
    ) -> None:
        self.url = url
        self._chat_url = f"{url}{CHAT_PATH}"
        self._models_url = f"{url}/models"
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if authorization:
            self._headers["Authorization"] = authorization
        self._connect_s = connect_s
        self._read_s = read_s
        self._limit = max_connections + EXTRA_CONNECTIONS
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # lazily: the session binds to the running event loop
            self._session = aiohttp_session(
                limit=self._limit, connect_s=self._connect_s, read_s=self._read_s, headers=self._headers
            )
        return self._session

    async def complete(self, body: bytes, *, stream: bool, deadline_s: float) -> Completion:
        try:
            if not stream:
                async with self._client().post(self._chat_url, data=body) as response:
                    data = await response.read()
                    if response.status >= 300:
                        raise status_failure(response.status, data, response.headers)
                    return parse_completion(data)
            async with asyncio.timeout(deadline_s), self._client().post(self._chat_url, data=body) as response:
                if response.status >= 300:
                    raise status_failure(response.status, await response.read(), response.headers)
                # The whole body at once: the server still streams and the socket read timeout still is the
                # idle timeout, but this task wakes once per response instead of once per SSE chunk.
                await response.content.wait_eof()
                return parse_sse(await response.read())
        except Exception as error:  # not a cancellation: CancelledError is no Exception
            raise classify(error) from error

    async def list_models(self) -> list[str]:
        try:
            async with self._client().get(self._models_url) as response:
                data = await response.read()
                if response.status >= 300:
                    raise status_failure(response.status, data, response.headers)
            return _model_ids(data)
        except Exception as error:
            raise classify(error) from error

    async def warm(self, connections: int) -> None:
        async def one() -> None:
            async with self._client().get(self._models_url) as response:
                await response.read()

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


class OpenAITransport:
    """Stock ``openai.AsyncOpenAI`` over ``openai.DefaultAioHttpClient``; the reply parsed as raw bytes."""

    def __init__(
        self, url: str, authorization: str | None, *, connect_s: float, read_s: float, max_connections: int
    ) -> None:
        import httpx2
        import openai

        self.url = url
        self._httpx = httpx2
        timeout = httpx2.Timeout(connect=connect_s, read=read_s, write=60.0, pool=None)
        limit = max_connections + EXTRA_CONNECTIONS
        limits = httpx2.Limits(max_connections=limit, max_keepalive_connections=limit)
        self.client = openai.AsyncOpenAI(
            base_url=url,
            api_key="EMPTY",  # the SDK insists on a value; the real header (if any) replaces its bearer below
            default_headers={"Authorization": authorization} if authorization else None,
            max_retries=0,  # the engine retries; the SDK's own retries would stack on top
            timeout=timeout,
            http_client=openai.DefaultAioHttpClient(timeout=timeout, limits=limits),
        )

    async def complete(self, body: bytes, *, stream: bool, deadline_s: float) -> Completion:
        raw = self._httpx.Response
        try:
            if not stream:
                # the SDK's default headers already say Content-Type: application/json
                response = await self.client.post(CHAT_PATH, content=body, cast_to=raw)
                return parse_completion(response.content)
            async with asyncio.timeout(deadline_s):
                response = await self.client.post(CHAT_PATH, content=body, cast_to=raw, stream=True)  # type: ignore[call-overload]
                try:
                    return await read_sse(response.aiter_bytes())
                finally:
                    await response.aclose()
        except Exception as error:  # not a cancellation: CancelledError is no Exception
            raise sdk_failure(error) from error

    async def list_models(self) -> list[str]:
        try:
            page = await self.client.models.list()
        except Exception as error:
            raise sdk_failure(error) from error
        return [model.id for model in page.data]

    async def warm(self, connections: int) -> None:
        calls = [self.client.get("/models", cast_to=self._httpx.Response) for _ in range(connections)]
        await asyncio.gather(*calls, return_exceptions=True)

    async def close(self) -> None:
        await self.client.close()


def sdk_failure(error: BaseException) -> RequestFailed:
    """The SDK's exceptions as the aiohttp transport reports the same event (:func:`classify` for the rest)."""
    import openai

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

    Streaming: the read timeout is the idle timeout (no bytes for N s); the whole request is bounded by
    request_timeout_s. Not streaming: one read may legitimately last the whole request.
    """
    kind = TRANSPORT_KINDS[config.transport]
    read_s = config.idle_timeout_s if config.stream else config.request_timeout_s
    return {
        url: kind(
            url,
            config.authorization(url),
            connect_s=config.connect_timeout_s,
            read_s=read_s,
            max_connections=config.endpoint_cap,
        )
        for url in config.base_urls
    }


async def close_all(transports: Mapping[str, Transport]) -> None:
    for transport in transports.values():
        with contextlib.suppress(Exception):
            await transport.close()
