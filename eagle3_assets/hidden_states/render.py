"""Render a response as the verifier's training conversation: token ids plus a loss mask on assistant tokens.

The draft must learn the verifier's distribution over exactly the token sequences vLLM will feed it, so the
conversation is rendered with the verifier's own chat template (prompt messages + one assistant turn carrying
``reasoning_content`` and ``content``, the way HF chat templates expect a reasoning answer) and tokenized the
way vLLM tokenizes a rendered chat (``add_special_tokens=False``: the template owns BOS and friends).

The loss mask is found as character spans of the rendered text, then mapped to tokens with the fast
tokenizer's offsets:

* when the template marks the assistant turn with ``{% generation %}`` ... ``{% endgeneration %}``, the spans
  come from transformers' renderer (the same spans ``return_assistant_tokens_mask`` uses);
* otherwise the conversation is rendered twice, the prompt alone with ``add_generation_prompt=True`` and the
  full conversation, and the assistant part starts where the two texts first differ. Using the first
  difference instead of "the prefix text is a prefix" keeps this right for templates whose generation prompt
  already opens a ``<think>`` block (DeepSeek-R1 style) or otherwise differs from the rendered turn's header.

A token is an assistant token when its character span overlaps an assistant span, so a BPE merge across the
boundary counts as assistant (the draft has to produce it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class RenderedSample:
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool  # True when max_seq_len cut the rendered conversation

    @property
    def seq_len(self) -> int:
        return len(self.input_ids)

    @property
    def n_loss_tokens(self) -> int:
        return sum(self.loss_mask)


def assistant_message(reasoning: str | None, content: str | None) -> dict[str, str]:
    """The assistant turn as HF chat templates take a reasoning answer (``reasoning_content`` beside ``content``)."""
    message = {"role": "assistant", "content": content or ""}
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def _plain_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    # Parquet gives structs as dicts, possibly with None fields; templates test `message.content` etc.
    return [{k: v for k, v in dict(m).items() if v is not None} for m in messages]


def common_prefix_length(a: str, b: str) -> int:
    """Where two renderings of one conversation part ways: the start of what the longer one adds."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ChatRenderer:
    """Renders and tokenizes conversations for one tokenizer; build once per partition (template compile, checks)."""

    def __init__(self, tokenizer: Any, max_seq_len: int) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(
                f"{type(tokenizer).__name__} is not a fast tokenizer: the loss mask needs character offsets "
                "(install `tokenizers` / use the model's tokenizer.json)"
            )
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError("the verifier's tokenizer has no chat template; cannot render training conversations")
        if isinstance(template, dict):  # named templates: the default one renders chats
            template = template.get("default") or next(iter(template.values()))
        self.tokenizer = tokenizer
        self.template: str = template
        self.max_seq_len = max_seq_len
        self.uses_generation_tags = bool(_GENERATION_TAG.search(template))

    def _assistant_spans(self, conversation: list[dict[str, Any]], prompt: list[dict[str, Any]]) -> tuple[str, list]:
        if self.uses_generation_tags:
            # lazy: loads transformers (heavy), which only this path needs
            from transformers.utils.chat_template_utils import render_jinja_template

            rendered, indices = render_jinja_template(
                conversations=[conversation],
                chat_template=self.template,
                return_assistant_tokens_mask=True,
                **self.tokenizer.special_tokens_map,
            )
            spans = [tuple(span) for span in indices[0]]
            if spans:
                return rendered[0], spans
            # A template that has the tag but does not wrap this turn: fall through to the diff.
        full = self.tokenizer.apply_chat_template(conversation, tokenize=False)
        prefix = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        start = common_prefix_length(prefix, full)
        return full, [(start, len(full))]

    def render(
        self, messages: Sequence[Mapping[str, Any]], reasoning: str | None, content: str | None
    ) -> RenderedSample:
        prompt = _plain_messages(messages)
        conversation = [*prompt, assistant_message(reasoning, content)]
        text, spans = self._assistant_spans(conversation, prompt)
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        input_ids = list(encoded["input_ids"])
        mask = [0] * len(input_ids)
        for i, (start, end) in enumerate(encoded["offset_mapping"]):
            if end > start and any(end > s and start < e for s, e in spans):
                mask[i] = 1
        truncated = len(input_ids) > self.max_seq_len
        return RenderedSample(input_ids[: self.max_seq_len], mask[: self.max_seq_len], truncated)
