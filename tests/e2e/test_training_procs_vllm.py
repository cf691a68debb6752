"""A draft trained by 2 torchrun ranks (EAGLE3_TRAIN_PROCS=2) loads in the real CPU vLLM as an EAGLE-3 speculator
and drafts tokens (~130 s for the speculative server's start-up)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest

from eagle3_assets.core.storage import DataLayout

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

KEYS = ["00000", "00001", "00002"]


def test_a_two_process_draft_serves_in_vllm(tmp_path: Path) -> None:
    from eagle3_assets.evaluation.online_metrics import OnlineConfig, Prompt, local_server, measure
    from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
    from eagle3_assets.local.vllm_server import VLLMNotInstalledError, check_vllm_python
    from eagle3_assets.training import TrainConfig, build_vocab_mapping
    from eagle3_assets.training.launch import TrainSpec, run_training_processes
    from support.hidden_states_data import cached_tiny_verifier, fabricate_responses

    try:
        python = check_vllm_python()
    except VLLMNotInstalledError as exc:
        pytest.skip(f"local vLLM not installed: {exc}")
    verifier = cached_tiny_verifier()
    layout = DataLayout.at(tmp_path / "data")
    for key in KEYS:
        fabricate_responses(layout, key, 24, min_words=20, max_words=40)
        extract_partition(layout, key, verifier, HiddenStatesConfig(layer_ids=[1, 2, 3]))
    build_vocab_mapping(layout, KEYS[:2], draft_vocab_size=256, target_vocab_size=1024)
    config = TrainConfig(epochs=1, tokens_per_batch=1536, num_threads=1, max_val_batches=2)
    spec = TrainSpec(str(layout.root), KEYS[:2], KEYS[2], str(verifier), asdict(config), str(tmp_path / "r.json"))
    result = run_training_processes(spec, 2, tmp_path)
    assert result.ranks == 2

    online = OnlineConfig(k=3, max_tokens=32, concurrency=2, python=python, log_dir=tmp_path / "logs")
    prompts = [Prompt("p0", [{"role": "user", "content": "the model token draft"}])]
    with local_server(verifier, online, "tiny-verifier", result.final_dir) as server:
        measured = measure(server.base_url, server.model_name, prompts, online)
    assert measured.generations[0].token_ids, "the speculative server returned no tokens"
    assert measured.counters["drafts"] > 0  # vLLM loaded the draft and proposed tokens with it
