"""Unit tests of the generation engine's parts: config, journal, response parsing, a partition's prompts.

Error classes, backoff and endpoint routing: tests/unit/test_generation_retries.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_assets.core.settings import ConfigError
from eagle3_assets.generation.errors import RequestFailed
from eagle3_assets.generation.generation_config import GenerationConfig
from eagle3_assets.generation.journal import Journal, merge_records, read_journal
from eagle3_assets.generation.records import COLUMNS, RESPONSE_SCHEMA, rows_to_frame
from eagle3_assets.generation.replies import StreamState, parse_completion
from eagle3_assets.net.credentials import display_url

URL = "http://127.0.0.1:8000/v1"


# ------------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("concurrency", 0),
        ("concurrency", True),
        ("max_tokens", -1),
        ("max_attempts", 0),
        ("request_timeout_s", 0),
        ("idle_timeout_s", float("nan")),
        ("per_endpoint_cap", 0),
        ("top_p", 0),
        ("temperature", -1),
        ("model", "  "),
        ("backoff_base_s", 100.0),
    ],
)
def test_config_rejects_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as caught:
        GenerationConfig(base_urls=[URL], **{field: value})
    assert str(caught.value).startswith(f"{field}=")


@pytest.mark.parametrize("urls", [[], ["ftp://x/v1"], ["localhost:8000"], [URL, URL + "/"]])
def test_config_rejects_bad_urls(urls: list[str]) -> None:
    with pytest.raises(ConfigError, match="base_urls="):
        GenerationConfig(base_urls=urls)


def test_config_defaults_and_sampling_params() -> None:
    config = GenerationConfig(base_urls=(URL + "/",), seed=7, extra_sampling={"top_k": 20})
    assert config.base_urls == (URL,)
    assert config.max_tokens == 8000 and config.request_timeout_s == 1800 and config.concurrency == 128
    assert config.endpoint_cap == 128
    assert config.sampling_params() == {"max_tokens": 8000, "seed": 7, "top_k": 20}  # unset: the model's defaults
    assert GenerationConfig(base_urls=[URL], temperature=0.6, top_p=0.95).sampling_params() == {
        "max_tokens": 8000,
        "temperature": 0.6,
        "top_p": 0.95,
    }
    with pytest.raises(ConfigError, match="extra_sampling="):
        GenerationConfig(base_urls=[URL], extra_sampling={"stream": True})


def test_api_key_is_not_in_repr_and_is_redacted() -> None:
    config = GenerationConfig(base_urls=[URL], api_key="sk-secret-123")
    assert "sk-secret-123" not in repr(config)
    assert config.redact("Bearer sk-secret-123 failed") == "Bearer *** failed"


def test_display_url_drops_credentials() -> None:
    assert display_url("http://user:pw@host:8000/v1") == "http://host:8000/v1"


# ----------------------------------------------------------------------------------------------- journal


def _record(sample_id: str, status: str = "ok", **extra: object) -> dict[str, object]:
    base = dict.fromkeys(COLUMNS)
    base.update(
        sample_id=sample_id,
        partition_key="00000",
        status=status,
        messages=[{"role": "user", "content": "q"}],
        attempts=1,
        latency_s=0.1,
        finished_at=1.0,
    )
    base.update(extra)
    return base


def test_journal_drops_torn_last_line_and_cuts_it_before_appending(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    with Journal.open(path) as journal:
        journal.append(_record("a"))
        journal.append(_record("b", "failed", error="boom"))
    with open(path, "ab") as handle:
        handle.write(b'{"sample_id": "c", "status": "o')  # a kill mid-write
    contents = read_journal(path)
    assert sorted(contents.records) == ["a", "b"]
    assert contents.torn_bytes == len(b'{"sample_id": "c", "status": "o')
    with Journal.open(path, valid_size=contents.valid_size) as journal:
        journal.append(_record("c"))
    again = read_journal(path)
    assert sorted(again.records) == ["a", "b", "c"] and again.torn_bytes == 0 and again.corrupt_lines == 0
    assert again.lines == 3


def test_journal_dedupes_ok_wins_then_latest(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    with Journal.open(path) as journal:
        journal.append(_record("a", "failed", error="first"))
        journal.append(_record("a", "ok", content="yes"))
        journal.append(_record("a", "failed", error="late failure must not replace ok"))
        journal.append(_record("b", "failed", error="first"))
        journal.append(_record("b", "failed", error="second"))
    records = read_journal(path).records
    assert records["a"]["status"] == "ok" and records["a"]["content"] == "yes"
    assert records["b"]["error"] == "second"
    merged = merge_records({"a": _record("a", "ok", content="old")}, {"a": _record("a", "failed")})
    assert merged["a"]["content"] == "old"


def test_journal_missing_file_is_empty(tmp_path: Path) -> None:
    contents = read_journal(tmp_path / "nope.jsonl")
    assert contents.records == {} and contents.valid_size == 0


def test_rows_to_frame_has_the_exact_schema() -> None:
    frame = rows_to_frame([_record("a", content="c", reasoning="r", prompt_tokens=3)])
    assert frame.schema == RESPONSE_SCHEMA and frame.columns == list(COLUMNS)
    assert frame["messages"].to_list() == [[{"role": "user", "content": "q"}]]


# ------------------------------------------------------------------------------------ response parsing


def _completion(message: dict[str, object], finish: str | None = "stop", choices: bool = True) -> bytes:
    return json.dumps(
        {
            "id": "x",
            "object": "chat.completion",
            "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}] if choices else [],
            "usage": {"prompt_tokens": 3, "completion_tokens": 5},
        }
    ).encode()


def test_parse_reads_reasoning_then_legacy_reasoning_content() -> None:
    new = parse_completion(_completion({"role": "assistant", "content": "A", "reasoning": "R"}))
    assert (new.reasoning, new.content, new.finish_reason, new.prompt_tokens, new.completion_tokens) == (
        "R",
        "A",
        "stop",
        3,
        5,
    )
    legacy = parse_completion(_completion({"role": "assistant", "content": "A", "reasoning_content": "L"}))
    assert legacy.reasoning == "L"
    both = parse_completion(_completion({"content": "A", "reasoning": None, "reasoning_content": "L"}))
    assert both.reasoning == "L"
    none = parse_completion(_completion({"content": "A"}))
    assert none.reasoning is None


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b'{"id": "x", "choices": [', "invalid JSON"),
        (b'{"status": "ok"}', "not a chat completion"),
        (b"[1, 2]", "not a chat completion"),
        (b"<html>bad gateway</html>", "invalid JSON"),
        (_completion({"content": "A"}, choices=False), "no choices"),
        (_completion({"content": "A"}, finish=None), "no finish_reason"),
    ],
)
def test_bad_bodies_are_retryable(body: bytes, fragment: str) -> None:
    with pytest.raises(RequestFailed) as caught:
        parse_completion(body)
    assert caught.value.retryable and fragment in caught.value.message


def _body(**changes: object) -> bytes:
    """A chat completion with some top-level, choice, message or usage fields replaced (dotted keys)."""
    data: dict = {
        "model": "m",
        "choices": [{"message": {"content": "A", "reasoning": "R"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 5},
    }
    for key, value in changes.items():
        target = data
        *path, last = key.split(".")
        for part in path:
            target = target["choices"][0] if part == "choice" else target[part]
        target[last] = value
    return json.dumps(data).encode()


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (_body(**{"choice.message.content": ["A"]}), "choices[0].message.content is an array, expected a string"),
        (_body(**{"choice.message.content": 7}), "choices[0].message.content is a number"),
        (_body(**{"choice.message.reasoning": {"t": "R"}}), "choices[0].message.reasoning is an object"),
        (
            _body(**{"choice.message.reasoning": None, "choice.message.reasoning_content": True}),
            "choices[0].message.reasoning_content is a boolean",
        ),
        (_body(**{"choice.finish_reason": 1}), "choices[0].finish_reason is a number"),
        (_body(**{"usage.prompt_tokens": "3"}), "usage.prompt_tokens is a string, expected a non-negative integer"),
        (_body(**{"usage.completion_tokens": 5.0}), "usage.completion_tokens is a number"),
        (_body(**{"usage.completion_tokens": -1}), "usage.completion_tokens is a negative number"),
        (_body(**{"usage.prompt_tokens": True}), "usage.prompt_tokens is a boolean"),
        (_body(usage=[3, 5]), "usage is an array, expected an object"),
        (_body(model=["m"]), "model is an array"),
    ],
)
def test_a_field_of_the_wrong_type_is_a_retryable_failure_naming_it(body: bytes, fragment: str) -> None:
    with pytest.raises(RequestFailed) as caught:
        parse_completion(body)
    assert caught.value.retryable and caught.value.message.startswith(f"reply field {fragment}"), caught.value


@pytest.mark.parametrize(
    ("event", "fragment"),
    [
        ({"choices": [{"delta": {"content": ["a"]}}]}, "choices[0].delta.content is an array"),
        ({"choices": [{"delta": {"reasoning": {"a": 1}}}]}, "choices[0].delta.reasoning is an object"),
        ({"choices": [{"delta": "a"}]}, "choices[0].delta is a string, expected an object"),
        ({"choices": ["a"]}, "choices[0] is a string, expected an object"),
        ({"choices": [{"delta": {}, "finish_reason": 3}]}, "choices[0].finish_reason is a number"),
        ({"choices": [], "usage": "3 5"}, "usage is a string, expected an object"),
        ({"choices": [], "model": 1}, "model is a number"),
    ],
)
def test_a_stream_field_of_the_wrong_type_is_a_retryable_failure_naming_it(event: object, fragment: str) -> None:
    with pytest.raises(RequestFailed) as caught:
        StreamState().feed(json.dumps(event).encode())
    assert caught.value.retryable and caught.value.message.startswith(f"reply field {fragment}")


def test_stream_usage_strings_fail_when_the_completion_is_assembled() -> None:
    state = StreamState()
    _sse(
        state,
        {"choices": [{"delta": {"content": "a"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": "1", "completion_tokens": 1}},
        b"[DONE]",
    )
    with pytest.raises(RequestFailed, match=r"^reply field usage.prompt_tokens is a string"):
        state.result()


def _sse(state: StreamState, *events: object) -> None:
    for event in events:
        state.feed(event if isinstance(event, bytes) else json.dumps(event).encode())


def test_stream_state_joins_deltas_in_both_shapes() -> None:
    for name in ("reasoning", "reasoning_content"):
        state = StreamState()
        _sse(
            state,
            {"choices": [{"delta": {"role": "assistant", "content": ""}}], "model": "m"},
            {"choices": [{"delta": {name: "thi"}}]},
            {"choices": [{"delta": {name: "nk"}}]},
            {"choices": [{"delta": {"content": "ans"}}]},
            {"choices": [{"delta": {"content": "wer"}}]},
            {"choices": [{"delta": {}, "finish_reason": "length"}]},
            {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 9}},
            b"[DONE]",
        )
        result = state.result()
        assert state.done
        assert (result.reasoning, result.content, result.finish_reason, result.completion_tokens) == (
            "think",
            "answer",
            "length",
            9,
        )


def test_stream_without_finish_reason_is_a_retryable_truncation() -> None:
    state = StreamState()
    _sse(state, {"choices": [{"delta": {"content": "partial"}}]}, {"choices": [], "usage": {}}, b"[DONE]")
    with pytest.raises(RequestFailed, match="truncated stream") as caught:
        state.result()
    assert caught.value.retryable


@pytest.mark.parametrize(
    "event", [b'{"choices": [{"delta"', b'{"status": "ok"}', b'"text"', b'{"error": {"message": "engine died"}}']
)
def test_bad_stream_events_are_retryable(event: bytes) -> None:
    with pytest.raises(RequestFailed) as caught:
        StreamState().feed(event)
    assert caught.value.retryable


# --------------------------------------------------------------------------------- a partition's prompts


def test_partition_prompts_reads_one_partition_in_position_order(tmp_path: Path) -> None:
    import polars as pl

    from eagle3_assets.core.storage import DataLayout
    from eagle3_assets.generation import partition_prompts

    layout = DataLayout.at(tmp_path)
    with pytest.raises(FileNotFoundError, match="raw_prompts"):
        partition_prompts(layout, "00000")
    layout.prompts_path.parent.mkdir(parents=True)
    rows = [
        {
            "sample_id": f"s{p}",
            "position": p,
            "partition_key": f"{p // 3:05d}",
            "messages": [{"role": "user", "content": f"m{p}"}],
        }
        for p in (4, 0, 2, 1, 3, 5, 6)
    ]
    pl.DataFrame(rows).write_parquet(layout.prompts_path)
    prompts = partition_prompts(layout, "00001")
    assert [p.sample_id for p in prompts] == ["s3", "s4", "s5"]
    assert prompts[0].messages == [{"role": "user", "content": "m3"}]
    assert partition_prompts(layout, "00009") == []


# --------------------------------------------------------------------------------------------- token ids


def _body_with_ids(prompt_ids: object, ids: object, prompt_tokens: int = 3, completion_tokens: int = 2) -> bytes:
    return json.dumps(
        {
            "model": "m",
            "prompt_token_ids": prompt_ids,
            "choices": [{"message": {"content": "x"}, "finish_reason": "stop", "token_ids": ids}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
        }
    ).encode()


def test_token_ids_are_parsed_and_checked_against_usage() -> None:
    completion = parse_completion(_body_with_ids([5, 6, 7], [8, 9]))
    assert (completion.prompt_token_ids, completion.completion_token_ids) == ([5, 6, 7], [8, 9])
    # absent (a server without return_token_ids): None, not an error
    assert parse_completion(_body_with_ids(None, None)).completion_token_ids is None
    # a server that lies: ids that disagree with usage, or are not token ids, are a retryable bad body
    for prompt_ids, ids, why in (
        ([5, 6, 7], [8], "token_ids has 1 ids but usage says 2"),
        ([5, 6], [8, 9], "prompt_token_ids has 2 ids but usage says 3"),
        ([5, 6, 7], [8, "9"], "token_ids is not a list of non-negative integers"),
        ([5, 6, -7], [8, 9], "prompt_token_ids is not a list of non-negative"),
    ):
        with pytest.raises(RequestFailed, match=why) as caught:
            parse_completion(_body_with_ids(prompt_ids, ids))
        assert caught.value.retryable


def test_stream_token_ids_are_assembled_across_chunks() -> None:
    state = StreamState()
    state.feed(
        json.dumps(
            {"model": "m", "prompt_token_ids": [1, 2], "choices": [{"delta": {"reasoning": "a"}, "token_ids": [3, 4]}]}
        ).encode()
    )
    state.feed(json.dumps({"choices": [{"delta": {"content": "b"}, "token_ids": [5]}]}).encode())
    state.feed(json.dumps({"choices": [{"delta": {}, "token_ids": [], "finish_reason": "stop"}]}).encode())
    state.feed(json.dumps({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}}).encode())
    completion = state.result()
    assert (completion.prompt_token_ids, completion.completion_token_ids) == ([1, 2], [3, 4, 5])
