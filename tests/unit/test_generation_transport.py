"""The two transports (``EAGLE3_TRANSPORT``): the default "aiohttp" (the project's own aiohttp client) and "openai"
(stock ``openai.AsyncOpenAI`` over the SDK's aiohttp client). They must send the same request, return the same
Completion objects and classify every failure the same way: switching transports changes CPU, never results.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from eagle3_assets.generation.errors import RequestFailed
from eagle3_assets.generation.generation_config import GenerationConfig
from eagle3_assets.generation.replies import Completion, StreamState, build_body, parse_sse, read_sse
from eagle3_assets.generation.transport import (
    AiohttpTransport,
    OpenAITransport,
    Transport,
    aiohttp_session,
    make_transports,
)
from fake_faults import FAULT_KINDS
from fake_vllm import FakeConfig, prompt_key, prompt_token_ids, prompt_tokens, serve_in_thread, token_ids

MESSAGES = [{"role": "system", "content": "Think, then answer."}]
KINDS = ("aiohttp", "openai")


def _transport(kind: str, url: str, *, stream: bool, api_key: str | None = None, read_s: float = 30.0) -> Transport:
    config = GenerationConfig(
        base_urls=[url],
        model="fake-model",
        transport=kind,
        stream=stream,
        api_key=api_key,
        idle_timeout_s=read_s,
        request_timeout_s=read_s,
    )
    return make_transports(config)[config.base_urls[0]]


# ------------------------------------------------------------------------------- the request itself


def test_default_transport_is_aiohttp_and_openai_is_the_stock_sdk() -> None:
    assert GenerationConfig(base_urls=["http://127.0.0.1:9/v1"]).transport == "aiohttp"
    assert isinstance(_transport("aiohttp", "http://127.0.0.1:9/v1", stream=False), AiohttpTransport)
    sdk = _transport("openai", "http://127.0.0.1:9/v1", stream=False)
    assert isinstance(sdk, OpenAITransport)
    assert type(sdk.client) is openai.AsyncOpenAI and sdk.client.max_retries == 0
    assert isinstance(sdk.client._client, openai.DefaultAioHttpClient)  # type: ignore[attr-defined]


def test_aiohttp_session_reads_proxies_only_when_some_are_set(monkeypatch: pytest.MonkeyPatch) -> None:
    async def trust_env() -> bool:
        session = aiohttp_session(limit=4, connect_s=1.0, read_s=1.0)
        try:
            return session.trust_env
        finally:
            await session.close()

    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    assert asyncio.run(trust_env()) is False
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    assert asyncio.run(trust_env()) is True  # then aiohttp applies them, and NO_PROXY, per URL


_CANNED = json.dumps(
    {"model": "m", "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}], "usage": {}}
).encode()


def _capture_one_request() -> tuple[str, threading.Thread, dict[str, Any]]:
    """A one-shot HTTP server on loopback: records the request line, headers and body, answers a completion."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    seen: dict[str, Any] = {}

    def serve() -> None:
        connection, _ = listener.accept()
        with connection, listener:
            data = b""
            while b"\r\n\r\n" not in data:
                data += connection.recv(65536)
            head, body = data.split(b"\r\n\r\n", 1)
            lines = head.decode().split("\r\n")
            headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
            while len(body) < int(headers.get("content-length", 0)):
                body += connection.recv(65536)
            seen.update(line=lines[0], headers=headers, body=body)
            connection.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                + b"content-length: %d\r\n\r\n" % len(_CANNED)
                + _CANNED
            )

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}/v1", thread, seen


def test_both_transports_send_the_same_request() -> None:
    body = build_body("m", [{"role": "user", "content": "hi"}], {"max_tokens": 5}, False)
    requests = {}
    for kind in KINDS:
        url, thread, seen = _capture_one_request()

        async def one(url: str = url, kind: str = kind) -> Completion:
            transport = _transport(kind, url, stream=False, api_key="sk-secret")
            try:
                return await transport.complete(body, stream=False, deadline_s=10)
            finally:
                await transport.close()

        assert asyncio.run(one()) == Completion(None, "hi", "stop", None, None, "m")
        thread.join(10)
        requests[kind] = (
            seen["line"],
            seen["body"],
            seen["headers"]["authorization"],
            seen["headers"]["content-type"],
            seen["headers"]["accept"],
        )
    assert requests["aiohttp"] == requests["openai"]
    assert requests["aiohttp"][:3] == ("POST /v1/chat/completions HTTP/1.1", body, "Bearer sk-secret")


