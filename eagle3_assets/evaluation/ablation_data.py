"""The regeneration ablation's inputs: the conversations every variant shares, and the dataset variant's rows.

The conversations are the first ``n`` rows of ``raw_prompts`` (in dataset order) whose dataset turns hold an
assistant answer; the held-out prompts are the rows after them, so no held-out prompt is ever trained on. The
``dataset`` variant's rows are the dataset's own conversation (up to its last assistant answer), rendered with the
verifier's chat template, with the loss on every assistant turn the dataset wrote: the same row schema the generation
engine writes (``prompt_token_ids`` + ``completion_token_ids`` + ``model_spans``), so hidden-state extraction and
training read them exactly as they read the model's own answers.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.generation.records import STATUS_OK, PromptToGenerate, normalize_messages, rows_to_frame
from eagle3_assets.hidden_states.render import common_prefix_length
from eagle3_assets.prompts.prompt_table import dataset_turns_path

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class AblationConversation:
    """One conversation as the dataset has it (:func:`dataset_conversation`), the one thing every variant uses."""

    sample_id: str
    dataset: tuple[dict[str, str], ...]  # a leading system turn, then the first user turn to the last answer

    def request(self) -> PromptToGenerate:
        """What regeneration asks: the conversation without its last answer (it ends on the user turn that answer
        answered); last-turn mode regenerates that answer, all-turns mode every answer."""
        return PromptToGenerate(self.sample_id, list(self.dataset[:-1]))


def dataset_conversation(turns: Sequence[Mapping[str, Any]]) -> Messages:
    """The dataset's conversation as trained on: a leading system turn kept, assistant turns before the first user
    turn dropped (nothing was asked), turns after the last assistant answer dropped (nothing answers them)."""
    messages = normalize_messages(turns)
    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        return []
    body = messages[first_user:]
    last_answer = max((i for i, m in enumerate(body) if m["role"] == "assistant"), default=-1)
    return [*system, *body[: last_answer + 1]] if last_answer >= 0 else []


def select_conversations(
    layout: DataLayout, n: int, held_out: int, max_chars: int
) -> tuple[list[AblationConversation], list[PromptToGenerate]]:
    """(the ``n`` training conversations, the ``held_out`` prompts after them) from ``raw_prompts``.

    A conversation is taken from the dataset's own turns (``dataset_turns.parquet``), whatever turns raw_prompts kept
    for the pipeline (``EAGLE3_PROMPTS_TURNS``); one longer than ``max_chars`` is passed over, so that every variant
    can be asked the whole of every conversation within the server's context."""
    table, turns_path = layout.prompts_path, dataset_turns_path(layout)
    if not table.exists():
        raise FileNotFoundError(f"no raw_prompts table at {table}: materialize raw_prompts first")
    if not turns_path.exists():
        raise FileNotFoundError(
            f"no {turns_path.name} beside raw_prompts ({turns_path}): it holds the dataset's own answers, written by "
            "raw_prompts since the regeneration ablation exists; re-materialize raw_prompts (positions are kept)"
        )
    prompts = pl.read_parquet(table, columns=["sample_id", "position", "messages"]).sort("position")
    turns = pl.read_parquet(turns_path).rename({"messages": "dataset_messages"})
    frame = prompts.join(turns, on="sample_id", how="left", maintain_order="left")
    chosen: list[AblationConversation] = []
    rest = 0
    for row in frame.iter_rows(named=True):
        if len(chosen) == n:
            break
        rest += 1
        dataset = dataset_conversation(row["dataset_messages"] or [])
        chars = sum(len(m["content"]) for m in dataset)
        if any(m["role"] == "assistant" for m in dataset) and chars <= max_chars:
            chosen.append(AblationConversation(row["sample_id"], tuple(dataset)))
    if len(chosen) < n:
        raise ValueError(
            f"conversations={n}: raw_prompts at {table} has only {len(chosen)} rows with a dataset answer within "
            f"max_conversation_chars={max_chars}; lower conversations, raise max_conversation_chars or use a larger "
            "dataset (EAGLE3_PROMPTS_PATH, EAGLE3_PROMPTS_LIMIT)"
        )
    after = frame.slice(rest, held_out)
    if after.height < held_out:
        raise ValueError(
            f"held_out={held_out}: raw_prompts has only {after.height} rows after the {n} training conversations; "
            "lower held_out or conversations"
        )
    held = [PromptToGenerate(r["sample_id"], normalize_messages(r["messages"])) for r in after.iter_rows(named=True)]
    return chosen, held


def _assistant_char_spans(tokenizer: Any, messages: Messages) -> tuple[str, list[tuple[int, int]], int]:
    """(rendered text, character spans of each assistant turn, turns that could not be placed).

    A turn starts where the conversation leaves the history rendered with the generation prompt (templates that
    open a reasoning block for the last turn only differ there), and ends after its content and the end-of-turn
    text the template puts after it. A turn whose content cannot be found in the rendered conversation (a template
    that rewrites it) is left out of the loss rather than guessed."""
    render = tokenizer.apply_chat_template
    full = render(messages, tokenize=False)
    spans: list[tuple[int, int]] = []
    lost = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        content = message["content"]
        before = render(messages[:i], tokenize=False, add_generation_prompt=True)
        start = max(common_prefix_length(before, full), spans[-1][1] if spans else 0)
        at = full.find(content, start) if content else -1
        if at < 0:
            lost += 1
            continue
        end = at + len(content)
        through = render(messages[: i + 1], tokenize=False)
        tail = through[through.rfind(content) + len(content) :]
        if tail and full.startswith(tail, end):
            end += len(tail)
        spans.append((start, end))
    return full, spans, lost


def tokenize_dataset_conversation(tokenizer: Any, messages: Messages) -> tuple[list[int], list[list[int]], int]:
    """(token ids, [start, end) token spans of the dataset's assistant turns, turns left out of the loss)."""
    text, char_spans, lost = _assistant_char_spans(tokenizer, messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    mask = [
        any(end > s and start < e for s, e in char_spans) and end > start for start, end in encoded["offset_mapping"]
    ]
    spans: list[list[int]] = []
    for i, inside in enumerate(mask):
        if inside and (i == 0 or not mask[i - 1]):
            spans.append([i, i + 1])
        elif inside:
            spans[-1][1] = i + 1
    return ids, spans, lost


def dataset_rows(
    conversations: Sequence[AblationConversation], verifier_path: Path, partition_key: str
) -> tuple[pl.DataFrame, int]:
    """The dataset variant's responses partition (the engine's row schema) and how many turns were left out."""
    # lazy: loads transformers (heavy), which only this path needs
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(verifier_path))
    rows, lost_total = [], 0
    for conv in conversations:
        messages = list(conv.dataset)
        ids, spans, lost = tokenize_dataset_conversation(tokenizer, messages)
        lost_total += lost
        split = spans[-1][0] if spans else len(ids)
        rows.append(
            {
                "sample_id": conv.sample_id,
                "partition_key": partition_key,
                "messages": messages[:-1],
                "content": messages[-1]["content"],
                "status": STATUS_OK,
                "finish_reason": "stop",
                "prompt_tokens": split,
                "completion_tokens": len(ids) - split,
                "prompt_token_ids": ids[:split],
                "completion_token_ids": ids[split:],
                "model_spans": spans,
                "model_tokens": 0,  # none of this text is the served model's own
                "turns_regenerated": 0,
                "turns_total": sum(1 for m in messages if m["role"] == "assistant"),
                "finished_at": time.time(),
            }
        )
    return rows_to_frame(rows), lost_total
