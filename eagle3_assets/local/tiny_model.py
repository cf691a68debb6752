"""Build a tiny Llama verifier + byte-level BPE tokenizer locally, with no downloads.

The model is random but *structured*: besides seeded random weights it carries a few hand-set channels so that a
served completion looks like a reasoning model's answer (``reasoning</think>content<|im_end|>``) instead of an
endless stream of tokens:

* residual channel ``ONE`` holds a constant in every token embedding (a bias the lm_head can read);
* ``THINK_END`` is set only in the ``</think>`` embedding; attention head 0 of layer 0 looks for it (query from
  ``ONE``, key from ``THINK_END``, on the lowest-frequency RoPE pair so position barely matters) and writes
  "``</think>`` already seen" into channel ``SEEN``;
* ``TRIG_THINK`` / ``TRIG_EOS`` are set in the embeddings of two small random token subsets.  The lm_head row of
  ``</think>`` reads ``TRIG_THINK`` minus a large ``SEEN`` term, the row of the eos token reads ``TRIG_EOS`` and
  ``SEEN`` minus ``ONE``: greedy decoding therefore emits ``</think>`` once, the first time the current token is a
  think-trigger, and ends with eos the first time the current token is an eos-trigger after that;
* the other special tokens (bos, pad, ``<|im_start|>``, ``<think>``), byte tokens that are not valid UTF-8 alone,
  tokens with control characters and ids past the trained vocabulary get a strongly negative logit, so served text
  is clean UTF-8;
* each token's lm_head row points away from its own embedding, so greedy text never repeats a token immediately.

Nothing else writes to the reserved channels, so the mechanism is exact, not learned.  Reasoning/content lengths
are roughly geometric (means ~ 1/fraction of trigger tokens, tunable); measured with seed 0 on the first 256 sample
prompts, greedy completions have mean ~90, median ~70, max ~360 tokens, all ending with eos before 512 and all with
non-empty reasoning and content, so no ``ignore_eos`` is needed. Otherwise the next token is mostly a function of
the current one (a bigram table fitted on 500 greedy completions predicts 67% of the next tokens of 500 others),
which is what lets a small EAGLE-3 draft reach a useful acceptance length on this verifier.

Everything is generated with numpy's PCG64 from ``seed`` and files are written by hand (sorted keys), so the same
seed gives the same bytes (the tokenizer depends on the sample prompts and the stdlib text of this Python).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from eagle3_assets.local.tiny_spec import (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    THINK_TOKENS,
    TinyModelSpec,
)
from eagle3_assets.local.tiny_weights import build_weights

# ChatML-like. Assistant turns after the last user turn (the answer being trained on) always carry a think block,
# so a rendered (prompt + response) sample has exactly the tokens the model saw when it generated the response after
# the generation prompt "<think>\n". Earlier assistant turns render their content only (as Qwen3 does): a "</think>"
# in the history would switch off the model's own "</think>" (see the module docstring).
# Accepts `reasoning_content` (HF convention) and `reasoning` (vLLM's current response field).
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message['content'] if message['content'] is string else '' %}"
    "{%- if message['role'] == 'assistant' and loop.index0 < ns.last_user %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- set reasoning = '' %}"
    "{%- if message['reasoning_content'] is defined and message['reasoning_content'] is string %}"
    "{%- set reasoning = message['reasoning_content'] %}"
    "{%- elif message['reasoning'] is defined and message['reasoning'] is string %}"
    "{%- set reasoning = message['reasoning'] %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

# Stdlib modules whose source text supplements the prompts as tokenizer training text (English docstrings + code,
# like the prompts). Chosen once and kept fixed: the tokenizer depends on the prompts and the Python version.
_STDLIB_CORPUS_MODULES = (
    "argparse.py",
    "textwrap.py",
    "dataclasses.py",
    "functools.py",
    "pathlib.py",
    "typing.py",
    "subprocess.py",
)


def default_corpus() -> Iterator[str]:
    """Tokenizer training text: the shipped sample prompts (if present), then a fixed set of stdlib sources."""
    # lazy: loads pydantic (heavy), which only this path needs
    from eagle3_assets.core.settings import SAMPLE_PROMPTS_PATH

    if SAMPLE_PROMPTS_PATH.is_file():
        with SAMPLE_PROMPTS_PATH.open(encoding="utf-8") as handle:
            for line in handle:
                line = line.strip()
                if not line:
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    yield line
                    continue
                yield from _strings_in(record)
    # The prompts hold only ~900 distinct words (BPE stops near 1.5k tokens); stdlib text fills the vocabulary.
    stdlib_dir = Path(os.__file__).resolve().parent
    for name in _STDLIB_CORPUS_MODULES:
        path = stdlib_dir / name
        if path.is_file():
            yield path.read_text(encoding="utf-8", errors="replace")


def _strings_in(value: Any) -> Iterator[str]:
    # Prompt records may be {"prompt": ...}, {"messages": [{"content": ...}]}, ...: take every string leaf.
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key in sorted(value):
            if key != "id":  # ids are not text
                yield from _strings_in(value[key])
    elif isinstance(value, list):
        for item in value:
            yield from _strings_in(item)


def train_tokenizer(corpus: Iterable[str], vocab_size: int) -> Any:
    """Byte-level BPE (GPT-2 style pre-tokenization) with the special and think tokens; returns a `Tokenizer`."""
    # Single-threaded training keeps merges (ties included) independent of the thread schedule.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # lazy: loads tokenizers (heavy), which only this path needs
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        # The think tokens are added after training (as non-special tokens); leave room for them.
        vocab_size=vocab_size - len(THINK_TOKENS),
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    if tokenizer.get_vocab_size() > vocab_size:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens > vocab_size={vocab_size}")
    return tokenizer


def _tokenizer_config(tokenizer: Any, max_length: int) -> dict[str, Any]:
    added = {}
    for token in (*SPECIAL_TOKENS, *THINK_TOKENS):
        added[str(tokenizer.token_to_id(token))] = {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in SPECIAL_TOKENS,
        }
    return {
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_max_length": max_length,
        "pad_token": PAD_TOKEN,
        "tokenizer_class": "PreTrainedTokenizerFast",
        # The chat template writes bos itself; plain encode() adds nothing (no post-processor).
        "add_bos_token": False,
        "add_eos_token": False,
    }


def _model_config(spec: TinyModelSpec, ids: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids[BOS_TOKEN],
        "dtype": "float32",
        "eos_token_id": ids[EOS_TOKEN],
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": spec.layer_std,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": spec.num_heads,
        "num_hidden_layers": spec.num_layers,
        "num_key_value_heads": spec.num_heads,
        "pad_token_id": ids[PAD_TOKEN],
        "pretraining_tp": 1,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": {"rope_theta": spec.rope_theta, "rope_type": "default"},
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": spec.vocab_size,
    }


def build_tiny_model(
    out_dir: Path,
    seed: int = 0,
    num_layers: int = 4,
    hidden_size: int = 256,
    vocab_size: int = 4096,
    corpus: Iterable[str] | None = None,
    spec: TinyModelSpec | None = None,
) -> Path:
    """Write config, float32 safetensors weights, tokenizer and generation config to ``out_dir``; return it.

    ``spec`` overrides every shape/knob; otherwise the defaults of `TinyModelSpec` with the given layer count,
    hidden size and vocab size (heads = hidden_size // 64, intermediate ~ 8/3 * hidden rounded up to 16).
    """
    # lazy: loads safetensors (heavy), which only this path needs
    from safetensors.numpy import save_file

    if spec is None:
        base = TinyModelSpec()
        # Keep the per-unit scales of the 256 default at other widths: a projection's output std grows with
        # sqrt(fan_in), so std ~ 1/sqrt(hidden) keeps layer contributions and logit spread the same.
        width = math.sqrt(base.hidden_size / hidden_size)
        spec = TinyModelSpec(
            num_layers=num_layers,
            hidden_size=hidden_size,
            vocab_size=vocab_size,
            num_heads=max(1, hidden_size // 64),
            head_dim=64 if hidden_size >= 64 else hidden_size,
            intermediate_size=-(-(8 * hidden_size // 3) // 16) * 16,
            layer_std=base.layer_std * width,
            lm_head_std=base.lm_head_std * width,
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(corpus if corpus is not None else default_corpus(), spec.vocab_size)
    ids = {t: tokenizer.token_to_id(t) for t in (*SPECIAL_TOKENS, *THINK_TOKENS)}

    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(tokenizer, spec.max_position_embeddings))
    _write_json(
        out_dir / "special_tokens_map.json",
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN},
    )
    _write_json(out_dir / "config.json", _model_config(spec, ids))
    _write_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": ids[BOS_TOKEN],
            "eos_token_id": ids[EOS_TOKEN],
            "pad_token_id": ids[PAD_TOKEN],
            # Greedy by default: vLLM takes sampling defaults from here when the request does not set them.
            "do_sample": False,
        },
    )
    # Ids past the trained vocabulary (a small corpus gives fewer merges) have no text: never generate them.
    suppressed = sorted(set(_unprintable_tokens(tokenizer)) | set(range(tokenizer.get_vocab_size(), spec.vocab_size)))
    candidates = sorted(set(_trigger_candidates(tokenizer)) - set(suppressed))
    # imported here: tiny_weights builds on this module's spec and token names

    weights = build_weights(spec, ids, seed, trigger_candidates=candidates, suppressed=suppressed)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "model.safetensors").chmod(0o644)  # safetensors writes 0600; keep the folder uniformly readable
    return out_dir


def cached_tiny_model(seed: int = 0, num_layers: int = 4, hidden_size: int = 256, vocab_size: int = 4096) -> Path:
    """``build_tiny_model`` once per machine and shape, under the temp dir: the benchmarks, the GPU check and the
    tests share it. Built into a private folder and renamed into place, so concurrent users never see half a model."""
    cache = Path(tempfile.gettempdir()) / "eagle3-assets-cache"
    final = cache / f"tiny-verifier-s{seed}-l{num_layers}-h{hidden_size}-v{vocab_size}"
    if (final / "config.json").exists():
        return final
    staging = cache / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    build_tiny_model(staging, seed=seed, num_layers=num_layers, hidden_size=hidden_size, vocab_size=vocab_size)
    try:
        os.rename(staging, final)
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode (the byte-level pre-tokenizer's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes, strict=True)}


def _unprintable_tokens(tokenizer: Any) -> list[int]:
    """Tokens that are not valid UTF-8 on their own (a fragment of a multi-byte character) or hold control
    characters. A random model emits them freely; the served text would then carry U+FFFD and control bytes, and
    re-tokenizing a response would not give back its token ids. Never generating them keeps responses clean."""
    decoder = _byte_decoder()
    reserved = set(SPECIAL_TOKENS) | set(THINK_TOKENS)
    out = []
    for token, token_id in tokenizer.get_vocab().items():
        if token in reserved:
            continue
        try:
            text = bytes(decoder[ch] for ch in token).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            out.append(token_id)
            continue
        if any(ord(ch) < 32 and ch not in "\n\t" for ch in text) or "\x7f" in text:
            out.append(token_id)
    return sorted(out)


def _trigger_candidates(tokenizer: Any) -> list[int]:
    """Merged, non-whitespace tokens: a trigger on a single byte or on the "\\n" that ends every generation
    prompt would fire on nearly every request and give empty reasoning/content."""
    reserved = set(SPECIAL_TOKENS) | set(THINK_TOKENS)
    out = []
    for token, token_id in tokenizer.get_vocab().items():
        # Byte-level alphabet: "Ġ" is a space, "Ċ" a newline, "ĉ" a tab.
        if token in reserved or len(token) < 3 or not token.strip("ĠĊĉ"):
            continue
        out.append(token_id)
    return sorted(out)


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3 tiny-model", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="directory to write the model into (created)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: %(default)s)")
    parser.add_argument("--num-layers", type=int, default=4, help="decoder layers (default: %(default)s)")
    parser.add_argument("--hidden-size", type=int, default=256, help="hidden size (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="tokenizer vocabulary (default: %(default)s)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = build_tiny_model(
        args.out_dir,
        seed=args.seed,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        vocab_size=args.vocab_size,
    )
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