# ----------------------------------------------------------------------- same completions, every path


def _prompts() -> list[list[dict[str, str]]]:
    # forced lengths: short, long (several SSE chunks), one past max_tokens (finish_reason "length")
    return [
        [*MESSAGES, {"role": "user", "content": f"question {i} [[fake_tokens={n}]]"}]
        for i, n in enumerate((1, 7, 230, 400))
    ]


async def _complete_all(
    kind: str, url: str, stream: bool, api_key: str | None = None, read_s: float = 30.0
) -> list[Completion | RequestFailed]:
    """Every prompt through one transport, in order: a Completion or the RequestFailed it raised."""
    fields = {"max_tokens": 300, "return_token_ids": True}
    bodies = [build_body("fake-model", messages, fields, stream) for messages in _prompts()]
    results: list[Completion | RequestFailed] = []
    transport = _transport(kind, url, stream=stream, api_key=api_key, read_s=read_s)
    try:
        for body in bodies:
            try:
                results.append(await transport.complete(body, stream=stream, deadline_s=30))
            except RequestFailed as failure:
                results.append(failure)
    finally:
        await transport.close()
    return results


@pytest.fixture(params=["reasoning", "reasoning_content", "none"])
def shape_url(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    fake = FakeConfig(token_rate=50000, reasoning_field=request.param, stream_interval_s=0.001)
    with serve_in_thread(fake) as url:
        yield request.param, url


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_every_transport_returns_the_same_completions(shape_url: tuple[str, str], stream: bool) -> None:
    field, url = shape_url
    by_kind = {kind: asyncio.run(_complete_all(kind, url, stream)) for kind in KINDS}
    assert by_kind["aiohttp"] == by_kind["openai"]
    for messages, completion in zip(_prompts(), by_kind["aiohttp"], strict=True):
        assert isinstance(completion, Completion)
        key = prompt_key(messages)
        n = min(int(messages[-1]["content"].split("=")[1].rstrip("]")), 300)
        assert (completion.completion_tokens, completion.finish_reason) == (n, "length" if n == 300 else "stop")
        assert completion.completion_token_ids == token_ids(key, 0, n)
        assert completion.prompt_token_ids == prompt_token_ids(key, prompt_tokens(messages))
        assert bool(completion.reasoning) == (field != "none" and int(n * 0.6) > 0)
        assert completion.content and completion.model == "fake-model"


# ----------------------------------------------------------------------- same failures, every transport


def _outcome(result: Completion | RequestFailed) -> tuple[Any, ...]:
    if isinstance(result, Completion):
        return ("ok",)
    return result.retryable, result.status, result.kind, result.retry_after_s, result.message


# the field each lying fault gets wrong, as the failure names it
LIE_FIELDS = {
    "content_list": "content",
    "reasoning_object": "reasoning",
    "usage_strings": "usage.prompt_tokens",
}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("fault", FAULT_KINDS)
def test_faults_are_classified_the_same_by_every_transport(fault: str, stream: bool) -> None:
    fake = FakeConfig(token_rate=50000, stream_interval_s=0.001, hang_s=5, faults={fault: 1.0})
    with serve_in_thread(fake) as url:
        by_kind = {kind: asyncio.run(_complete_all(kind, url, stream, read_s=0.5)) for kind in KINDS}
    assert [_outcome(r) for r in by_kind["aiohttp"]] == [_outcome(r) for r in by_kind["openai"]]
    failures = by_kind["aiohttp"]
    assert all(isinstance(r, RequestFailed) and r.retryable for r in failures), failures
    if fault in LIE_FIELDS:  # a wrong type names its field
        name = LIE_FIELDS[fault]
        if "." not in name:
            name = f"choices[0].{'delta' if stream else 'message'}.{name}"
        assert all(str(r).startswith(f"reply field {name} is a") for r in failures), failures


def test_status_errors_are_classified_the_same_by_every_transport() -> None:
    # 401 (wrong key) and 400 (prompt over the context): not retryable, with the server's message
    with serve_in_thread(FakeConfig(token_rate=50000, api_key="right-key", max_model_len=12)) as url:
        for key in ("wrong-key", "right-key"):
            by_kind = {kind: asyncio.run(_complete_all(kind, url, False, api_key=key)) for kind in KINDS}
            assert [_outcome(r) for r in by_kind["aiohttp"]] == [_outcome(r) for r in by_kind["openai"]]
            failures = [r for r in by_kind["aiohttp"] if isinstance(r, RequestFailed)]
            assert {r.status for r in failures} == ({401} if key == "wrong-key" else {400})
            assert not any(r.retryable for r in failures)
            assert all("right-key" not in r.message and "wrong-key" not in r.message for r in failures)


def test_refused_connection_is_a_connection_failure() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"  # nothing listens there any more
    for stream in (False, True):
        by_kind = {kind: asyncio.run(_complete_all(kind, url, stream)) for kind in KINDS}
        assert [_outcome(r) for r in by_kind["aiohttp"]] == [_outcome(r) for r in by_kind["openai"]]
        assert all(isinstance(r, RequestFailed) and r.retryable and r.kind == "connection" for r in by_kind["openai"])


# ------------------------------------------------------------------------------- SSE assembly


def _sse_body() -> bytes:
    events: list[object] = [
        {"model": "m", "prompt_token_ids": [1, 2, 3], "choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"delta": {"reasoning": "thi"}, "token_ids": [10, 11]}]},
        {"choices": [{"delta": {"reasoning": "nk"}, "token_ids": [12]}]},
        {"choices": [{"delta": {"content": "ans"}, "token_ids": [13, 14]}]},
        {"choices": [{"delta": {"content": "wer"}, "token_ids": [15], "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6}},
    ]
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def test_sse_assembly_is_the_same_for_any_chunking() -> None:
    body = _sse_body()
    whole = parse_sse(body)
    assert whole == Completion("think", "answer", "stop", 3, 6, "m", [1, 2, 3], [10, 11, 12, 13, 14, 15])

    async def chunks(parts: list[bytes]) -> Any:
        for part in parts:
            yield part

    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(body)), rng.randint(1, 40)))
        parts = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
        assert asyncio.run(read_sse(chunks(parts))) == whole
    assert asyncio.run(read_sse(chunks([bytes([b]) for b in body]))) == whole
    assert asyncio.run(read_sse(chunks([body.rstrip(b"\n")]))) == whole  # no newline after [DONE]
    with pytest.raises(RequestFailed, match="without data: \\[DONE\\]"):
        asyncio.run(read_sse(chunks([body[: body.index(b"data: [DONE]")]])))


@pytest.mark.parametrize(
    ("ids", "fragment"),
    [
        ("[10, 11]", "token_ids is not a list"),  # a string, not a list
        ({"a": 1}, "token_ids is not a list"),
        ([10, "11"], "token_ids is not a list of non-negative integers"),
        ([10, -1], "token_ids is not a list of non-negative integers"),
        ([10, 1.5], "token_ids is not a list of non-negative integers"),
        ([10, True], "token_ids is not a list of non-negative integers"),
        ([10], "token_ids has 4 ids but usage says 5"),
    ],
)
def test_bad_stream_token_ids_are_retryable_failures(ids: object, fragment: str) -> None:
    state = StreamState()
    with pytest.raises(RequestFailed) as caught:
        for event in (
            {"choices": [{"delta": {"content": "a"}, "token_ids": [1, 2, 3]}]},
            {"choices": [{"delta": {"content": "b"}, "token_ids": ids, "finish_reason": "stop"}]},
            {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 5}},
        ):
            state.feed(json.dumps(event).encode())
        state.result()
    assert caught.value.retryable and fragment in caught.value.message
