"""raw_prompts through Dagster's real materialize(): partitions registered, growth keeps positions."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.defs.partitions import PROMPT_PARTITIONS
from eagle3_assets.defs.prompts import raw_prompts, raw_prompts_unique_ids
from eagle3_assets.defs.resources import PromptDatasetResource
from support.common import REPO_ROOT, error_chain, make_resources, write_jsonl


def _rows(start: int, stop: int) -> list[dict]:
    return [{"id": f"s{i:04d}", "prompt": f"question number {i}"} for i in range(start, stop)]


def _materialize(layout: DataLayout, dataset: Path, instance: dg.DagsterInstance, size: int = 10, **kw: object):
    return dg.materialize(
        [raw_prompts, raw_prompts_unique_ids],
        instance=instance,
        resources=make_resources(layout, dataset, partition_size=size),
        **kw,
    )


def test_partitions_follow_the_dataset_and_growth_never_moves_a_sample(
    tmp_path: Path, layout: DataLayout, instance: dg.DagsterInstance
) -> None:
    dataset = write_jsonl(tmp_path / "p.jsonl", _rows(0, 25))
    result = _materialize(layout, dataset, instance)
    assert result.success
    assert instance.get_dynamic_partitions(PROMPT_PARTITIONS.name) == ["00000", "00001", "00002"]
    first = pl.read_parquet(layout.prompts_path)
    assert first.filter(pl.col("partition_key") == "00002").height == 5

    # Grow: new rows appended AND a new row inserted in the middle of the file.
    grown = [*_rows(0, 12), {"id": "inserted", "prompt": "a late arrival"}, *_rows(12, 40)]
    write_jsonl(dataset, grown)
    result = _materialize(layout, dataset, instance)
    assert result.success
    second = pl.read_parquet(layout.prompts_path)
    before = dict(zip(first["sample_id"], first["partition_key"], strict=True))
    after = dict(zip(second["sample_id"], second["partition_key"], strict=True))
    assert all(after[sample_id] == key for sample_id, key in before.items())
    assert after["inserted"] == "00002" and after["s0025"] == "00002"
    assert instance.get_dynamic_partitions(PROMPT_PARTITIONS.name) == ["00000", "00001", "00002", "00003", "00004"]
    metadata = result.asset_materializations_for_node("raw_prompts")[0].metadata
    assert metadata["new_samples"].value == 16
    assert metadata["dagster/row_count"].value == 41
    checks = result.get_asset_check_evaluations()
    assert checks and all(c.passed for c in checks)


def test_rejects_are_written_with_line_and_reason_and_counted(
    tmp_path: Path, layout: DataLayout, instance: dg.DagsterInstance
) -> None:
    dataset = write_jsonl(tmp_path / "p.jsonl", [*_rows(0, 30), "{oops", {"messages": []}])
    result = dg.materialize(
        [raw_prompts],
        instance=instance,
        resources={
            **make_resources(layout, dataset, partition_size=10),
            "prompt_dataset": PromptDatasetResource(path=str(dataset), partition_size=10, max_reject_share=0.1),
        },
    )
    assert result.success
    metadata = result.asset_materializations_for_node("raw_prompts")[0].metadata
    assert metadata["rejects"].value == 2
    rejects = [json.loads(line) for line in layout.rejects_path.read_text().splitlines()]
    assert [r["line"] for r in rejects] == [31, 32]
    assert "invalid JSON" in rejects[0]["reason"] and "'messages' is empty" in rejects[1]["reason"]


def test_too_many_rejects_fails_and_keeps_the_previous_table(
    tmp_path: Path, layout: DataLayout, instance: dg.DagsterInstance
) -> None:
    dataset = write_jsonl(tmp_path / "p.jsonl", _rows(0, 20))
    assert _materialize(layout, dataset, instance).success
    before = layout.prompts_path.read_bytes()
    write_jsonl(dataset, [*_rows(0, 20), *["{bad"] * 5])
    result = _materialize(layout, dataset, instance, raise_on_error=False)
    assert not result.success
    assert any("EAGLE3_MAX_REJECT_SHARE=0.05" in str(e.event_specific_data) for e in result.all_events)
    assert layout.prompts_path.read_bytes() == before


def test_changing_partition_size_with_generated_data_is_refused(
    tmp_path: Path, layout: DataLayout, instance: dg.DagsterInstance
) -> None:
    dataset = write_jsonl(tmp_path / "p.jsonl", _rows(0, 20))
    assert _materialize(layout, dataset, instance).success
    layout.responses_path("00000").parent.mkdir(parents=True)
    pl.DataFrame({"sample_id": ["s0000"]}).write_parquet(layout.responses_path("00000"))
    with pytest.raises(Exception) as raised:
        _materialize(layout, dataset, instance, size=7)
    assert "EAGLE3_PARTITION_SIZE=7" in error_chain(raised.value)


def test_bad_partition_size_fails_naming_the_key(tmp_path: Path, layout: DataLayout) -> None:
    dataset = write_jsonl(tmp_path / "p.jsonl", _rows(0, 3))
    with pytest.raises(Exception) as raised:
        dg.materialize([raw_prompts], resources=make_resources(layout, dataset, partition_size=0))
    assert "EAGLE3_PARTITION_SIZE=0: must be a positive integer" in error_chain(raised.value)


def test_definitions_load_fast_without_heavy_imports() -> None:
    code = (
        "import sys, time; t = time.perf_counter(); import eagle3_assets.definitions as d; "
        "d.defs.resolve_asset_graph(); "
        "heavy = [m for m in ('torch', 'transformers', 'speculators', 'vllm') if m in sys.modules]; "
        "print(time.perf_counter() - t, heavy)"
    )
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    seconds, heavy = out.stdout.strip().split(" ", 1)
    assert heavy == "[]", out.stdout
    assert float(seconds) < 5.0 and time.perf_counter() - started < 10.0
