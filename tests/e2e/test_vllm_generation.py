"""The generation engine and the synthetic_responses asset against the real CPU vLLM on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from eagle3_assets.core.settings import SAMPLE_PROMPTS_PATH
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.defs.inference import RemoteVLLMResource
from eagle3_assets.defs.prompts import raw_prompts
from eagle3_assets.defs.responses import ERROR_RATE
from eagle3_assets.local.vllm_server import LocalVLLMServer, metric_total
from support.common import make_resources, materialize_responses, write_jsonl

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOO_LONG_ID = "too-long"


def _dataset(tmp_path: Path) -> Path:
    rows = SAMPLE_PROMPTS_PATH.read_text().splitlines()[:49]
    # 3,000 words cannot fit the 1,024-token context: vLLM answers 400, which is not retried.
    rows.append(json.dumps({"id": TOO_LONG_ID, "prompt": "word " * 3000}))
    return write_jsonl(tmp_path / "prompts.jsonl", rows)


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_partition_of_50_against_real_vllm(
    tmp_path: Path, layout: DataLayout, instance: dg.DagsterInstance, vllm_server: LocalVLLMServer, stream: bool
) -> None:
    server = RemoteVLLMResource(base_url=vllm_server.base_url, concurrency=16, max_tokens=128, stream=stream)
    resources = make_resources(layout, _dataset(tmp_path), partition_size=50, inference_server=server)
    assert dg.materialize([raw_prompts], instance=instance, resources=resources).success
    served_before = metric_total(vllm_server.base_url, "vllm:request_success_total")

    result = materialize_responses(
        "00000",
        instance,
        resources,
        raise_on_error=False,
    )

    # 1 of 50 failed is above the 1% default: the blocking error-rate check fails the run (nothing downstream
    # starts from it), after the partition's file and materialization were written
    assert not result.success
    frame = pl.read_parquet(layout.responses_path("00000"))
    assert frame.height == 50 and frame["sample_id"].n_unique() == 50
    ok = frame.filter(pl.col("status") == "ok")
    assert ok.height == 49
    # The reasoning parser split every finished answer at </think>: both parts present, no tag left in either.
    # (An answer cut at max_tokens may still be thinking: reasoning only.)
    finished = ok.filter(pl.col("finish_reason") == "stop")
    assert finished.height >= 30
    assert ok["reasoning"].null_count() == 0 and finished["content"].null_count() == 0
    assert not ok["content"].str.contains("</think>").any() and not ok["reasoning"].str.contains("</think>").any()
    assert (ok["completion_tokens"] > 0).all()
    # return_token_ids: vLLM's own tokens (what hidden_states trains on), as many as usage counts, the prompt
    # exactly the chat template's rendering, every finished answer ending with eos
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(vllm_server.config.model))
    assert ok["prompt_token_ids"].null_count() == 0 and ok["completion_token_ids"].null_count() == 0
    assert (ok["prompt_token_ids"].list.len() == ok["prompt_tokens"]).all()
    assert (ok["completion_token_ids"].list.len() == ok["completion_tokens"]).all()
    first = ok.row(0, named=True)
    rendered = tokenizer.apply_chat_template(
        first["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert first["prompt_token_ids"] == list(rendered)
    assert all(ids[-1] == tokenizer.eos_token_id for ids in finished["completion_token_ids"].to_list())
    failed = frame.filter(pl.col("status") == "failed").row(0, named=True)
    assert failed["sample_id"] == TOO_LONG_ID and failed["attempts"] == 1
    assert "maximum context length" in failed["error"]
    # The server finished exactly one request per ok sample: nothing requested twice.
    assert metric_total(vllm_server.base_url, "vllm:request_success_total") - served_before == 49
    metadata = result.asset_materializations_for_node("synthetic_responses")[0].metadata
    assert metadata["requested"].value == 50 and metadata["retries"].value == 0
    error_check = next(c for c in result.get_asset_check_evaluations() if c.check_name == ERROR_RATE)
    assert not error_check.passed  # 1 of 50 failed is above the 1% default
