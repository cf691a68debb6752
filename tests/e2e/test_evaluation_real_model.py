"""Evaluation on a real model in the real CPU vLLM: SmolLM2-135M-Instruct (no think tokens, ChatML template, eos
<|im_end|>, 30 layers) on HumanEval problems. Its servers start without a reasoning parser (vLLM refuses
deepseek_r1 for this tokenizer), take the chat template and stop tokens from the model, the draft's layer ids come
from the model's depth, and greedy outputs with the draft equal those without it, token for token.

Two vLLM start-ups of a 135M model on 2 cores: ~5 minutes. Run it under ``flock /tmp/eagle3-vllm.lock``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

K = 3


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    import os

    from eagle3_assets.local.vllm_server import VLLMNotInstalledError, check_vllm_python

    try:
        return check_vllm_python(import_check=True)
    except VLLMNotInstalledError as exc:
        if os.environ.get("EAGLE3_REQUIRE_VLLM", "").strip() in {"1", "true", "yes"}:
            pytest.fail(f"EAGLE3_REQUIRE_VLLM is set but the vLLM venv is unusable: {exc}")
        pytest.skip(f"local vLLM not installed (run `make install-vllm`): {exc}")


def test_humaneval_greedy_identity_without_a_reasoning_parser(
    real_verifier_dir: Path, vllm_python: Path, tmp_path: Path
) -> None:
    import torch

    from eagle3_assets.core.storage import DataLayout
    from eagle3_assets.core.verifier import resolve_layer_ids, verifier_shape
    from eagle3_assets.evaluation.evaluate import EvaluationOptions, run_evaluation
    from eagle3_assets.evaluation.online_metrics import OnlineConfig
    from eagle3_assets.local.reasoning import resolve_reasoning_parser
    from eagle3_assets.training import TrainConfig
    from eagle3_assets.training.model import build_draft

    assert resolve_reasoning_parser("auto", real_verifier_dir) is None  # no <think>/</think> in its tokenizer
    layer_ids = resolve_layer_ids(None, verifier_shape(real_verifier_dir).num_layers)
    assert layer_ids == [2, 15, 27]  # EAGLE-3's default from the model's 30 layers
    torch.manual_seed(0)
    draft = tmp_path / "draft"
    build_draft(real_verifier_dir, layer_ids, TrainConfig(ttt_steps=K), None).save_pretrained(str(draft))

    online = OnlineConfig(
        prompt_sets=("humaneval",),
        humaneval_prompts=4,
        speed_prompts=2,
        concurrency=4,
        max_tokens=48,
        python=vllm_python,
        log_dir=tmp_path / "logs",
    )
    options = EvaluationOptions(k=K, offline=False, untrained=False, online_config=online)
    lines: list[str] = []
    report = run_evaluation(DataLayout.at(tmp_path / "data"), draft, real_verifier_dir, options, log=lines.append)

    logs = sorted((tmp_path / "logs").glob("vllm-*.log"))
    assert len(logs) == 2  # plain and with the draft
    for log in logs:
        command = log.read_text().splitlines()[0]
        assert "--reasoning-parser" not in command, command
    run = report.run("humaneval")
    assert run is not None and run.prompts == 4 and run.mismatches == {"trained": []}, lines
    trained = report.get("trained", "online", "humaneval")
    assert trained is not None and trained.drafts > 0 and trained.output_tokens
    assert 1.0 <= trained.mean_acceptance_length <= K + 1
    assert report.speedup("trained", "humaneval") is not None
    assert "| humaneval | trained | online |" in report.markdown()
