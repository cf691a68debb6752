"""A tiny Hugging Face tokenizer folder, with or without ``<think>`` / ``</think>``, built locally in milliseconds."""

from __future__ import annotations

from pathlib import Path

WORDS = [
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "with",
    "as",
    "was",
    "by",
    "this",
    "be",
    "are",
    "def",
    "return",
    "if",
    "else",
]
SPECIALS = ["<|begin_of_text|>", "<|im_end|>", "<|im_start|>", "<|pad|>", "[UNK]"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def write_tokenizer(folder: Path, think_tokens: bool, vocab_padding: int = 0) -> Path:
    """``tokenizer.json`` + ``tokenizer_config.json`` of a word-level tokenizer (ChatML template); ``think_tokens``
    adds ``<think>`` and ``</think>`` as added tokens, the way reasoning models ship them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    words = SPECIALS + WORDS + [f"w{i}" for i in range(vocab_padding)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|begin_of_text|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token="[UNK]",
        additional_special_tokens=["<|im_start|>"],
    )
    if think_tokens:
        fast.add_tokens(["<think>", "</think>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return folder
