"""The request path of the default "openai" transport (EngineAsyncOpenAI over AiohttpBodyTransport) against the
SDK's own path and the "aiohttp" transport: the same requests on the wire, the same Completion objects, the same
failure classification (issue 3, acceptance 4 made the openai path leaner; these pin that it still means the same).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
from collections.abc import Iterator
from typing import Any

import httpx2
import openai
import pytest
from openai._models import FinalRequestOptions

from eagle3_assets.generation.client import (
    CHAT_PATH,
    AiohttpBodyTransport,
    Completion,
    EngineAsyncOpenAI,
    RequestFailed,
    _StreamState,
    build_body,
    make_client,
    parse_sse,
    read_sse,
    request_completion,
)
from eagle3_assets.generation.config import GenerationConfig
from eagle3_assets.generation.transport import make_transports
from support.fake_vllm import FakeConfig, prompt_key, prompt_token_ids, prompt_tokens, serve_in_thread, token_ids

URL = "http://127.0.0.1:9/v1"
MESSAGES = [{"role": "system", "content": "Think, then answer."}]


def _sdk_client(base_url: str, api_key: str, *, read_s: float = 30.0) -> openai.AsyncOpenAI:
    """The SDK's own path, as the engine used it before: stock AsyncOpenAI over the SDK's aiohttp client."""
    timeout = httpx2.Timeout(connect=5.0, read=read_s, write=60.0, pool=None)
    return openai.AsyncOpenAI(
        base_url=base_url,
        api_key=api_key,
        max_retries=0,
        timeout=timeout,
        http_client=openai.DefaultAioHttpClient(timeout=timeout),
    )


def _lean_client(base_url: str, api_key: str, *, read_s: float = 30.0) -> openai.AsyncOpenAI:
    return make_client(base_url, api_key, connect_s=5.0, read_s=read_s, max_connections=8)


def _wire(request: httpx2.Request) -> tuple[Any, ...]:
    return request.method, str(request.url), request.headers.raw, request.content, request.extensions


# ------------------------------------------------------------------------------- the request itself


def test_lean_chat_request_is_the_request_the_sdk_builds() -> None:
    timeout = httpx2.Timeout(connect=3.0, read=40.0, write=60.0, pool=None)
    kwargs: dict[str, Any] = dict(base_url=URL, api_key="sk-secret", max_retries=0, timeout=timeout)
    lean, stock = EngineAsyncOpenAI(**kwargs), openai.AsyncOpenAI(**kwargs)
    for body in (b'{"model":"m"}', b'{"model":"m","messages":[{"role":"user","content":"hi"}]}', b"{}"):
        options = FinalRequestOptions.construct(method="post", url=CHAT_PATH, content=body)
        assert _wire(lean._build_request(options)) == _wire(stock._build_request(options))
    # the options post_chat sends (a fixed idempotency key: this client sends no idempotency header)
    asyncio.run(_capture_post_chat_options(lean))
    options = lean._chat_options.model_copy(update={"content": b"{}"})  # type: ignore[union-attr]
    assert stock._idempotency_header is None
    assert _wire(lean._build_request(options)) == _wire(stock._build_request(options))
    assert lean._chat_template is not None
    template = lean._chat_template
    lean._build_request(FinalRequestOptions.construct(method="post", url=CHAT_PATH, content=b"{}"))
    assert lean._chat_template is template  # reused, not rebuilt

    # a new API key, base URL or timeout rebuilds the template; the request stays the SDK's
    for attribute, value in (
        ("api_key", "sk-other"),
        ("base_url", "http://127.0.0.1:10/v1"),
        ("timeout", httpx2.Timeout(7.0)),
    ):
        setattr(lean, attribute, value)
        setattr(stock, attribute, value)
        options = FinalRequestOptions.construct(method="post", url=CHAT_PATH, content=b"{}")
        assert _wire(lean._build_request(options)) == _wire(stock._build_request(options)), attribute
    assert b"Bearer sk-other" in dict(lean._build_request(options).headers.raw)[b"authorization"]

    # anything but the plain chat POST takes the SDK's own path, unchanged
    for options in (
        FinalRequestOptions.construct(method="get", url="/models"),
        FinalRequestOptions.construct(method="post", url=CHAT_PATH, content=b"{}", headers={"X-Trace": "1"}),
        FinalRequestOptions.construct(method="post", url=CHAT_PATH, content=b"{}", timeout=3.0),
        FinalRequestOptions.construct(method="post", url=CHAT_PATH, json_data={"model": "m"}),
        FinalRequestOptions.construct(method="post", url="/completions", content=b"{}"),
    ):
        assert _wire(lean._build_request(options)) == _wire(stock._build_request(options))
    retry = FinalRequestOptions.construct(method="post", url=CHAT_PATH, content=b"{}")
    assert _wire(lean._build_request(retry, retries_taken=1)) == _wire(stock._build_request(retry, retries_taken=1))


async def _capture_post_chat_options(client: EngineAsyncOpenAI) -> None:
    with contextlib.suppress(openai.APIConnectionError, openai.APITimeoutError):  # nothing listens at URL
        await client.post_chat(b"{}", stream=False)


def test_make_client_uses_the_lean_transport_unless_proxies_are_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    client = _lean_client(URL, "k")
    assert isinstance(client, EngineAsyncOpenAI)
    assert isinstance(client._client._transport, AiohttpBodyTransport)
    assert client.max_retries == 0
    # proxies from the environment: the SDK's own aiohttp client, which applies them (and NO_PROXY) per URL
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    client = _lean_client(URL, "k")
    assert isinstance(client, EngineAsyncOpenAI)
    assert not isinstance(client._client._transport, AiohttpBodyTransport)


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
    """Every prompt through one path: "openai" / "aiohttp" (the engine's transports) or "sdk" (stock client)."""
    fields = {"max_tokens": 300, "return_token_ids": True}
    bodies = [build_body("fake-model", messages, fields, stream) for messages in _prompts()]
    results: list[Completion | RequestFailed] = []
    if kind == "sdk":
        client = _sdk_client(url, api_key or "EMPTY", read_s=read_s)
        try:
            for body in bodies:
                try:
                    results.append(await request_completion(client, body, stream=stream, deadline_s=30))
                except RequestFailed as failure:
                    results.append(failure)
        finally:
            await client.close()
        return results
    config = GenerationConfig(
        base_urls=[url],
        model="fake-model",
        transport=kind,
        stream=stream,
        api_key=api_key,
        idle_timeout_s=read_s,
        request_timeout_s=read_s,
    )
    transport = make_transports(config)[config.base_urls[0]]
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
def test_every_path_returns_the_same_completions(shape_url: tuple[str, str], stream: bool) -> None:
    field, url = shape_url
    by_path = {kind: asyncio.run(_complete_all(kind, url, stream)) for kind in ("openai", "aiohttp", "sdk")}
    assert by_path["openai"] == by_path["aiohttp"] == by_path["sdk"]
    for messages, completion in zip(_prompts(), by_path["openai"], strict=True):
        assert isinstance(completion, Completion)
        key = prompt_key(messages)
        n = min(int(messages[-1]["content"].split("=")[1].rstrip("]")), 300)
        assert (completion.completion_tokens, completion.finish_reason) == (n, "length" if n == 300 else "stop")
        assert completion.completion_token_ids == token_ids(key, 0, n)
        assert completion.prompt_token_ids == prompt_token_ids(key, prompt_tokens(messages))
        assert bool(completion.reasoning) == (field != "none" and int(n * 0.6) > 0)
        assert completion.content and completion.model == "fake-model"


# ----------------------------------------------------------------------- same failures, every path


def _outcome(result: Completion | RequestFailed) -> tuple[Any, ...]:
    if isinstance(result, Completion):
        return ("ok",)
    return result.retryable, result.status, result.kind, result.retry_after_s, result.message


FAULTS = ["error_500", "error_429", "reset", "hang", "truncate", "invalid_json", "non_completion", "empty_choices"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("fault", FAULTS)
def test_faults_are_classified_as_the_sdk_classifies_them(fault: str, stream: bool) -> None:
    fake = FakeConfig(token_rate=50000, stream_interval_s=0.001, hang_s=5, faults={fault: 1.0})
    with serve_in_thread(fake) as url:
        lean = asyncio.run(_complete_all("openai", url, stream, read_s=0.5))
        sdk = asyncio.run(_complete_all("sdk", url, stream, read_s=0.5))
        plain = asyncio.run(_complete_all("aiohttp", url, stream, read_s=0.5))
    assert [_outcome(r) for r in lean] == [_outcome(r) for r in sdk]
    assert all(isinstance(r, RequestFailed) and r.retryable for r in lean + plain), (lean, plain)
    assert [r.status for r in lean] == [r.status for r in plain]  # type: ignore[union-attr]


def test_status_errors_are_classified_as_the_sdk_classifies_them() -> None:
    # 401 (wrong key) and 400 (prompt over the context): not retryable, with the server's message
    with serve_in_thread(FakeConfig(token_rate=50000, api_key="right-key", max_model_len=12)) as url:
        for key in ("wrong-key", "right-key"):
            lean = asyncio.run(_complete_all("openai", url, False, api_key=key))
            sdk = asyncio.run(_complete_all("sdk", url, False, api_key=key))
            assert [_outcome(r) for r in lean] == [_outcome(r) for r in sdk]
            assert {r.status for r in lean if isinstance(r, RequestFailed)} == ({401} if key == "wrong-key" else {400})
            assert not any(r.retryable for r in lean if isinstance(r, RequestFailed))
            assert all(
                "right-key" not in r.message and "wrong-key" not in r.message
                for r in lean
                if isinstance(r, RequestFailed)
            )


def test_refused_connection_is_a_connection_failure() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"  # nothing listens there any more
    for stream in (False, True):
        lean = asyncio.run(_complete_all("openai", url, stream))
        sdk = asyncio.run(_complete_all("sdk", url, stream))
        assert [_outcome(r) for r in lean] == [_outcome(r) for r in sdk]
        assert all(isinstance(r, RequestFailed) and r.retryable and r.kind == "connection" for r in lean)


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
    state = _StreamState()
    with pytest.raises(RequestFailed) as caught:
        for event in (
            {"choices": [{"delta": {"content": "a"}, "token_ids": [1, 2, 3]}]},
            {"choices": [{"delta": {"content": "b"}, "token_ids": ids, "finish_reason": "stop"}]},
            {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 5}},
        ):
            state.feed(json.dumps(event).encode())
        state.result()
    assert caught.value.retryable and fragment in caught.value.message
