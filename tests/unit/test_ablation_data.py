"""Issue 25: the ablation's dataset variant trains on exactly the dataset's assistant turns."""

from __future__ import annotations

from eagle3_assets.evaluation.ablation_data import dataset_conversation, tokenize_dataset_conversation


def _msgs(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": r, "content": c} for r, c in pairs]


def test_dataset_conversation_rules() -> None:
    turns = _msgs(("system", "s"), ("assistant", "hello"), ("user", "q1"), ("assistant", "a1"), ("user", "q2"))
    # a leading assistant turn answers nothing; a trailing user turn has no answer to train on
    assert dataset_conversation(turns) == _msgs(("system", "s"), ("user", "q1"), ("assistant", "a1"))
    assert dataset_conversation(_msgs(("user", "q"))) == []


def test_loss_spans_cover_every_dataset_answer_and_no_user_text() -> None:
    from transformers import AutoTokenizer

    from support.hidden_states_data import cached_tiny_verifier

    # the tiny verifier's template opens a reasoning block for the last assistant turn only (as Qwen3's does)
    tokenizer = AutoTokenizer.from_pretrained(str(cached_tiny_verifier()))
    messages = _msgs(("user", "the first question"), ("assistant", "model answer one"),
                     ("user", "the second question"), ("assistant", "draft answer two"))  # fmt: skip
    ids, spans, lost = tokenize_dataset_conversation(tokenizer, messages)
    assert lost == 0 and len(spans) == 2
    texts = [tokenizer.decode(ids[start:end]) for start, end in spans]
    assert "model answer one" in texts[0] and "draft answer two" in texts[1]
    assert not any("question" in text for text in texts)
    outside = tokenizer.decode([t for i, t in enumerate(ids) if not any(s <= i < e for s, e in spans)])
    assert "answer" not in outside
