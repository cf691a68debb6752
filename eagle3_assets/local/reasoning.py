"""Which vLLM ``--reasoning-parser`` a local server gets: decided by the model's tokenizer, never by its name.

The setting (``EAGLE3_REASONING_PARSER``) is ``auto``, ``none`` or a vLLM parser name. ``auto`` is ``deepseek_r1``
when the tokenizer of the served folder has both ``<think>`` and ``</think>`` (the think-block parser vLLM ships for
DeepSeek-R1, Qwen3 and the demo's tiny verifier), and no parser otherwise: vLLM's think-block parsers refuse a
tokenizer without those tokens at start-up ("could not locate think start/end tokens in the tokenizer"), which is
most instruct models (Llama, Mistral, SmolLM). The tokenizer files are read, the model is not loaded.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

AUTO = "auto"
NONE = "none"
THINK_TOKENS = ("<think>", "</think>")
# vLLM's parser for a <think>...</think> block (vllm/reasoning/deepseek_r1_reasoning_parser.py)
THINK_BLOCK_PARSER = "deepseek_r1"
_PARSER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


def check_reasoning_parser(key: str, value: object) -> str:
    """``auto``, ``none`` or a parser name (letters, digits, ``_ . -``); vLLM checks that the name exists."""
    text = str(value).strip()
    if text.lower() in (AUTO, NONE, ""):
        return text.lower() or NONE
    if not _PARSER_NAME.match(text):
        # lazy: loads pydantic (heavy), which only this path needs
        from eagle3_assets.core.settings import fail

        raise fail(key, value, "must be `auto`, `none` or a vLLM reasoning parser name such as `deepseek_r1`")
    return text


check_reasoning_parser.allowed = "`auto`, `none` or a vLLM reasoning parser name"  # type: ignore[attr-defined]


def _vocab_from_tokenizer_json(path: Path) -> set[str]:
    """Token strings of a ``tokenizer.json``: the model's vocabulary plus its added tokens."""
    data = json.loads(path.read_text(encoding="utf-8"))
    model_vocab = (data.get("model") or {}).get("vocab") or {}
    # BPE/WordPiece/WordLevel keep a dict token -> id; Unigram a list of [token, score]
    tokens = set(model_vocab) if isinstance(model_vocab, dict) else {str(row[0]) for row in model_vocab}
    tokens.update(str(t.get("content")) for t in data.get("added_tokens") or [] if isinstance(t, dict))
    return tokens


@lru_cache(maxsize=32)
def _tokens_of(model_dir: str, mtime_key: tuple[float, ...]) -> frozenset[str]:
    folder = Path(model_dir)
    tokens: set[str] = set()
    tokenizer_json = folder / "tokenizer.json"
    if tokenizer_json.is_file():
        tokens |= _vocab_from_tokenizer_json(tokenizer_json)
    config = folder / "tokenizer_config.json"
    if config.is_file():
        decoder = json.loads(config.read_text(encoding="utf-8")).get("added_tokens_decoder") or {}
        tokens.update(str(t.get("content")) for t in decoder.values() if isinstance(t, dict))
    if not tokenizer_json.is_file():
        # a slow-only tokenizer (sentencepiece / vocab files): let transformers read it, still without the model
        # lazy: loads transformers (heavy), which only this path needs
        from transformers import AutoTokenizer

        try:
            tokens |= set(AutoTokenizer.from_pretrained(str(folder)).get_vocab())
        except (OSError, ValueError) as error:
            raise ValueError(
                f"cannot read the tokenizer of {folder} to choose a reasoning parser ({error}); set "
                "EAGLE3_REASONING_PARSER to `none` or a vLLM parser name instead of `auto`"
            ) from error
    return frozenset(tokens)


def tokenizer_tokens(model_dir: str | Path) -> frozenset[str]:
    """Every token string of the folder's tokenizer (vocabulary and added tokens); cached per file version."""
    folder = Path(model_dir).expanduser().resolve()
    stamps = tuple(
        (folder / name).stat().st_mtime if (folder / name).exists() else 0.0
        for name in ("tokenizer.json", "tokenizer_config.json")
    )
    return _tokens_of(str(folder), stamps)


def has_think_tokens(model_dir: str | Path) -> bool:
    """Whether the tokenizer knows both ``<think>`` and ``</think>`` (what vLLM's think-block parsers need)."""
    tokens = tokenizer_tokens(model_dir)
    return all(t in tokens for t in THINK_TOKENS)


def resolve_reasoning_parser(setting: str | None, model_dir: str | Path) -> str | None:
    """The ``--reasoning-parser`` for a server of ``model_dir``: None for none; ``auto`` decided by its tokenizer.

    ``auto`` on a folder without tokenizer files is no parser (vLLM would then fail on the missing tokenizer with
    its own message, not on the parser).
    """
    value = (setting or NONE).strip()
    if value.lower() == NONE:
        return None
    if value.lower() != AUTO:
        return value
    folder = Path(model_dir).expanduser()
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return THINK_BLOCK_PARSER if has_think_tokens(folder) else None


def describe(setting: str | None, model_dir: str | Path) -> str:
    """One line for logs: what the setting resolved to and why."""
    chosen = resolve_reasoning_parser(setting, model_dir)
    if (setting or NONE).strip().lower() != AUTO:
        return f"reasoning parser {chosen or 'none'} (set)"
    why = "has <think> and </think>" if chosen else "has no <think>/</think> tokens"
    return f"reasoning parser {chosen or 'none'} (auto: the tokenizer {why})"
