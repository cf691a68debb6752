"""The fake vLLM server speaks vLLM's OpenAI dialect, follows its length/rate model and injects faults."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from fake_vllm import (
    FAULT_KINDS,
    NEVER_ENDING_FAULTS,
    FakeConfig,
    config_to_args,
    draw_fault,
    parse_args,
    prompt_key,
    response_length,
    serve_in_thread,
    token_text,
)

MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture
def make_server() -> Iterator:
    stack: list = []

    def start(**kwargs: object) -> httpx.Client:
        ctx = serve_in_thread(FakeConfig(**kwargs))  # type: ignore[arg-type]
        base = ctx.__enter__()
        stack.append(ctx)
        client = httpx.Client(base_url=base.removesuffix("/v1"), timeout=10)
        stack.append(client)
        return client

    yield start
    for item in reversed(stack):
        if isinstance(item, httpx.Client):
            item.close()
        else:
            item.__exit__(None, None, None)


def chat(client: httpx.Client, messages: list[dict[str, str]] = MESSAGES, **body: object) -> httpx.Response:
    return client.post(
        "/v1/chat/completions", json={"model": "fake-model", "messages": messages, "max_tokens": 1000, **body}
    )


def sse_events(text: str) -> list[object]:
    events: list[object] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[6:]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_models_and_plain_completion_shape(make_server) -> None:
    client = make_server(token_rate=10000, median_tokens=50)
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["fake-model"]
    data = chat(client).json()
    n, finish = response_length(MESSAGES, FakeConfig(median_tokens=50), 1000)
    assert data["object"] == "chat.completion" and data["model"] == "fake-model"
    choice = data["choices"][0]
    assert choice["finish_reason"] == finish and choice["message"]["role"] == "assistant"
    assert data["usage"]["completion_tokens"] == n and data["usage"]["prompt_tokens"] == 2 + 4
    k = int(n * 0.6)
    key = prompt_key(MESSAGES)
    assert choice["message"]["reasoning"] == token_text(key, 0, k)
    assert choice["message"]["content"] == token_text(key, k, n - k)
    assert "reasoning_content" not in choice["message"]
    assert chat(client).json()["choices"] == data["choices"]  # deterministic


def test_legacy_reasoning_content_shape(make_server) -> None:
    client = make_server(token_rate=10000, median_tokens=50, reasoning_field="reasoning_content")
    message = chat(client).json()["choices"][0]["message"]
    assert "reasoning" not in message and message["reasoning_content"]


def test_stream_matches_plain_and_ends_with_usage_and_done(make_server) -> None:
    client = make_server(token_rate=5000, median_tokens=60, stream_interval_s=0.005)
    plain = chat(client).json()
    events = sse_events(chat(client, stream=True, stream_options={"include_usage": True}).text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]
    assert chunks[-2]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning", "") for c in chunks[:-1])
    content = "".join(c["choices"][0]["delta"].get("content", "") or "" for c in chunks[:-1])
    assert reasoning == plain["choices"][0]["message"]["reasoning"]
    assert content == plain["choices"][0]["message"]["content"]
    assert len(chunks) > 4  # really incremental
    no_usage = sse_events(chat(client, stream=True).text)
    assert all("usage" not in c for c in no_usage[:-1])


def test_latency_follows_length_and_max_tokens_truncates(make_server) -> None:
    client = make_server(token_rate=1000)
    started = time.monotonic()
    short = chat(client, [{"role": "user", "content": "[[fake_tokens=10]] hi"}]).json()
    short_s = time.monotonic() - started
    started = time.monotonic()
    long = chat(client, [{"role": "user", "content": "[[fake_tokens=300]] hi"}]).json()
    long_s = time.monotonic() - started
    assert short["usage"]["completion_tokens"] == 10 and long["usage"]["completion_tokens"] == 300
    assert long_s >= 0.3 and short_s < 0.2
    cut = chat(client, [{"role": "user", "content": "[[fake_tokens=300]] hi"}], max_tokens=50).json()
    assert cut["choices"][0]["finish_reason"] == "length" and cut["usage"]["completion_tokens"] == 50


def test_capacity_queues_beyond_max_num_seqs_and_metrics_show_it(make_server) -> None:
    import concurrent.futures

    from eagle3_assets.generation.capacity import ServerLoad, parse_load

    client = make_server(token_rate=1000, max_num_seqs=2)
    assert parse_load(client.get("/metrics").text) == ServerLoad(0, 0)
    messages = [[{"role": "user", "content": f"[[fake_tokens=300]] q{i}"}] for i in range(5)]
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        started = time.monotonic()
        futures = [pool.submit(chat, client, m) for m in messages]
        time.sleep(0.1)
        during = client.get("/metrics")
        assert all(f.result().status_code == 200 for f in futures)
        wall = time.monotonic() - started
    # vLLM's text format: the two gauges, labelled by engine and model_name
    assert 'vllm:num_requests_running{engine="0",model_name="fake-model"} 2.0' in during.text
    assert parse_load(during.text) == ServerLoad(running=2, waiting=3)
    assert wall >= 0.9  # three waves of 0.3 s: the 3 beyond capacity waited
    stats = client.get("/stats").json()
    assert (stats["max_running"], stats["max_waiting"]) == (2, 3)
    assert abs(stats["busy_seq_s"] - 5 * 0.3) < 0.2  # the integral of running sequences over time


def test_a_server_without_metrics_answers_404(make_server) -> None:
    assert make_server(metrics=False).get("/metrics").status_code == 404


def test_lengths_are_heavy_tailed_lognormal() -> None:
    config = FakeConfig(median_tokens=300, sigma=0.8)
    lengths = sorted(response_length([{"role": "user", "content": f"p{i}"}], config, 100000)[0] for i in range(4000))
    median = lengths[len(lengths) // 2]
    assert 270 <= median <= 330
    assert lengths[int(0.99 * len(lengths))] > 5 * median  # exp(2.33 * 0.8) ~ 6.4x the median


def test_vllm_errors(make_server) -> None:
    client = make_server(token_rate=10000, max_model_len=100)
    too_long = chat(client, [{"role": "user", "content": "word " * 200}])
    assert too_long.status_code == 400
    assert too_long.json()["error"]["message"] == (
        "This model's maximum context length is 100 tokens. However, your prompt contains 204 input tokens. "
        "Please reduce the length of the input messages."
    )
    unknown = client.post("/v1/chat/completions", json={"model": "nope", "messages": MESSAGES})
    assert unknown.status_code == 404 and "does not exist" in unknown.json()["error"]["message"]


def test_api_key_required_when_configured(make_server) -> None:
    client = make_server(token_rate=10000, api_key="k1")
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200


def test_stats_count_requests_per_prompt_and_reset(make_server) -> None:
    client = make_server(token_rate=10000, median_tokens=5)
    for _ in range(3):
        chat(client)
    chat(client, [{"role": "user", "content": "other"}])
    stats = client.get("/stats").json()
    assert stats["requests"] == {prompt_key(MESSAGES): 3, prompt_key([{"role": "user", "content": "other"}]): 1}
    assert stats["total_requests"] == 4 and stats["completed"] == 4 and stats["outcomes"] == {"ok": 4}
    client.post("/stats/reset")
    assert client.get("/stats").json()["total_requests"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_each_fault_kind(make_server, stream: bool) -> None:
    for kind in FAULT_KINDS:
        if kind in NEVER_ENDING_FAULTS:  # a body that never ends: tests/unit/test_safety_fake_never_ending.py
            continue
        client = make_server(token_rate=5000, median_tokens=40, hang_s=2, stream_interval_s=0.005, faults={kind: 1.0})
        body = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        if kind == "hang":
            with pytest.raises(httpx.ReadTimeout):
                client.post(
                    "/v1/chat/completions",
                    timeout=httpx.Timeout(10, read=0.3),
                    json={"model": "fake-model", "messages": MESSAGES, "max_tokens": 100, **body},
                )
            continue
        if kind in ("reset", "truncate") and not (stream and kind == "truncate"):
            with pytest.raises(httpx.TransportError):
                chat(client, **body)
            continue
        response = chat(client, **body)
        if kind == "error_500":
            assert response.status_code == 500 and response.json()["error"]["message"]
        elif kind == "error_429":
            assert response.status_code == 429
        elif stream:
            events = sse_events(response.text) if kind != "invalid_json" else response.text
            if kind == "truncate":  # a clean end of the body with no finish_reason and no [DONE]
                assert "[DONE]" not in events and 'finish_reason":"stop' not in response.text
            elif kind == "invalid_json":
                with pytest.raises(ValueError):
                    sse_events(events)
            elif kind == "non_completion":
                assert {"status": "ok"} in events
            elif kind == "empty_choices":
                assert all(e == "[DONE]" or e["choices"] == [] for e in events[1:])  # after the role chunk
        else:
            if kind == "invalid_json":
                with pytest.raises(ValueError):
                    response.json()
            elif kind == "non_completion":
                assert "choices" not in response.json()
            elif kind == "empty_choices":
                assert response.json()["choices"] == []


@pytest.mark.parametrize("stream", [False, True])
def test_lying_faults_give_one_field_the_wrong_type(make_server, stream: bool) -> None:
    body = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    for kind, check in (
        ("content_list", lambda m, u: isinstance(m.get("content"), list)),
        ("reasoning_object", lambda m, u: isinstance(m.get("reasoning"), dict)),
        ("usage_strings", lambda m, u: u["prompt_tokens"] == str(int(u["prompt_tokens"]))),
    ):
        client = make_server(token_rate=5000, median_tokens=40, stream_interval_s=0.005, faults={kind: 1.0})
        response = chat(client, **body)
        assert response.status_code == 200
        if stream:
            events = [e for e in sse_events(response.text) if isinstance(e, dict)]
            deltas = [c["delta"] for e in events for c in e["choices"]]
            usage = next(e["usage"] for e in events if e.get("usage"))
            assert any(check(d, usage) for d in deltas) if kind != "usage_strings" else check({}, usage), kind
        else:
            data = response.json()
            assert check(data["choices"][0]["message"], data["usage"]), kind


@pytest.mark.parametrize("status", [401, 403])
def test_a_revoked_key_is_refused_after_the_first_requests(make_server, status: int) -> None:
    client = make_server(token_rate=5000, median_tokens=10, revoke_after=3, revoke_status=status)
    codes = [chat(client, [{"role": "user", "content": f"q{i}"}]).status_code for i in range(5)]
    assert codes == [200, 200, 200, status, status]
    assert client.get("/v1/models").status_code == 200  # only chat requests count and are refused
    assert client.get("/stats").json()["outcomes"]["revoked"] == 2


def test_faults_are_deterministic_and_follow_their_rates() -> None:
    config = FakeConfig(faults={"error_500": 0.05, "hang": 0.01, "reset": 0.02})
    draws = Counter(draw_fault(f"k{i}", 0, config) for i in range(20000))
    assert abs(draws["error_500"] / 20000 - 0.05) < 0.01
    assert abs(draws["hang"] / 20000 - 0.01) < 0.004
    assert abs(draws["reset"] / 20000 - 0.02) < 0.006
    assert [draw_fault("k1", n, config) for n in range(50)] == [draw_fault("k1", n, config) for n in range(50)]


def test_command_line_round_trip() -> None:
    config = FakeConfig(
        token_rate=123.0,
        median_tokens=45.0,
        reasoning_field="none",
        api_key="x",
        seed=3,
        revoke_after=7,
        revoke_status=403,
        faults={"hang": 0.01, "error_429": 0.2, "usage_strings": 0.1},
    )
    parsed, host, port = parse_args(["--port", "0", *config_to_args(config)])
    assert parsed == config and port == 0 and host == "127.0.0.1"
