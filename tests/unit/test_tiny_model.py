"""The tiny local verifier: deterministic bytes, a loadable tokenizer/chat template, and the hand-set structure
(</think> once, then eos) that makes served completions look like a reasoning model's."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from eagle3_assets.local import tiny_model as tm
from eagle3_assets.local import tiny_spec as spec
from eagle3_assets.local import tiny_weights as tw

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 20,
    "def add(a, b):\n    return a + b\n" * 20,
    "Explain how a hash map handles collisions, then write a haiku about the sea. " * 20,
]


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tm.build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path, model_dir: Path) -> None:
    again = tm.build_tiny_model(tmp_path / "again", seed=0)
    other = tm.build_tiny_model(tmp_path / "other", seed=1)
    assert _digests(again) == _digests(model_dir)
    assert set(_digests(model_dir)) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    differs = {name for name, digest in _digests(other).items() if digest != _digests(model_dir)[name]}
    assert differs == {"model.safetensors"}  # the tokenizer depends on the corpus only


def test_custom_corpus_and_shapes(tmp_path: Path) -> None:
    out = tm.build_tiny_model(tmp_path / "small", seed=3, num_layers=2, hidden_size=128, vocab_size=1024, corpus=CORPUS)
    from safetensors.numpy import load_file

    weights = load_file(str(out / "model.safetensors"))
    assert weights["model.embed_tokens.weight"].shape == (1024, 128)
    assert weights["lm_head.weight"].shape == (1024, 128)
    assert "model.layers.1.mlp.down_proj.weight" in weights and "model.layers.2.mlp.down_proj.weight" not in weights
    assert all(w.dtype.name == "float32" for w in weights.values())


def test_tokenizer_and_chat_template(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) <= 4096
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (spec.BOS_TOKEN, spec.EOS_TOKEN, spec.PAD_TOKEN)
    for marker in spec.THINK_TOKENS:
        ids = tok.encode(f"a {marker} b", add_special_tokens=False)
        assert tok.convert_tokens_to_ids(marker) in ids
        # Not special: the reasoning parser finds "</think>" in text decoded with skip_special_tokens.
        assert marker in tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(tok.encode("héllo wörld ✓\n\tcode()", add_special_tokens=False)) == "héllo wörld ✓\n\tcode()"

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )
    for field in ("reasoning", "reasoning_content"):
        full = tok.apply_chat_template(
            [*messages, {"role": "assistant", "content": "\n\nHello.", field: "Greet back.\n"}], tokenize=False
        )
        # The generation prompt is a prefix of the rendered answer: hidden states line up with what was generated.
        assert full == prompt + "Greet back.\n</think>\n\nHello.<|im_end|>\n"
    # Multi-turn: earlier answers render without a think block (a "</think>" in the history would disable the
    # model's own), the answer after the last user turn with it.
    turns = [
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello.", "reasoning": "old thoughts"},
        {"role": "user", "content": "More?"},
    ]
    multi = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert multi == (
        "<|begin_of_text|><|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nMore?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    no_think = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_structure_think_once_then_eos(model_dir: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.numpy import load_file

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    embed = load_file(str(model_dir / "model.safetensors"))["model.embed_tokens.weight"]
    hidden = embed.shape[1]
    think_triggers = [int(i) for i in (embed[:, hidden - tw._CH_TRIG_THINK] == 1).nonzero()[0]]
    eos_triggers = [int(i) for i in (embed[:, hidden - tw._CH_TRIG_EOS] == 1).nonzero()[0]]
    think_end, eos = tok.convert_tokens_to_ids(spec.THINK_END_TOKEN), tok.eos_token_id
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "Why is the sky blue?"}], add_generation_prompt=True, return_dict=True
    )
    prompt = list(rendered["input_ids"])
    some_text = tok.encode(" light scatters in the air", add_special_tokens=False)

    def next_token(ids: list[int]) -> int:
        with torch.no_grad():
            return int(model(torch.tensor([ids])).logits[0, -1].argmax())

    for trigger in think_triggers[:5]:
        assert next_token([*prompt, *some_text, trigger]) == think_end
        assert next_token([*prompt, *some_text, think_end, *some_text, trigger]) != think_end
    for trigger in eos_triggers[:5]:
        assert next_token([*prompt, *some_text, trigger]) != eos
        assert next_token([*prompt, *some_text, think_end, *some_text, trigger]) == eos

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False, pad_token_id=tok.pad_token_id)[
            0, len(prompt) :
        ].tolist()
    assert len(set(out)) >= 16, f"degenerate greedy output: {out}"
    special = {tok.convert_tokens_to_ids(t) for t in (spec.BOS_TOKEN, spec.PAD_TOKEN, spec.IM_START_TOKEN, "<think>")}
    assert not special & set(out)
    assert "\ufffd" not in tok.decode(out)


def test_cli_writes_the_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tm.main([str(tmp_path / "cli"), "--seed", "0"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert (tmp_path / "cli" / "model.safetensors").is_file()
