"""Reply bodies bounded in size for the HTTP clients outside the generation transport (issue 31, clause 5).

A server or proxy that answers 200 and then never ends the body must fail that request instead of growing the
process's memory until the machine runs out: these helpers stop reading a body once it passes its limit.
:mod:`eagle3_assets.generation.transport`'s aiohttp transport bounds the generation requests itself; here are the
same bounds for

- the ``openai`` SDK clients (the generation's ``openai`` transport, the online evaluation, the ``vllm``
  hidden-states backend): an ``httpx2`` client for
  ``openai.AsyncOpenAI(http_client=...)`` whose every response body is capped as it arrives
  (:func:`capped_openai_http_client`), the SDK reading it whole only within the cap;
- ``urllib`` (the probes of :mod:`eagle3_assets.local.vllm_probe`): :func:`read_capped` reads a body in chunks
  within a size limit and a whole-request deadline (urllib's timeout bounds each socket operation, not the body).

The time bound of an SDK request is its caller's (``asyncio.timeout`` around the call): a body trickled a byte at a
time stays under any per-read timeout.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import httpx2

# What a body read here in a fixed cap may weigh (a model list, a /metrics page, a probe): far above any honest one
# (vLLM's /metrics is ~100 KB with every histogram), so only a body that never ends reaches it
PAGE_LIMIT_BYTES = 16 * 2**20
# urllib reads a body this much at a time, checking its size and the deadline in between
READ_CHUNK_BYTES = 64 * 2**10


class ReplyTooLarge(ValueError):
    """A reply body beyond its size limit (a runaway server, or a proxy that never ends the body); a ValueError like
    any other reply that is no answer (invalid JSON).

    ``status``: the response's HTTP status (an error page can run away too: a caller still classifies the failure
    by it); ``declared``: the Content-Length that announced the body, if that is how it was caught; ``encoding``: a
    compressed body's Content-Encoding when that was the refusal (its size is unknown until inflated)."""

    def __init__(
        self,
        what: str,
        limit: int,
        declared: int | None = None,
        *,
        status: int | None = None,
        encoding: str | None = None,
    ) -> None:
        size = "passed" if declared is None else f"announces {declared:,} bytes,"
        super().__init__(
            f"reply too large: the body of {what} {size} beyond the limit of {limit:,} bytes (a runaway server, or a "
            "proxy that never ends the body)"
        )
        self.limit = limit
        self.declared = declared
        self.status = status
        self.encoding = encoding


@functools.cache
def _capped_stream_class() -> type:
    """The class of a capped ``httpx2`` response stream (an ``httpx2.AsyncByteStream``, as its Response requires),
    made on first use: the urllib probes of this module never import httpx2."""
    # lazy: loads httpx2 (heavy), which only this path needs
    import httpx2

    class CappedStream(httpx2.AsyncByteStream):
        """A response stream that raises :class:`ReplyTooLarge` once more than ``limit`` bytes arrived."""

        def __init__(self, stream: httpx2.AsyncByteStream, limit: int, what: str, status: int) -> None:
            self._stream = stream
            self._limit = limit
            self._what = what
            self._status = status

        @property
        def elapsed(self) -> Any:  # httpx2's Response.elapsed reads it from its stream
            return getattr(self._stream, "elapsed", None)

        async def __aiter__(self) -> AsyncIterator[bytes]:
            received = 0
            async for chunk in self._stream:
                received += len(chunk)
                if received > self._limit:
                    raise ReplyTooLarge(self._what, self._limit, status=self._status)
                yield chunk

        async def aclose(self) -> None:
            await self._stream.aclose()

    return CappedStream


def _capping_hook(limit_for: Callable[[httpx2.Request], int]) -> Callable[[httpx2.Response], Awaitable[None]]:
    async def cap(response: httpx2.Response) -> None:
        # lazy: loads httpx2 (heavy), which only this path needs
        import httpx2

        request = response.request
        what = f"{request.method} {request.url.path}"
        limit = limit_for(request)
        status = response.status_code
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding != "identity":
            # identity was asked for: a compressed body could inflate far beyond any limit on the bytes that arrive
            await response.aclose()
            raise ReplyTooLarge(
                f"{what} (Content-Encoding {encoding!r}, not the identity asked for)",
                limit,
                status=status,
                encoding=encoding,
            )
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await response.aclose()
            raise ReplyTooLarge(what, limit, int(declared), status=status)
        stream = response.stream
        assert isinstance(stream, httpx2.AsyncByteStream)
        # every status: the SDK reads an error body whole (err.response.aread()) before it raises its status error
        response.stream = _capped_stream_class()(stream, limit, what, status)

    return cap


def capped_openai_http_client(
    limit_for: Callable[[httpx2.Request], int], *, aiohttp: bool = False, **kwargs: Any
) -> httpx2.AsyncClient:
    """The ``openai`` SDK's default ``httpx2`` client (``openai.DefaultAsyncHttpxClient``, or with ``aiohttp`` its
    aiohttp one, ``openai.DefaultAioHttpClient``; ``kwargs`` passed on), every response body, whatever its status,
    capped at ``limit_for(request)`` bytes: past it, reading the body raises :class:`ReplyTooLarge`, which the SDK
    passes through unwrapped (it is neither an ``httpx2`` nor an SDK error).

    Bodies are asked for uncompressed (``Accept-Encoding: identity``) and a compressed one is refused, so the cap on
    the bytes that arrive is a cap on the body the SDK holds.
    """
    # lazy: loads openai (heavy), which only this path needs
    import openai

    headers = {**kwargs.pop("headers", {}), "Accept-Encoding": "identity"}
    client_class = openai.DefaultAioHttpClient if aiohttp else openai.DefaultAsyncHttpxClient
    return client_class(headers=headers, event_hooks={"response": [_capping_hook(limit_for)]}, **kwargs)


class _Readable(Protocol):
    def read1(self, size: int = ..., /) -> bytes: ...


def read_capped(response: _Readable, what: str, deadline: float, limit: int = PAGE_LIMIT_BYTES) -> bytes:
    """The whole body of a ``urllib`` response within ``limit`` bytes (else :class:`ReplyTooLarge`) and by
    ``deadline`` (``time.monotonic()``; else :class:`TimeoutError`, an OSError as urllib's own timeouts).

    ``read1``: one socket read at a time, so a body trickled a byte at a time meets the deadline check between
    reads; each read is bounded by the socket's own timeout.
    """
    declared = getattr(response, "length", None)  # http.client's remaining Content-Length, None when chunked
    if isinstance(declared, int) and declared > limit:
        raise ReplyTooLarge(what, limit, declared)
    parts: list[bytes] = []
    received = 0
    while chunk := response.read1(READ_CHUNK_BYTES):
        received += len(chunk)
        if received > limit:
            raise ReplyTooLarge(what, limit)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the body of {what} did not end within its deadline ({received:,} bytes arrived)")
        parts.append(chunk)
    return b"".join(parts)
