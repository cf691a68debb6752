"""raw_prompts on a JSON-array dataset through Dagster's real materialize() (issue 21): a cut-off array fails the run
naming the offset and the remedy and keeps the previous table; EAGLE3_PROMPTS_TRUNCATED=keep-complete takes the
complete records and says so in the run log and the metadata; duplicates and rejects are in the run log."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import polars as pl

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.defs.prompts import raw_prompts
from eagle3_assets.defs.resources import PromptDatasetResource
from support.common import make_resources


def _records(n: int) -> list[dict]:
    return [
        {
            "id": f"s{i:03d}",
            "conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": "a"}],
        }
        for i in range(n)
    ]


def _materialize(layout: DataLayout, dataset: Path, instance: dg.DagsterInstance, truncated: str = "error"):
    resources = make_resources(layout, dataset, partition_size=10)
    resources["prompt_dataset"] = PromptDatasetResource(
        path=str(dataset), partition_size=10, max_reject_share=0.2, truncated=truncated
    )
    return dg.materialize([raw_prompts], instance=instance, resources=resources, raise_on_error=False)


def _run_log(instance: dg.DagsterInstance, run_id: str) -> str:
    return "\n".join(entry.user_message for entry in instance.all_logs(run_id))


def test_cut_off_array_fails_the_run_and_keep_complete_takes_the_complete_records(
    tmp_path: Path, layout: DataLayout, instance: dg.DagsterInstance
) -> None:
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(_records(20), indent=2), encoding="utf-8")
    assert _materialize(layout, dataset, instance).success
    before = layout.prompts_path.read_bytes()

    data = json.dumps(_records(30), indent=2).encode()
    cut_at = data.index(b'"s025"')  # inside record 26
    dataset.write_bytes(data[:cut_at])
    failed = _materialize(layout, dataset, instance)
    assert not failed.success
    message = failed.get_step_failure_events()[0].event_specific_data.error.to_string()
    assert f"{dataset}: not a complete JSON array: the file ends inside record 26 at byte {cut_at:,}" in message
    assert "25 complete records precede it" in message and "EAGLE3_PROMPTS_TRUNCATED=keep-complete" in message
    assert layout.prompts_path.read_bytes() == before  # nothing already written is lost

    taken = _materialize(layout, dataset, instance, truncated="keep-complete")
    assert taken.success
    assert pl.read_parquet(layout.prompts_path).height == 25
    metadata = taken.asset_materializations_for_node("raw_prompts")[0].metadata
    assert metadata["dataset_records_taken"].value == 25 and metadata["dataset_cut_at_byte"].value == cut_at
    log = _run_log(instance, taken.run_id)
    assert f"took the 25 complete records of {dataset}" in log and f"at byte {cut_at:,}" in log
    assert json.loads(layout.prompts_manifest_path.read_text())["dataset_cut"]["complete_records"] == 25


def test_duplicates_and_rejects_are_reported_in_the_run_log(
    tmp_path: Path, layout: DataLayout, instance: dg.DagsterInstance
) -> None:
    records = _records(12)
    records += [records[3], records[4], {"id": "empty", "conversations": []}]
    records += [{"id": f"blank{i}", "conversations": [{"from": "human", "value": " "}]} for i in range(2)]
    dataset = tmp_path / "p.json"
    dataset.write_text(json.dumps(records), encoding="utf-8")
    result = _materialize(layout, dataset, instance)
    assert result.success
    log = _run_log(instance, result.run_id)
    assert "2 exact duplicates dropped (the first copy kept), e.g. line 13 (id 's003') repeats line 4" in log
    assert "3 of 17 rows rejected (2 x conversations[*].value is empty; 1 x 'conversations' is empty)" in log
    assert "e.g. line 15: 'conversations' is empty" in log
    metadata = result.asset_materializations_for_node("raw_prompts")[0].metadata
    assert metadata["duplicates"].value == 2
    assert "dataset_cut" not in metadata
