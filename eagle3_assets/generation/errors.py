"""What can go wrong with one request, classified: :class:`RequestFailed` (retryable or not) for a sample,
:class:`AuthRejected` for the whole run.

Both transports (:mod:`eagle3_assets.generation.transport`) report through here, so a failure reads the same
whichever HTTP client saw it: one parser for an error body (:func:`error_message`), one mapping of exceptions
(:func:`classify`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import aiohttp
import orjson

RETRYABLE_STATUS = frozenset({408, 409, 429})
# A key the server refuses: every later request would be refused too, so the run stops instead of failing rows.
AUTH_STATUS = frozenset({401, 403})
MAX_ERROR_CHARS = 2000


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
        self.message = message[:MAX_ERROR_CHARS]
        self.retryable = retryable
        self.status = status
        self.retry_after_s = retry_after_s
        # "connection" or "timeout" when the endpoint could not be reached or did not answer (set by classify)
        self.kind = kind

    @property
    def unreachable(self) -> bool:
        return self.kind in ("connection", "timeout")

    @property
    def outage(self) -> bool:
        """The endpoint is down or broken (refused, reset, timed out, 5xx): what benches it.

        A reply that arrives whole but is malformed, a 4xx or a 429 says the server is up and answering: it
        fails the attempt (retried like any retryable failure) and never benches the endpoint, or a server that
        lies on every reply would hold the partition behind benches of minutes instead of failing its rows.
        """
        return self.unreachable or (self.status is not None and self.status >= 500)


class OutageError(RuntimeError):
    """Every endpoint stayed down (benched for outages) for longer than the outage budget: the run stops."""


class AuthRejected(RuntimeError):
    """The server refused the API key (HTTP 401/403) in the middle of a run: the run stops, nothing is marked
    done, and the samples not finished yet stay to do (they are not written as failed rows)."""


def error_message(body: bytes) -> str:
    """The server's own message from an error body: vLLM's ``{"error": {"message"}}``, its older
    ``{"object": "error", "message"}``, or else the body's text (cut to :data:`MAX_ERROR_CHARS`)."""
    try:
        data = orjson.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        inner = data.get("error", data)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
        if data.get("message"):
            return str(data["message"])
    return body.decode(errors="replace").strip()[:MAX_ERROR_CHARS] or "(empty body)"


def status_failure(status: int, body: bytes, headers: Mapping[str, str] | None = None) -> RequestFailed:
    """A failure for an HTTP error status, carrying the server's message and its Retry-After, if any."""
    retryable = status in RETRYABLE_STATUS or status >= 500
    return RequestFailed(f"HTTP {status}: {error_message(body)}", retryable, status, _retry_after(headers))


def deadline_failure(deadline_s: float, received: int | None) -> RequestFailed:
    """A request whose reply did not end within its whole-request deadline, however steadily bytes arrived (a
    server or proxy trickling a body stays under any idle timeout): retryable, and a timeout like a silent one."""
    arrived = "" if received is None else f" ({received:,} bytes of it had arrived)"
    return RequestFailed(
        f"timeout: the reply did not end within the request timeout of {deadline_s:g} s (EAGLE3_REQUEST_TIMEOUT_S)"
        f"{arrived}",
        True,
        kind="timeout",
    )


def too_large_failure(limit: int, declared: int | None = None) -> RequestFailed:
    """A reply body beyond its size limit (:func:`eagle3_assets.net.reply_limits.reply_limit`): a runaway server
    or a lying proxy. The server answered, so it is retried like a malformed reply and never benches the endpoint.

    ``declared``: the Content-Length that announced it; else the body passed the limit while arriving (how far
    depends on the client's buffering, so it is not said: both transports report the same text)."""
    what = "passed" if declared is None else f"announces {declared:,} bytes,"
    return RequestFailed(
        f"reply too large: its body {what} beyond the limit of {limit:,} bytes this request's max_tokens allows "
        "(a runaway server, or a proxy that never ends the body)",
        True,
    )


def _retry_after(headers: Mapping[str, str] | None) -> float | None:
    try:
        value = headers.get("retry-after") if headers is not None else None
        return float(value) if value is not None else None
    except (TypeError, ValueError, AttributeError):
        return None


def classify(error: BaseException) -> RequestFailed:
    """Map any exception of a request attempt to a :class:`RequestFailed` (retryable or not).

    The message names the deepest cause of its kind in the ``__cause__``/``__context__`` chain, which is the
    aiohttp (or socket) error under whichever client wrapped it, so both transports report a failure alike.
    """
    if isinstance(error, RequestFailed):
        return error
    chain = list(_chain(error))
    # Before timeouts: a refused connection can surface as a timeout from some clients, and "timeout" would send
    # the operator looking at a slow server instead of a down one.
    refused = _last(chain, (ConnectionError, aiohttp.ClientConnectorError))
    if refused is not None:
        return RequestFailed(f"connection error ({_describe(refused)})", True, kind="connection")
    timeout = _last(chain, (TimeoutError,))
    if timeout is not None:
        return RequestFailed(f"timeout ({type(timeout).__name__})", True, kind="timeout")
    broken = _last(chain, (aiohttp.ClientError, OSError))
    if broken is not None:  # a reset or a body cut short: the server was reached, the exchange broke
        return RequestFailed(f"connection error ({_describe(broken)})", True, kind="connection")
    # anything unexpected: a retry may help, and the message ends up in the failed row if it never does
    return RequestFailed(_describe(error), True)


def _describe(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and its causes and contexts, breadth first, each once (the chain may have cycles)."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)


def _last(chain: list[BaseException], types: tuple[type[BaseException], ...]) -> BaseException | None:
    """The deepest exception of ``types`` in the chain, or None."""
    found = None
    for error in chain:
        if isinstance(error, types):
            found = error
    return found


def auth_failure_text(failure: RequestFailed, where: str, *, left: int, finished: int) -> str:
    """The error a run stops with when the server refuses the key mid-run."""
    return (
        f"{where} refused the API key mid-run ({failure.message}): the run stopped. Check EAGLE3_API_KEY (or the "
        f"server's --api-key), then run the partition again: {finished} samples finished and are kept, "
        f"{left} were not requested (none is written as failed)."
    )
