"""How requests reach an endpoint. Two interchangeable transports with the same classification:

- ``"openai"`` (default): ``openai.AsyncOpenAI`` (:class:`~eagle3_assets.generation.client.EngineAsyncOpenAI`,
  ``max_retries=0``) over an httpx2 client with a lean aiohttp transport; the raw response is parsed here (see
  :mod:`eagle3_assets.generation.client`).
- ``"aiohttp"``: one ``aiohttp.ClientSession`` per endpoint, no SDK. Measured on these 2-core machines the SDK's
  request machinery (``AsyncOpenAI.request``, the httpx2 client and its request/response objects) still costs
  ~0.5-0.7 ms of CPU per request more: ~1.3-1.9 ms against ~0.85-1.25 ms for the whole call at C=128, depending
  on how busy the machine is (``benchmarks/generation_efficiency.py`` runs both side by side).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any, Protocol

import httpx2

from eagle3_assets.generation.client import (
    READ_BUFSIZE,
    Completion,
    RequestFailed,
    classify,
    make_client,
    parse_completion,
    parse_sse,
    request_completion,
    status_failure,
)
from eagle3_assets.generation.config import GenerationConfig

TRANSPORTS = ("openai", "aiohttp")


class Transport(Protocol):
    url: str

    async def complete(self, body: bytes, *, stream: bool, deadline_s: float) -> Completion: ...

    async def list_models(self) -> list[str]: ...

    async def warm(self, connections: int) -> None: ...

    async def close(self) -> None: ...


class OpenAITransport:
    def __init__(self, url: str, api_key: str | None, *, connect_s: float, read_s: float, max_connections: int):
        self.url = url
        self.client = make_client(url, api_key, connect_s=connect_s, read_s=read_s, max_connections=max_connections)

    async def complete(self, body: bytes, *, stream: bool, deadline_s: float) -> Completion:
        return await request_completion(self.client, body, stream=stream, deadline_s=deadline_s)

    async def list_models(self) -> list[str]:
        try:
            page = await self.client.models.list()
        except Exception as error:
            raise classify(error) from error
        return [model.id for model in page.data]

    async def warm(self, connections: int) -> None:
        calls = [self.client.get("/models", cast_to=httpx2.Response) for _ in range(connections)]
        await asyncio.gather(*calls, return_exceptions=True)

    async def close(self) -> None:
        await self.client.close()


class AiohttpTransport:
    def __init__(self, url: str, api_key: str | None, *, connect_s: float, read_s: float, max_connections: int):
        self.url = url
        self._chat_url = f"{url}/chat/completions"
        self._models_url = f"{url}/models"
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._connect_s = connect_s
        self._read_s = read_s
        self._limit = max_connections + 8
        self._session: Any = None

    def _client(self) -> Any:
        # Created lazily: an aiohttp session binds to the running event loop.
        if self._session is None:
            import aiohttp

            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_s, sock_read=self._read_s)
            connector = aiohttp.TCPConnector(limit=self._limit, limit_per_host=0, keepalive_timeout=60)
            # A read buffer far above any response (8k tokens streamed one per chunk is ~2 MB): wait_eof() below
            # relies on aiohttp never pausing the socket for a full buffer, since nothing drains it meanwhile.
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=timeout, headers=self._headers, read_bufsize=READ_BUFSIZE
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
        except asyncio.CancelledError:
            raise
        except Exception as error:
            raise classify(error) from error

    async def list_models(self) -> list[str]:
        try:
            async with self._client().get(self._models_url) as response:
                data = await response.read()
                if response.status >= 300:
                    raise status_failure(response.status, data, response.headers)
                return [str(model["id"]) for model in _json(data).get("data", [])]
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


def _json(data: bytes) -> dict[str, Any]:
    import orjson

    value = orjson.loads(data)
    if not isinstance(value, dict):
        raise RequestFailed("GET /models did not return a JSON object", True)
    return value


def make_transports(config: GenerationConfig) -> dict[str, Transport]:
    """One transport per base URL.

    Streaming: the read timeout is the idle timeout (no bytes for N s); the whole request is bounded by
    request_timeout_s. Not streaming: one read may legitimately last the whole request.
    """
    kind = {"openai": OpenAITransport, "aiohttp": AiohttpTransport}[config.transport]
    read_s = config.idle_timeout_s if config.stream else config.request_timeout_s
    return {
        url: kind(
            url, config.api_key, connect_s=config.connect_timeout_s, read_s=read_s, max_connections=config.endpoint_cap
        )
        for url in config.base_urls
    }


async def close_all(transports: Mapping[str, Transport]) -> None:
    for transport in transports.values():
        with contextlib.suppress(Exception):
            await transport.close()
