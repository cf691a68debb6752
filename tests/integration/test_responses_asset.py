"""synthetic_responses through Dagster's real materialize() with partition keys, against the fake server."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import polars as pl

from eagle3_assets.core.storage import DataLayout, partition_row_counts
from eagle3_assets.defs.inference import RemoteVLLMResource
from eagle3_assets.defs.prompts import raw_prompts
from fake_vllm import FakeConfig, serve_in_thread
from support.common import make_resources, materialize_responses, write_jsonl


def test_partitions_materialize_with_metadata_and_checks(
    tmp_path: Path, layout: DataLayout, instance: dg.DagsterInstance
) -> None:
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"id": f"s{i}", "prompt": f"question {i}"} for i in range(25)])
    with serve_in_thread(FakeConfig(token_rate=5000, median_tokens=30)) as base_url:
        resources = make_resources(
            layout, dataset, partition_size=10, inference_server=RemoteVLLMResource(base_url=base_url, concurrency=8)
        )
        assert dg.materialize([raw_prompts], instance=instance, resources=resources).success
        for key in ("00000", "00002"):
            result = materialize_responses(
                key,
                instance,
                resources,
            )
            assert result.success
            metadata = result.asset_materializations_for_node("synthetic_responses")[0].metadata
            assert metadata["ok"].value + metadata["failed"].value == metadata["dagster/partition_row_count"].value
            assert "completion_length_histogram" in metadata
            assert all(check.passed for check in result.get_asset_check_evaluations())
    assert partition_row_counts(layout) == {"synthetic_responses": {"00000": 10, "00002": 5}}
    frame = pl.read_parquet(layout.responses_path("00002"))
    assert sorted(frame["sample_id"].to_list()) == [f"s{i}" for i in range(20, 25)]
    assert set(frame["status"]) == {"ok"} and frame["reasoning"].null_count() == 0
    assert not layout.responses_in_progress_path("00002").exists()
