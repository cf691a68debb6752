"""generate_partition against the fake vLLM server: faults, non-retryable errors, response shapes, resume,
several endpoints, API keys (issue 3, acceptance 1, 3 and 5)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import polars as pl
import pytest

import fake_responses as served
from eagle3_assets.core import storage
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.generation import GenerationConfig, PromptToGenerate, generate_partition
from eagle3_assets.generation.journal import Journal
from eagle3_assets.generation.records import COLUMNS, RESPONSE_SCHEMA
from eagle3_assets.generation.response_checks import completeness_check, error_rate_check
from fake_vllm import FakeConfig, FakeServerProcess
from support.reliability import quick_config

KEY = "00000"
ACCEPTANCE_FAULTS = {"error_500": 0.05, "error_429": 0.02, "reset": 0.02, "hang": 0.01, "truncate": 0.01}
# every fault kind the fake server injects: the acceptance rates plus 2% of each bad-body kind
EVERY_FAULT = {**ACCEPTANCE_FAULTS, "invalid_json": 0.02, "non_completion": 0.02, "empty_choices": 0.02}
EVERY_FAULT_SERVER = FakeConfig(
    token_rate=5000, median_tokens=40, hang_s=60, stream_interval_s=0.01, faults=EVERY_FAULT
)


def make_prompts(n: int, tag: str = "q") -> list[PromptToGenerate]:
    return [
        PromptToGenerate(
            f"{tag}-{i:05d}",
            [
                {"role": "system", "content": "Think, then answer."},
                {"role": "user", "content": f"{tag} question number {i}"},
            ],
        )
        for i in range(n)
    ]


# quick_config with more requests in flight and still shorter timeouts (connect: the core's default)
FAST = dict(concurrency=64, request_timeout_s=2.0, idle_timeout_s=1.0, backoff_base_s=0.02, backoff_max_s=0.3)


def fast_config(*urls: str, **overrides: object) -> GenerationConfig:
    return quick_config(*urls, **{**FAST, "connect_timeout_s": GenerationConfig.connect_timeout_s, **overrides})


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[FakeServerProcess]:
    fake = getattr(request, "param", None) or FakeConfig(token_rate=5000, median_tokens=60)
    with FakeServerProcess(fake) as running:
        yield running


def read_rows(layout: DataLayout) -> pl.DataFrame:
    frame = pl.read_parquet(layout.responses_path(KEY))
    assert frame.schema == RESPONSE_SCHEMA and frame.columns == list(COLUMNS)
    return frame


def expected_texts(prompt: PromptToGenerate, fake: FakeConfig, max_tokens: int) -> tuple[str, str, int, str]:
    messages = [dict(m) for m in prompt.messages]
    n, finish = served.response_length(messages, fake, max_tokens)
    k = int(n * fake.reasoning_share)
    key = served.prompt_key(messages)
    return served.token_text(key, 0, k), served.token_text(key, k, n - k), n, finish


# ------------------------------------------------------------------------------------ acceptance 1


@pytest.mark.parametrize(
    "server", [FakeConfig(token_rate=5000, median_tokens=60, hang_s=60, faults=ACCEPTANCE_FAULTS)], indirect=True
)
def test_mixed_faults_end_with_1000_unique_ok_rows(server: FakeServerProcess, layout: DataLayout) -> None:
    prompts = make_prompts(1000)
    logs: list[str] = []
    started = time.monotonic()
    result = generate_partition(prompts, KEY, layout, fast_config(server.base_url), log=logs.append)
    elapsed = time.monotonic() - started
    assert elapsed < 60, f"took {elapsed:.0f}s"

    frame = read_rows(layout)
    assert frame.height == 1000 and frame["sample_id"].n_unique() == 1000
    assert frame["sample_id"].to_list() == [p.sample_id for p in prompts]  # partition order
    assert frame["status"].to_list() == ["ok"] * 1000
    assert (result.ok, result.failed, result.total, result.requested, result.resumed) == (1000, 0, 1000, 1000, 0)

    stats = server.stats()
    outcomes = stats["outcomes"]
    for kind in ACCEPTANCE_FAULTS:  # every fault kind really happened, and was survived
        assert outcomes.get(kind, 0) > 0, outcomes
    assert outcomes["ok"] == 1000
    assert stats["total_requests"] == result.requests == 1000 + result.retries
    assert sum(frame["attempts"]) == result.requests
    assert not layout.responses_in_progress_path(KEY).exists()
    # content is what the server sent, reasoning in its own column
    fake = FakeConfig(token_rate=5000, median_tokens=60)
    for i in (0, 17, 999):
        reasoning, content, n, finish = expected_texts(prompts[i], fake, 2000)
        row = frame.row(i, named=True)
        assert (row["reasoning"], row["content"], row["completion_tokens"], row["finish_reason"]) == (
            reasoning,
            content,
            n,
            finish,
        )
    assert any(line.startswith(f"synthetic_responses {KEY} progress:") for line in logs)
    assert completeness_check(layout.responses_path(KEY), [p.sample_id for p in prompts]).passed
    assert error_rate_check(layout.responses_path(KEY)).passed


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "server",
    [EVERY_FAULT_SERVER],
    indirect=True,
)
def test_every_fault_kind_is_retried_streaming_or_not(
    server: FakeServerProcess, layout: DataLayout, stream: bool
) -> None:
    prompts = make_prompts(300, tag=f"s{int(stream)}")
    result = generate_partition(prompts, KEY, layout, fast_config(server.base_url, stream=stream), log=lambda _m: None)
    frame = read_rows(layout)
    assert frame.height == 300 and frame["sample_id"].n_unique() == 300
    assert result.ok == 300 and result.failed == 0
    outcomes = server.stats()["outcomes"]
    assert all(outcomes.get(kind, 0) > 0 for kind in ("invalid_json", "non_completion", "empty_choices", "reset")), (
        outcomes
    )
    reasons = " ".join(result.retry_reasons)
    assert "HTTP 500" in reasons and "HTTP 429" in reasons


# ------------------------------------------------------------------------------------ acceptance 3


@pytest.mark.parametrize("server", [FakeConfig(token_rate=5000, median_tokens=40, max_model_len=500)], indirect=True)
def test_prompt_too_long_fails_once_with_the_server_message(server: FakeServerProcess, layout: DataLayout) -> None:
    prompts = make_prompts(98)
    long_text = "word " * 800
    prompts += [PromptToGenerate(f"long-{i}", [{"role": "user", "content": long_text + str(i)}]) for i in range(2)]
    result = generate_partition(prompts, KEY, layout, fast_config(server.base_url), log=lambda _m: None)

    assert (result.total, result.ok, result.failed) == (100, 98, 2)
    assert result.error_rate == pytest.approx(0.02)
    frame = read_rows(layout)
    failed = frame.filter(pl.col("status") == "failed")
    assert sorted(failed["sample_id"]) == ["long-0", "long-1"]
    for row in failed.iter_rows(named=True):
        assert row["error"].startswith(
            "HTTP 400: This model's maximum context length is 500 tokens. However, your "
            "prompt contains 805 input tokens"
        )
        assert row["attempts"] == 1 and row["content"] is None
    requests = server.stats()["requests"]
    for prompt in prompts[-2:]:
        assert requests[served.prompt_key([dict(m) for m in prompt.messages])] == 1  # not retried
    check = error_rate_check(layout.responses_path(KEY), max_error_rate=0.01)
    assert not check.passed and check.metadata["failed"] == 2
    assert "maximum context length" in next(iter(check.metadata["top_errors"]))
    assert error_rate_check(layout.responses_path(KEY), max_error_rate=0.05).passed
    assert completeness_check(layout.responses_path(KEY), [p.sample_id for p in prompts]).passed

    # a re-materialization retries the failed ones (and only them); they fail again the same way
    server.reset_stats()
    again = generate_partition(prompts, KEY, layout, fast_config(server.base_url), log=lambda _m: None)
    assert (again.resumed, again.requested, again.failed) == (98, 2, 2)
    assert server.stats()["total_requests"] == 2


# ------------------------------------------------------------------------------------ acceptance 5


@pytest.fixture(scope="module", params=["reasoning", "reasoning_content", "none"])
def shape_server(request: pytest.FixtureRequest) -> Iterator[tuple[FakeConfig, str]]:
    fake = FakeConfig(token_rate=20000, median_tokens=80, reasoning_field=request.param, stream_interval_s=0.005)
    with FakeServerProcess(fake) as running:
        yield fake, running.base_url


@pytest.mark.parametrize("transport", ["openai", "aiohttp"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_every_reasoning_field_shape_is_stored_as_reasoning_and_content(
    shape_server: tuple[FakeConfig, str], stream: bool, transport: str, layout: DataLayout
) -> None:
    fake, url = shape_server
    field = fake.reasoning_field
    prompts = make_prompts(20, tag=field)
    config = fast_config(url, stream=stream, max_tokens=100, transport=transport)
    result = generate_partition(prompts, KEY, layout, config, log=lambda _m: None)
    assert result.ok == 20
    frame = read_rows(layout)
    truncated = 0
    for prompt, row in zip(prompts, frame.iter_rows(named=True), strict=True):
        reasoning, content, n, finish = expected_texts(prompt, fake, 100)
        if field == "none":
            reasoning, content = None, reasoning + content
        assert row["reasoning"] == (reasoning or None)
        assert row["content"] == content
        assert (row["finish_reason"], row["completion_tokens"]) == (finish, n)
        assert row["messages"] == [dict(m) for m in prompt.messages]
        # vLLM's return_token_ids, assembled across stream chunks: the exact served tokens, in order
        key = served.prompt_key([dict(m) for m in prompt.messages])
        assert row["completion_token_ids"] == served.token_ids(key, 0, n)
        n_prompt = served.prompt_tokens([dict(m) for m in prompt.messages])
        assert row["prompt_token_ids"] == served.prompt_token_ids(key, n_prompt) and row["prompt_tokens"] == n_prompt
        truncated += finish == "length"
    assert result.truncated == truncated


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_token_ids_are_not_requested_when_switched_off(
    server: FakeServerProcess, stream: bool, layout: DataLayout
) -> None:
    config = fast_config(server.base_url, stream=stream, return_token_ids=False)
    assert "return_token_ids" not in config.request_fields()
    result = generate_partition(make_prompts(5), KEY, layout, config, log=lambda _m: None)
    frame = read_rows(layout)
    assert result.ok == 5
    assert frame["prompt_token_ids"].null_count() == 5 and frame["completion_token_ids"].null_count() == 5


def test_truncated_samples_are_counted(server: FakeServerProcess, layout: DataLayout) -> None:
    prompts = [
        PromptToGenerate(f"t{i}", [{"role": "user", "content": f"[[fake_tokens={50 + 100 * i}]] go"}]) for i in range(4)
    ]
    result = generate_partition(prompts, KEY, layout, fast_config(server.base_url, max_tokens=200), log=lambda _m: None)
    assert (result.ok, result.truncated) == (4, 2)
    assert read_rows(layout)["finish_reason"].to_list() == ["stop", "stop", "length", "length"]
    assert read_rows(layout)["completion_tokens"].to_list() == [50, 150, 200, 200]


# ------------------------------------------------------------------------------------------ resume


def test_resume_requests_only_missing_and_failed_samples(server: FakeServerProcess, layout: DataLayout) -> None:
    prompts = make_prompts(100)
    generate_partition(prompts, KEY, layout, fast_config(server.base_url), log=lambda _m: None)
    done = read_rows(layout)

    # Nothing to do: re-materializing a complete partition sends no request and keeps the rows.
    server.reset_stats()
    again = generate_partition(prompts, KEY, layout, fast_config(server.base_url), log=lambda _m: None)
    assert (again.requested, again.resumed, server.stats()["total_requests"]) == (0, 100, 0)
    assert read_rows(layout).equals(done)

    # An interrupted run: 30 ok + 5 failed lines in the journal, a torn last line, no final file.
    layout.responses_path(KEY).unlink()
    path = layout.responses_in_progress_path(KEY)
    rows = done.to_dicts()
    with Journal.open(path) as journal:
        for row in rows[:30]:
            journal.append(row)
        for row in rows[30:35]:
            journal.append({**row, "status": "failed", "content": None, "error": "HTTP 500: earlier"})
    with open(path, "ab") as handle:
        handle.write(b'{"sample_id": "q-00050", "status": "ok", "cont')
    server.reset_stats()
    logs: list[str] = []
    result = generate_partition(prompts, KEY, layout, fast_config(server.base_url), log=logs.append)
    assert (result.resumed, result.requested, result.ok) == (30, 70, 100)
    assert result.torn_bytes_dropped > 0 and any("torn last line" in line for line in logs)
    requested = server.stats()["requests"]
    expected_keys = {served.prompt_key([dict(m) for m in p.messages]) for p in prompts[30:]}
    assert set(requested) == expected_keys and set(requested.values()) == {1}
    final = read_rows(layout)
    assert final.height == 100 and final["sample_id"].n_unique() == 100
    assert final.head(30).equals(done.head(30))  # the kept rows are the very same rows (finished_at included)
    assert not path.exists()


def test_samples_that_left_the_partition_are_dropped(server: FakeServerProcess, layout: DataLayout) -> None:
    prompts = make_prompts(50)
    generate_partition(prompts, KEY, layout, fast_config(server.base_url), log=lambda _m: None)
    server.reset_stats()
    fewer = prompts[:40] + make_prompts(5, tag="new")
    result = generate_partition(fewer, KEY, layout, fast_config(server.base_url), log=lambda _m: None)
    assert (result.total, result.resumed, result.requested) == (45, 40, 5)
    assert read_rows(layout)["sample_id"].to_list() == [p.sample_id for p in fewer]
    assert server.stats()["total_requests"] == 5


def test_second_writer_of_a_partition_is_refused(server: FakeServerProcess, layout: DataLayout) -> None:
    with (
        storage.exclusive_lock(layout.lock_path("synthetic_responses", KEY), "test holder"),
        pytest.raises(storage.PartitionBusyError, match="synthetic_responses partition 00000"),
    ):
        generate_partition(make_prompts(3), KEY, layout, fast_config(server.base_url), log=lambda _m: None)
    assert server.stats()["total_requests"] == 0


def test_duplicate_sample_ids_are_rejected(layout: DataLayout) -> None:
    prompts = make_prompts(3)
    with pytest.raises(ValueError, match="duplicate sample_id"):
        generate_partition([*prompts, prompts[0]], KEY, layout, fast_config("http://127.0.0.1:9/v1"))


# ------------------------------------------------------------------------------------- endpoints, keys


def test_dead_endpoint_is_benched_and_the_live_one_does_the_work(server: FakeServerProcess, layout: DataLayout) -> None:
    dead = "http://127.0.0.1:9/v1"  # discard port: connection refused at once
    config = fast_config(dead, server.base_url, model="fake-model", bench_after_failures=3, bench_s=60)
    logs: list[str] = []
    result = generate_partition(make_prompts(200), KEY, layout, config, log=logs.append)
    assert result.ok == 200
    frame = read_rows(layout)
    assert set(frame["endpoint"]) == {server.base_url}
    assert any("benched" in line and dead in line for line in logs)
    assert result.requests == 200  # the dead endpoint failed the preflight and started benched


def test_two_endpoints_share_the_load_within_their_caps(layout: DataLayout) -> None:
    fake = FakeConfig(token_rate=2000, median_tokens=60)
    with FakeServerProcess(fake) as one, FakeServerProcess(fake) as two:
        config = fast_config(one.base_url, two.base_url, concurrency=40, per_endpoint_cap=20)
        result = generate_partition(make_prompts(300), KEY, layout, config, log=lambda _m: None)
        stats = [one.stats(), two.stats()]
    assert result.ok == 300
    for s in stats:
        assert s["max_in_flight"] <= 20 and s["total_requests"] > 60
    assert sum(s["total_requests"] for s in stats) == 300


SECRET = "sk-test-very-secret-key"


@pytest.mark.parametrize("transport", ["openai", "aiohttp"])
@pytest.mark.parametrize("server", [FakeConfig(token_rate=5000, median_tokens=30, api_key=SECRET)], indirect=True)
def test_api_key_is_sent_and_never_written(server: FakeServerProcess, layout: DataLayout, transport: str) -> None:
    logs: list[str] = []
    result = generate_partition(
        make_prompts(20),
        KEY,
        layout,
        fast_config(server.base_url, api_key=SECRET, transport=transport),
        log=logs.append,
    )
    assert result.ok == 20
    assert SECRET not in "\n".join(logs) and SECRET not in repr(result)
    for path in layout.root.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path

    with pytest.raises(RuntimeError, match="API key") as caught:
        generate_partition(
            make_prompts(5, tag="w"),
            "00001",
            layout,
            fast_config(server.base_url, api_key="wrong-key-123", transport=transport),
            log=logs.append,
        )
    assert "wrong-key-123" not in str(caught.value)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "server",
    [dataclasses.replace(EVERY_FAULT_SERVER, max_model_len=300)],
    indirect=True,
)
def test_aiohttp_transport_has_the_same_semantics(server: FakeServerProcess, layout: DataLayout, stream: bool) -> None:
    prompts = make_prompts(300, tag=f"a{int(stream)}")
    prompts.append(PromptToGenerate("too-long", [{"role": "user", "content": "word " * 400}]))
    config = fast_config(server.base_url, stream=stream, transport="aiohttp")
    result = generate_partition(prompts, KEY, layout, config, log=lambda _m: None)
    assert (result.ok, result.failed, result.total) == (300, 1, 301)
    frame = read_rows(layout)
    assert frame["sample_id"].n_unique() == 301
    failed = frame.filter(pl.col("status") == "failed").row(0, named=True)
    assert failed["error"].startswith("HTTP 400: This model's maximum context length is 300 tokens")
    assert failed["attempts"] == 1
    outcomes = server.stats()["outcomes"]
    assert all(outcomes.get(kind, 0) > 0 for kind in ("error_500", "reset", "hang", "truncate", "invalid_json")), (
        outcomes
    )
    fake = FakeConfig(token_rate=5000, median_tokens=40)
    reasoning, content, n, _ = expected_texts(prompts[5], fake, 2000)
    row = frame.row(5, named=True)
    assert (row["reasoning"], row["content"], row["completion_tokens"]) == (reasoning, content, n)
