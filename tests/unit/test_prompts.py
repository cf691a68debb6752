"""The prompt loader: three shapes, history kept, trailing assistant dropped, bad rows rejected with reasons."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from eagle3_assets.prompts.conversations import content_hash_id, load_prompts
from support.common import write_jsonl

GOOD = {"id": "good-1", "messages": [{"role": "user", "content": "What is 2+2?"}]}


def _load(tmp_path: Path, *rows: object):
    return load_prompts(write_jsonl(tmp_path / "p.jsonl", [GOOD, *rows]))


def test_three_shapes_normalize_to_messages(tmp_path: Path) -> None:
    loaded = _load(
        tmp_path,
        {"id": 7, "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"}]},
        {"prompt": "Tell me a joke."},
    )
    assert [p.source_format for p in loaded.prompts] == ["openai", "sharegpt", "prompt"]
    assert loaded.prompts[1].sample_id == "7"
    assert loaded.prompts[1].messages == (("system", "Be brief."), ("user", "Hi"))
    assert loaded.prompts[2].messages == (("user", "Tell me a joke."),)
    assert loaded.prompts[2].sample_id == content_hash_id((("user", "Tell me a joke."),))
    assert not loaded.rejects


def test_multi_turn_keeps_history_and_drops_trailing_assistant_turns(tmp_path: Path) -> None:
    loaded = _load(
        tmp_path,
        {
            "conversations": [
                {"from": "human", "value": "Q1"},
                {"from": "gpt", "value": "A1"},
                {"from": "human", "value": "Q2"},
                {"from": "gpt", "value": "A2"},
                {"from": "gpt", "value": "A2 continued"},
            ]
        },
    )
    assert loaded.prompts[1].messages == (("user", "Q1"), ("assistant", "A1"), ("user", "Q2"))


def test_content_hash_id_is_stable_across_shapes(tmp_path: Path) -> None:
    a = _load(tmp_path, {"prompt": "same text"}).prompts[1]
    b = load_prompts(write_jsonl(tmp_path / "q.jsonl", [{"messages": [{"role": "user", "content": "same text"}]}]))
    assert a.sample_id == b.prompts[0].sample_id


@pytest.mark.parametrize(
    ("bad_line", "reason"),
    [
        ("{not json", "invalid JSON"),
        (json.dumps({"messages": [{"role": "assistant", "content": "only me"}]}), "no turns left"),
        (json.dumps({"messages": [{"role": "system", "content": "sys"}]}), "no user turn"),
        (json.dumps({"messages": [{"role": "user", "content": "   "}]}), "is empty"),
        (json.dumps({"prompt": ""}), "is empty"),
        (json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}), "unknown role 'wizard'"),
        (json.dumps({"conversations": [{"from": "robot", "value": "hi"}]}), "unknown role 'robot'"),
        (json.dumps({"messages": "hello"}), "must be a list"),
        (json.dumps({"messages": [{"role": "user", "content": 5}]}), "must be a string, got int"),
        (json.dumps({"prompt": ["a"]}), "must be a string, got list"),
        (json.dumps({"id": True, "prompt": "x"}), "'id' must be a string or an integer"),
        (json.dumps(["a", "list"]), "must be a JSON object"),
        (json.dumps({"text": "no known field"}), "no 'messages', 'conversations' or 'prompt'"),
        (json.dumps({"prompt": "nul\u0000byte"}), "NUL character"),
        (json.dumps({"id": "good-1", "prompt": "other text"}), "duplicate id 'good-1' with different content"),
        ("[" * 100_000 + "]" * 100_000, "invalid JSON"),
    ],
)
def test_malformed_row_is_rejected_with_reason_and_good_rows_survive(
    tmp_path: Path, bad_line: str, reason: str
) -> None:
    after = {"id": "good-2", "prompt": "still here"}
    loaded = load_prompts(write_jsonl(tmp_path / "p.jsonl", [GOOD, bad_line, after]))
    assert [p.sample_id for p in loaded.prompts] == ["good-1", "good-2"]
    assert len(loaded.rejects) == 1
    assert loaded.rejects[0].line == 2
    assert reason in loaded.rejects[0].reason


def test_invalid_utf8_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"prompt": "\xff\xfe"}\n')
    loaded = load_prompts(path)
    assert len(loaded.prompts) == 1
    assert loaded.rejects[0].line == 2 and "invalid UTF-8" in loaded.rejects[0].reason


def test_exact_duplicates_are_removed_keeping_the_first(tmp_path: Path) -> None:
    loaded = _load(tmp_path, GOOD, {"prompt": "What is 2+2?"}, {"id": "other", "prompt": "new"})
    assert [p.sample_id for p in loaded.prompts] == ["good-1", "other"]
    assert loaded.duplicates == 2


def test_parquet_input(tmp_path: Path) -> None:
    path = tmp_path / "p.parquet"
    pl.DataFrame(
        {"id": ["a", "b"], "messages": [[{"role": "user", "content": "x"}], [{"role": "bogus", "content": "y"}]]}
    ).write_parquet(path)
    loaded = load_prompts(path)
    assert [p.sample_id for p in loaded.prompts] == ["a"]
    assert "unknown role 'bogus'" in loaded.rejects[0].reason


def test_shipped_sample_is_clean_and_varied() -> None:
    from eagle3_assets.core.settings import SAMPLE_PROMPTS_PATH

    loaded = load_prompts(SAMPLE_PROMPTS_PATH)
    assert len(loaded.prompts) >= 3000
    assert not loaded.rejects and loaded.duplicates == 0
    assert {p.source_format for p in loaded.prompts} == {"openai", "sharegpt", "prompt"}
    assert sum(len(p.messages) > 2 for p in loaded.prompts) > 300
    categories = {p.sample_id.rsplit("-", 1)[-1] for p in loaded.prompts if p.sample_id.startswith("sample-")}
    assert {"math", "code", "chat", "reasoning"} <= categories


def test_shipped_sample_is_rebuilt_byte_for_byte(tmp_path: Path) -> None:
    """The module docstring's promise: its words (data/sample_vocabulary.json) and seed make the shipped file."""
    from eagle3_assets.core.settings import SAMPLE_PROMPTS_PATH
    from eagle3_assets.prompts.sample_data import write_sample

    assert write_sample(tmp_path / "sample.jsonl").read_bytes() == SAMPLE_PROMPTS_PATH.read_bytes()


def test_first_turn_keeps_a_leading_system_turn_and_the_first_user_turn(tmp_path: Path) -> None:
    rows = [
        {"id": "a", "conversations": [{"from": "gpt", "value": "split"}, {"from": "human", "value": "q1"},
                                      {"from": "gpt", "value": "a1"}, {"from": "human", "value": "q2"}]},
        {"id": "b", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"},
                                 {"role": "assistant", "content": "a"}]},
    ]  # fmt: skip
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_prompts(path, turns_kept="first")
    assert [p.messages for p in loaded.prompts] == [(("user", "q1"),), (("system", "be brief"), ("user", "q"))]
    everything = load_prompts(path)
    assert everything.prompts[0].messages[-1] == ("user", "q2")  # all: history kept, the last user turn asked


def test_limit_reads_only_the_first_rows(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(10)))
    loaded = load_prompts(path, limit=4)
    assert loaded.rows_read == 4 and [p.messages[0][1] for p in loaded.prompts] == ["p0", "p1", "p2", "p3"]
