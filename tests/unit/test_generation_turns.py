"""Issue 25: EAGLE3_REGENERATE=all-turns regenerates every assistant turn, in order, on the regenerated history."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.generation import GenerationConfig, PromptToGenerate, generate_partition
from eagle3_assets.generation.turns import model_spans, turns_store_path
from eagle3_assets.hidden_states.samples import loss_mask
from fake_vllm import FakeConfig, prompt_key, serve_in_thread

KEY = "00000"


def _msgs(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": r, "content": c} for r, c in pairs]


CONVERSATION = _msgs(
    ("system", "be brief"),
    ("user", "first question"),
    ("assistant", "DATASET answer one"),
    ("user", "second question"),
    ("assistant", "DATASET answer two"),
    ("user", "third question"),
)


@pytest.fixture
def server() -> Iterator[tuple[str, FakeConfig]]:
    fake = FakeConfig(token_rate=100000, median_tokens=12, sigma=0.3, ttft_s=0.0)
    with serve_in_thread(fake) as url:
        yield url, fake


def _config(url: str, **kw: object) -> GenerationConfig:
    return GenerationConfig(base_urls=[url], model="fake-model", concurrency=4, max_tokens=200, regenerate="all-turns",
                            progress_interval_s=60, **kw)  # type: ignore[arg-type]  # fmt: skip


def _stats(url: str) -> dict:
    from fake_vllm import get_json

    return get_json(url.removesuffix("/v1") + "/stats")


def _turns(layout: DataLayout) -> pl.DataFrame:
    return pl.read_parquet(turns_store_path(layout, KEY)).sort("sample_id")


def test_each_turn_is_asked_on_the_regenerated_history(tmp_path: Path, server: tuple[str, FakeConfig]) -> None:
    url, _ = server
    layout = DataLayout.at(tmp_path)
    prompts = [
        PromptToGenerate("a", CONVERSATION),
        # leading assistant turn dropped (nothing to answer), the empty user turn skipped
        PromptToGenerate(
            "b",
            _msgs(
                ("assistant", "hi"),
                ("user", "q1"),
                ("assistant", "x"),
                ("user", " "),
                ("assistant", "y"),
                ("user", "q2"),
            ),
        ),
    ]
    result = generate_partition(prompts, KEY, layout, _config(url))
    assert (result.ok, result.failed, result.total, result.requested) == (2, 0, 2, 5)
    assert result.turns_regenerated == 5
    turns = {r["sample_id"]: r for r in _turns(layout).iter_rows(named=True)}
    assert sorted(turns) == ["a#turn1", "a#turn2", "a#turn3", "b#turn1", "b#turn2"]
    requests = _stats(url)["requests"]
    assert sum(requests.values()) == 5
    for tid, record in turns.items():
        assert requests[prompt_key(record["messages"])] == 1  # what was sent is what was journaled, once
        assert not any("DATASET" in m["content"] for m in record["messages"])
        sid, k = tid.split("#turn")
        if int(k) > 1:  # the previous turn's own answer is the history
            previous = turns[f"{sid}#turn{int(k) - 1}"]
            assert record["messages"][-2] == {"role": "assistant", "content": previous["content"]}
    assert turns["a#turn1"]["messages"][0] == {"role": "system", "content": "be brief"}
    assert [m["content"] for m in turns["b#turn2"]["messages"] if m["role"] == "user"] == ["q1", "q2"]
    frame = pl.read_parquet(layout.responses_path(KEY))
    row = frame.row(0, named=True)
    assert (row["sample_id"], row["turns_regenerated"], row["turns_total"], row["stop_reason"]) == ("a", 3, 3, None)
    last = turns["a#turn3"]
    assert row["prompt_token_ids"] == last["prompt_token_ids"]  # the whole conversation, as the server tokenized it
    n = len(last["prompt_token_ids"])
    assert row["model_spans"][-1] == [n, n + len(last["completion_token_ids"])]


def test_a_changed_user_turn_regenerates_from_that_turn_on(tmp_path: Path, server: tuple[str, FakeConfig]) -> None:
    url, _ = server
    layout = DataLayout.at(tmp_path)
    generate_partition([PromptToGenerate("a", CONVERSATION)], KEY, layout, _config(url))
    before = _turns(layout)
    edited = [dict(m) for m in CONVERSATION]
    edited[3]["content"] = "second question, edited"
    result = generate_partition([PromptToGenerate("a", edited)], KEY, layout, _config(url))
    assert result.requested == 2 and result.resumed == 1  # turns 2 and 3 again, turn 1 kept
    after = _turns(layout)
    assert after.filter(pl.col("sample_id") == "a#turn1").equals(before.filter(pl.col("sample_id") == "a#turn1"))
    assert "edited" in after.filter(pl.col("sample_id") == "a#turn3")["messages"][0][3]["content"]
    again = generate_partition([PromptToGenerate("a", edited)], KEY, layout, _config(url))
    assert again.requested == 0


def test_a_conversation_outgrowing_the_context_stops_truncated_not_failed(tmp_path: Path) -> None:
    long = " ".join(["word"] * 30)
    conv = _msgs(("user", f"one {long}"), ("user", f"two {long}"), ("user", f"three {long}"))
    fake = FakeConfig(token_rate=100000, median_tokens=10, sigma=0.1, ttft_s=0.0, max_model_len=100)
    layout = DataLayout.at(tmp_path)
    with serve_in_thread(fake) as url:
        result = generate_partition([PromptToGenerate("c", conv)], KEY, layout, _config(url))
        row = pl.read_parquet(layout.responses_path(KEY)).row(0, named=True)
        assert (row["status"], row["turns_regenerated"], row["turns_total"]) == ("ok", 2, 3)
        assert "turn 3 no longer fits the context" in row["stop_reason"]
        assert "maximum context length" in row["stop_reason"]
        assert (result.ok, result.failed, result.truncated) == (1, 0, 1)
        rerun = generate_partition([PromptToGenerate("c", conv)], KEY, layout, _config(url))
    assert rerun.requested == 0 and rerun.ok == 1  # the answered turns stay, nothing is asked again


def test_only_empty_user_turns_fail_with_a_reason(tmp_path: Path, server: tuple[str, FakeConfig]) -> None:
    url, _ = server
    layout = DataLayout.at(tmp_path)
    prompts = [PromptToGenerate("e", _msgs(("system", "s"), ("user", "  "))), PromptToGenerate("a", CONVERSATION)]
    result = generate_partition(prompts, KEY, layout, _config(url))
    assert (result.ok, result.failed, result.total) == (1, 1, 2)
    row = pl.read_parquet(layout.responses_path(KEY)).row(0, named=True)
    assert row["status"] == "failed" and "no non-empty user turn" in row["error"]


# A toy chat template in token ids: <start>=1 <end>=2 assistant=3 user=4; answers end with <end> like vLLM's ids.
def _render(turns: list[tuple[int, list[int]]]) -> list[int]:
    ids: list[int] = []
    for role, words in turns:
        ids += [1, role, *words, 2]
    return [*ids, 1, 3]  # the generation prompt


def test_loss_mask_covers_exactly_the_model_written_turns() -> None:
    u1, a1, u2, a2 = [10, 11], [20, 21, 22], [12], [23, 24]
    p1 = _render([(4, u1)])
    p2 = _render([(4, u1), (3, a1), (4, u2)])
    turns = [
        {"prompt_token_ids": p1, "completion_token_ids": [*a1, 2], "finish_reason": "stop"},
        {"prompt_token_ids": p2, "completion_token_ids": [*a2, 2], "finish_reason": "stop"},
    ]
    spans = model_spans(turns)
    ids = [*p2, *a2, 2]
    mask = loss_mask(len(p2), 3, spans)
    assert [t for t, m in zip(ids, mask, strict=True) if m] == [*a1, 2, *a2, 2]
    # a turn cut by max_tokens has no end token to place it by: left out of the loss, never guessed
    turns[0]["finish_reason"] = "length"
    assert model_spans(turns) == [[len(p2), len(p2) + 3]]


def test_switching_modes_loses_nothing(tmp_path: Path, server: tuple[str, FakeConfig]) -> None:
    url, _ = server
    layout = DataLayout.at(tmp_path)
    prompts = [PromptToGenerate("a", CONVERSATION)]
    last = GenerationConfig(base_urls=[url], model="fake-model", max_tokens=200, progress_interval_s=60)
    assert generate_partition(prompts, KEY, layout, last).requested == 1
    assert generate_partition(prompts, KEY, layout, _config(url)).requested == 3
    back = generate_partition(prompts, KEY, layout, last)  # the last-turn row was set aside, not overwritten
    assert (back.requested, back.ok) == (0, 1)
    assert generate_partition(prompts, KEY, layout, _config(url)).requested == 0


def test_hidden_states_mask_on_a_real_reasoning_template(tmp_path: Path) -> None:
    """With a template that opens <think> in the generation prompt and drops earlier reasoning (DeepSeek-R1 style),
    the rows' spans put the loss on each answer the model wrote and on nothing the user wrote."""
    from transformers import AutoTokenizer

    from eagle3_assets.generation.records import rows_to_frame
    from eagle3_assets.generation.turns import Conversation, conversation_row, turn_id
    from eagle3_assets.hidden_states.samples import read_ok_responses, render_rows
    from support.hidden_states_data import cached_tiny_verifier

    verifier = cached_tiny_verifier()
    tok = AutoTokenizer.from_pretrained(str(verifier))

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    conv = Conversation("s", (), ("the model", "next value"))
    history: list[dict[str, str]] = []
    known = {}
    for k, (user, answer) in enumerate(zip(conv.users, ("answer one", "sum two"), strict=True)):
        history.append({"role": "user", "content": user})
        prompt = ids(tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False))
        completion = ids(f"think hard\n</think>\n\n{answer}<|im_end|>")
        known[turn_id("s", k)] = {
            "sample_id": turn_id("s", k), "messages": list(history), "content": answer, "status": "ok",
            "finish_reason": "stop", "prompt_token_ids": prompt, "completion_token_ids": completion,
        }  # fmt: skip
        history.append({"role": "assistant", "content": answer})
    layout = DataLayout.at(tmp_path)
    layout.responses_path(KEY).parent.mkdir(parents=True)
    rows_to_frame([conversation_row(conv, known, KEY)]).write_parquet(layout.responses_path(KEY))
    ok, _failed = read_ok_responses(layout, KEY)
    rows, served = render_rows(ok, verifier, 4096, len(tok), KEY)
    assert served == 1
    learned = [t for t, m in zip(rows[0].input_ids, rows[0].loss_mask, strict=True) if m]
    text = tok.decode(learned)
    assert text == "answer one<|im_end|>think hard\n</think>\n\nsum two<|im_end|>"
