"""What a plan is made from: the verifier's shape, the prompts' tokens, a completion length, rates; and the
exact bytes of one hidden-state sample file."""

from __future__ import annotations

import functools
import json
import math
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_assets.core.verifier import resolve_layer_ids
from eagle3_assets.hidden_states.storage_format import (
    FP8,
    SCALES_KEY,
    STORAGE_DTYPES,
    bytes_per_token,
    safetensors_dtype,
)
from eagle3_assets.prompts.conversations import DatasetScan, Duplicate, Prompt, Reject

PLANNED_DTYPES = ("bfloat16", FP8)
_TOKEN_ID_BYTES = 8  # int64 token_ids beside the states in every sample file


class PlanError(ValueError):
    """An input the plan cannot use; the message names it."""


# ------------------------------------------------------------------------------------------ bytes


@functools.lru_cache(maxsize=1 << 16)  # a plan asks for the same few lengths many times
def sample_file_bytes(tokens: int, n_states: int, hidden_size: int, dtype: str) -> int:
    """Bytes of one sample file of ``tokens`` tokens as ``write_sample`` writes it (safetensors): the 8-byte header
    length, the JSON header padded to 8 bytes, the states (+ FP8's scales) and the int64 token ids."""
    if dtype not in STORAGE_DTYPES:
        raise PlanError(f"dtype={dtype!r}: must be one of {sorted(STORAGE_DTYPES)}")
    # safetensors lays tensors out by alignment, widest first, then by name: token ids, FP8's scales, the states
    tensors = [("token_ids", "I64", [tokens], tokens * _TOKEN_ID_BYTES)]
    if dtype == FP8:
        tensors.append((SCALES_KEY, "F32", [tokens, n_states, 1], tokens * n_states * 4))
    values = tokens * n_states * hidden_size * STORAGE_DTYPES[dtype]
    tensors.append(("hidden_states", safetensors_dtype(dtype), [tokens, n_states, hidden_size], values))
    header: dict[str, Any] = {}
    offset = 0
    for name, kind, shape, size in tensors:
        header[name] = {"dtype": kind, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = len(json.dumps(header, separators=(",", ":")))
    assert offset == tokens * (bytes_per_token(dtype, n_states, hidden_size) + _TOKEN_ID_BYTES)
    return 8 + text + (-text) % 8 + offset


# ------------------------------------------------------------------------------------------ inputs


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    vocab_size: int
    layer_ids: tuple[int, ...]  # EAGLE-3's auxiliary layers (resolved); the last layer's output is stored too
    source: str

    @property
    def n_states(self) -> int:
        return len(self.layer_ids) + 1


def model_shape(
    config: str | Path | None = None,
    hidden_size: int | None = None,
    num_layers: int | None = None,
    vocab_size: int | None = None,
    layer_ids: Sequence[int] | None = None,
) -> ModelShape:
    """The verifier's shape from its ``config.json`` (a file or the model folder), any field overridden or stated."""
    found: dict[str, Any] = {}
    source = "stated"
    if config is not None:
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise PlanError(f"cannot read the model config {path}: {error}") from None
        raw = raw.get("text_config", raw)  # multimodal wrappers keep the LM config inside
        found = {k: raw.get(k) for k in ("hidden_size", "num_hidden_layers", "vocab_size")}
        source = str(path)
    stated = {"hidden_size": hidden_size, "num_hidden_layers": num_layers, "vocab_size": vocab_size}
    values = {k: v if v is not None else found.get(k) for k, v in stated.items()}
    missing = [k for k in ("hidden_size", "num_hidden_layers") if not values[k]]
    if missing:
        raise PlanError(f"the model's {' and '.join(missing)} are unknown: give a config.json or state them")
    if config is not None and any(v is not None for v in stated.values()):
        source += " (with stated values)"
    layers = int(values["num_hidden_layers"])
    ids = tuple(resolve_layer_ids(list(layer_ids) if layer_ids is not None else None, layers))
    return ModelShape(int(values["hidden_size"]), layers, int(values["vocab_size"] or 0), ids, source)


@dataclass
class Prompts:
    """Prompt tokens of every sample, in position order (an ``array`` of int64: 8 bytes a sample), and their source."""

    tokens: array
    source: str
    dataset: str = ""
    rows_read: int = 0
    rejected: int = 0
    duplicates: int = 0

    @property
    def samples(self) -> int:
        return len(self.tokens)


def stated_prompts(samples: int, mean_tokens: float) -> Prompts:
    """``samples`` prompts of ``mean_tokens`` tokens on average (integers summing to round(samples x mean))."""
    if samples <= 0 or mean_tokens < 0:
        raise PlanError(f"samples={samples}, prompt tokens={mean_tokens}: need samples > 0 and tokens >= 0")
    return Prompts(_spread(samples, mean_tokens), f"stated: {mean_tokens:g} tokens a prompt")


def _spread(samples: int, mean: float) -> array:
    base = math.floor(mean)
    extra = round(samples * mean) - base * samples
    return array("q", [base + 1] * extra + [base] * (samples - extra))


def chat_token_counter(tokenizer: Any) -> Callable[[list[dict[str, str]]], int]:
    """Tokens of a chat request's prompt: the messages rendered with the tokenizer's chat template, with the
    assistant's generation prompt (what vLLM's chat endpoint feeds the model)."""

    def count(messages: list[dict[str, str]]) -> int:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return len(ids)

    return count


def dataset_prompts(
    path: str | Path,
    *,
    max_prompt_chars: int,
    truncated: str,
    turns: str,
    limit: int,
    count_tokens: Callable[[list[dict[str, str]]], int] | None = None,
    tokenizer_name: str = "",
    tokenize_max: int = 20_000,
    chars_per_token: float | None = None,
) -> Prompts:
    """The dataset's prompts as ``raw_prompts`` keeps them, with their token counts: the first ``tokenize_max``
    tokenized with ``count_tokens``, the rest estimated from their characters at the ratio measured on those (or at
    ``chars_per_token`` when there is no tokenizer). Memory: the scan's per-sample digests and two ints a sample."""
    if count_tokens is None and not chars_per_token:
        raise PlanError("prompt tokens: give a tokenizer (the model folder) or a chars-per-token ratio")
    scan = DatasetScan(path, max_prompt_chars=max_prompt_chars, truncated=truncated, turns_kept=turns, limit=limit)
    tokens, chars = array("q"), array("q")
    rejected = duplicates = 0
    counted_tokens = counted_chars = 0
    for outcome in scan:
        if isinstance(outcome, Reject):
            rejected += 1
        elif isinstance(outcome, Duplicate):
            duplicates += 1
        elif isinstance(outcome, Prompt):
            chars.append(outcome.prompt_chars)
            if count_tokens is not None and len(tokens) < tokenize_max:
                tokens.append(count_tokens(outcome.messages_as_dicts()))
                counted_tokens += tokens[-1]
                counted_chars += chars[-1]
            else:
                tokens.append(-1)
    estimated = sum(1 for t in tokens if t < 0)
    if count_tokens is not None and counted_tokens:
        ratio = counted_chars / counted_tokens
        source = f"tokenized with {tokenizer_name or 'the tokenizer'}'s chat template"
        if estimated:
            source += (
                f" (the first {len(tokens) - estimated:,}; the other {estimated:,} at their {ratio:.3f} chars/token)"
            )
        else:
            source += f" ({len(tokens):,} prompts)"
    else:
        ratio = float(chars_per_token or 0)
        source = f"characters at a stated {ratio:g} chars/token"
    if estimated:
        if ratio <= 0:
            raise PlanError("prompt tokens: no prompt was tokenized and no chars-per-token ratio was given")
        for i, t in enumerate(tokens):
            if t < 0:
                tokens[i] = max(1, round(chars[i] / ratio))
    return Prompts(tokens, source, str(path), scan.rows_read, rejected, duplicates)


@dataclass(frozen=True)
class Completion:
    mean_tokens: float  # per ok sample
    source: str
    upper_bound: bool = False


@dataclass(frozen=True)
class Rate:
    tokens_per_s: float | None  # None: not given, the stage's time is not planned
    source: str

    def seconds(self, tokens: int) -> float | None:
        return tokens / self.tokens_per_s if self.tokens_per_s else None


NO_RATE = Rate(None, "no rate given")


def stated_rate(value: float) -> Rate:
    if not value > 0:
        raise PlanError(f"rate {value!r}: must be a positive number of tokens/s")
    return Rate(float(value), "stated")
