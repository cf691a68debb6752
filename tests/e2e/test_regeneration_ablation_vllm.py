"""Issue 25 item 2 against the real CPU vLLM: the ablation's three drafts generated, trained and measured online.

The session's ``vllm_server`` (the tiny model) generates the last-turn and all-turns rows and the evaluation sets'
answers, and is the plain baseline; each draft gets its own speculative server (~130 s each on 2 cores), so this
trains one seed only. Run it alone, under ``flock /tmp/eagle3-vllm.lock``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.evaluation.ablation import AblationConfig, run_ablation

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]


def test_three_variants_measured_online(vllm_server, tiny_model_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from eagle3_assets.evaluation.online_metrics import OnlineConfig
    from eagle3_assets.generation import GenerationConfig
    from eagle3_assets.hidden_states import HiddenStatesConfig
    from eagle3_assets.prompts.prompt_table import build_prompt_table
    from eagle3_assets.training import TrainConfig
    from support.common import write_jsonl

    rows = []
    for i in range(8):
        turns = []
        for t in range(1 + i % 2):
            turns += [{"from": "human", "value": f"Tell me about topic {i}, part {t}."},
                      {"from": "gpt", "value": f"Topic {i} part {t} is about the model and the draft."}]  # fmt: skip
        rows.append({"id": f"c{i}", "conversations": turns})
    layout = DataLayout.at(tmp_path / "data")
    build_prompt_table(write_jsonl(tmp_path / "prompts.jsonl", rows), layout, partition_size=1000)

    config = AblationConfig(conversations=4, held_out=2, humaneval=2, token_budget=512, tokens_per_batch=256,
                            seeds=(0,), partition_size=2, draft_vocab_size=512, k=2, online=True,
                            max_val_batches=1, offline_max_samples=2)  # fmt: skip
    generation = GenerationConfig(base_urls=[vllm_server.base_url], model=vllm_server.model_name, concurrency=4,
                                  max_tokens=32, progress_interval_s=60)  # fmt: skip
    online = OnlineConfig(max_tokens=32, concurrency=4, speed_prompts=0, max_model_len=1024,
                          plain_url=vllm_server.base_url, served_model_name=vllm_server.model_name,
                          python=vllm_server.config.python, log_dir=tmp_path / "logs")  # fmt: skip
    report = run_ablation(
        layout,
        tiny_model_dir,
        config,
        generation,
        HiddenStatesConfig(layer_ids=[1, 2, 3], max_seq_len=512, num_threads=1),
        TrainConfig(device="cpu", num_threads=1, ttt_steps=2, init="speculators"),
        online,
        log=print,
    )
    assert [row.variant for row in report.rows] == ["dataset", "last-turn", "all-turns"]
    for row in report.rows:
        for column in ("online/held-out", "online/humaneval"):
            value = row.acceptance[column]
            assert value is not None and 1.0 <= value <= 3.0, (row.key(), column, value)
    assert "online held-out" in report.markdown()
