"""A chat-completion request body out, a checked :class:`Completion` back.

The response body is parsed here from raw bytes (orjson), not through an SDK's pydantic models: building those
costs several ms of CPU per request, which at C=128 on two cores is the difference between a saturated server and
an idle one. Every field the row keeps is type-checked on the way in: a server that sends a list as ``content``
or usage counts as strings gets a retryable :class:`RequestFailed` naming the field, never a row that breaks the
partition's Parquet later.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from eagle3_assets.generation.errors import RequestFailed

CHAT_PATH = "/chat/completions"


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


def build_body(model: str, messages: Sequence[Mapping[str, str]], params: Mapping[str, Any], stream: bool) -> bytes:
    """The request JSON, serialized once per sample (orjson) and reused by its retries."""
    body: dict[str, Any] = {"model": model, "messages": messages, **params}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


# ------------------------------------------------------------------------------------------ field checks


_JSON_TYPES = {
    dict: "an object",
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
}


def _wrong(field: str, value: Any, expected: str) -> RequestFailed:
    # the JSON type, not the value: a wrong content can be long, and the row keeps this text
    negative = type(value) is int and value < 0
    found = "a negative number" if negative else _JSON_TYPES.get(type(value), type(value).__name__)
    return RequestFailed(f"reply field {field} is {found}, expected {expected}", True)


def _text(value: Any, field: str) -> str | None:
    if value is None or type(value) is str:
        return value
    raise _wrong(field, value, "a string or null")


def _count(value: Any, field: str) -> int | None:
    if value is None or (type(value) is int and value >= 0):
        return value
    raise _wrong(field, value, "a non-negative integer or null")


def _object(value: Any, field: str) -> dict[str, Any] | None:
    if value is None or type(value) is dict:
        return value
    raise _wrong(field, value, "an object or null")


def _token_ids(value: Any, what: str) -> list[int] | None:
    """A token-id list from the body, or None when absent; anything else is a body we cannot trust (retryable)."""
    if value is None:
        return None
    if not isinstance(value, list) or (value and (set(map(type, value)) != {int} or min(value) < 0)):
        raise RequestFailed(f"{what} is not a list of non-negative integers: {str(value)[:200]}", True)
    return value


def _usage(value: Any) -> tuple[int | None, int | None]:
    usage = _object(value, "usage") or {}
    return (
        _count(usage.get("prompt_tokens"), "usage.prompt_tokens"),
        _count(usage.get("completion_tokens"), "usage.completion_tokens"),
    )


def _checked(completion: Completion) -> Completion:
    """Token ids must agree with the usage counts they come with: a server whose two accounts differ lies in one."""
    for ids, count, what in (
        (completion.prompt_token_ids, completion.prompt_tokens, "prompt_token_ids"),
        (completion.completion_token_ids, completion.completion_tokens, "token_ids"),
    ):
        if ids is not None and count is not None and len(ids) != count:
            raise RequestFailed(f"{what} has {len(ids)} ids but usage says {count} tokens", True)
    return completion


# ------------------------------------------------------------------------------------------ one body


def parse_completion(body: bytes) -> Completion:
    """A non-streamed chat completion body -> :class:`Completion`, or a retryable RequestFailed."""
    try:
        data = orjson.loads(body)
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
    reasoning = _text(message.get("reasoning"), "choices[0].message.reasoning")
    if reasoning is None:  # vLLM before the rename
        reasoning = _text(message.get("reasoning_content"), "choices[0].message.reasoning_content")
    prompt_tokens, completion_tokens = _usage(data.get("usage"))
    return _checked(
        Completion(
            reasoning,
            _text(message.get("content"), "choices[0].message.content"),
            _text(finish, "choices[0].finish_reason"),  # type: ignore[arg-type]  # not None: checked above
            prompt_tokens,
            completion_tokens,
            _text(data.get("model"), "model"),
            _token_ids(data.get("prompt_token_ids"), "prompt_token_ids"),
            _token_ids(choice.get("token_ids"), "token_ids"),
        )
    )


# ------------------------------------------------------------------------------------------ a stream


class StreamState:
    """A streamed chat completion assembled event by event (``data:`` payloads of its SSE body)."""

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
            data = orjson.loads(payload)
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
            self.model = _text(data.get("model"), "model")
        if self.prompt_ids is None and data.get("prompt_token_ids") is not None:
            self.prompt_ids = _token_ids(data["prompt_token_ids"], "prompt_token_ids")
        for choice in choices:
            self._feed_choice(choice)
        usage = data.get("usage")
        if usage is not None:
            self.usage = _object(usage, "usage")

    def _feed_choice(self, choice: Any) -> None:
        if type(choice) is not dict:
            raise _wrong("choices[0]", choice, "an object")
        ids = choice.get("token_ids")
        if ids is not None:
            # each chunk's list is only checked for being one here; its items once, whole, in result()
            if type(ids) is not list:
                raise RequestFailed(f"token_ids is not a list of non-negative integers: {str(ids)[:200]}", True)
            if self.completion_ids is None:
                self.completion_ids = ids  # a fresh list from the parser: extended in place from here on
            else:
                self.completion_ids += ids
        delta = _object(choice.get("delta"), "choices[0].delta") or {}
        piece = _text(delta.get("reasoning"), "choices[0].delta.reasoning")
        if piece is None:
            piece = _text(delta.get("reasoning_content"), "choices[0].delta.reasoning_content")
        if piece:
            self.reasoning.append(piece)
        piece = _text(delta.get("content"), "choices[0].delta.content")
        if piece:
            self.content.append(piece)
        finish = choice.get("finish_reason")
        if finish:
            self.finish = _text(finish, "choices[0].finish_reason")

    def result(self) -> Completion:
        if self.finish is None:
            raise RequestFailed("truncated stream: it ended without a finish_reason", True)
        prompt_tokens, completion_tokens = _usage(self.usage)
        return _checked(
            Completion(
                "".join(self.reasoning) if self.reasoning else None,
                "".join(self.content) if self.content else None,
                self.finish,
                prompt_tokens,
                completion_tokens,
                self.model,
                self.prompt_ids,
                _token_ids(self.completion_ids, "token_ids"),
            )
        )


def parse_sse(data: bytes) -> Completion:
    """Assemble a streamed chat completion from its whole SSE body (see :func:`read_sse`)."""
    state = StreamState()
    if _feed_lines(state, data):
        return state.result()
    raise RequestFailed("truncated stream: it ended without data: [DONE]", True)


def _feed_lines(state: StreamState, data: bytes) -> bool:
    """Feed the ``data:`` lines of ``data`` (whole lines); True once ``data: [DONE]`` came."""
    # SSE lines split by hand: only "data:" lines matter, and an SDK's event objects cost CPU per event
    for line in data.split(b"\n"):
        if line[:5] == b"data:":
            state.feed(line[5:].strip())
            if state.done:
                return True
    return False


async def read_sse(chunks: AsyncIterator[bytes]) -> Completion:
    """Assemble a streamed chat completion from raw SSE bytes in any chunking."""
    state = StreamState()
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
