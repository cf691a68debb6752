"""``eagle3 sync`` and ``eagle3 status`` against a real on-disk Dagster instance that lost its history."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from eagle3_assets import cli
from eagle3_assets.core.storage import DataLayout, write_parquet_atomic
from eagle3_assets.generation.records import rows_to_frame
from eagle3_assets.operations import backfill, status
from eagle3_assets.operations.counts import STATUS_COLUMNS
from eagle3_assets.operations.sync import SYNC_TAG, sync
from eagle3_assets.prompts import prompt_table
from support.operations import make_dagster_home, write_prompts


def write_responses(layout: DataLayout, key: str, sample_ids: list[str], failed: int = 0) -> Path:
    # the prompts' own messages: a file answering other prompts under these ids is stale (sync refuses it)
    table = pl.read_parquet(layout.prompts_path, columns=["sample_id", "messages"])
    messages = dict(zip(table["sample_id"].to_list(), table["messages"].to_list(), strict=True))
    rows = [
        {
            "sample_id": sid,
            "partition_key": key,
            "messages": messages[sid],
            "reasoning": "r",
            "content": "c",
            "finish_reason": "stop" if i >= failed else None,
            "prompt_tokens": 3,
            "completion_tokens": 10,
            "status": "ok" if i >= failed else "failed",
        }
        for i, sid in enumerate(sample_ids)
    ]
    path = layout.responses_path(key)
    write_parquet_atomic(rows_to_frame([{**dict.fromkeys(rows_to_frame([]).columns), **r} for r in rows]), path)
    return path


@pytest.fixture
def on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> DataLayout:
    """A data dir as a lost DAGSTER_HOME leaves it: 5 partitions of 4 prompts, 2 valid response files,
    3 broken ones (not Parquet, wrong columns, a prompt missing), no record in the (fresh) instance."""
    monkeypatch.setenv("DAGSTER_HOME", str(make_dagster_home(tmp_path)))
    layout = DataLayout.at(tmp_path / "data")
    monkeypatch.setenv("EAGLE3_DATA_DIR", str(layout.root))
    prompt_table.build_prompt_table(write_prompts(tmp_path, 20), layout, partition_size=4)
    ids = pl.read_parquet(layout.prompts_path).group_by("partition_key").agg("sample_id")
    by_key = {row["partition_key"]: sorted(row["sample_id"]) for row in ids.iter_rows(named=True)}
    write_responses(layout, "00000", by_key["00000"])
    write_responses(layout, "00001", by_key["00001"], failed=1)
    layout.responses_path("00002").write_bytes(b"PAR1 this is not parquet")
    pl.DataFrame({"sample_id": by_key["00003"]}).write_parquet(layout.responses_path("00003"))
    write_responses(layout, "00004", by_key["00004"][:-1])
    return layout


def test_sync_records_valid_files_and_reports_broken_ones(on_disk: DataLayout, capsys) -> None:
    with dg.DagsterInstance.get() as instance:
        assert instance.get_dynamic_partitions("prompt_partitions") == []
        assert backfill.plan_missing(instance).registered == []

        # --dry-run validates and reports, records nothing.
        assert cli.main(["sync", "--dry-run"]) == 1
        assert "would record: synthetic_responses 00000 (4 rows)" in capsys.readouterr().out
        assert instance.get_latest_materialization_event(dg.AssetKey("synthetic_responses")) is None

        assert cli.main(["sync", "--json"]) == 1  # 1: some files are invalid
        report = json.loads(capsys.readouterr().out)
        assert report["registered_partitions"] == ["00000", "00001", "00002", "00003", "00004"]
        assert sorted((r["asset"], r["partition"]) for r in report["recorded"]) == [
            ("raw_prompts", None),
            ("synthetic_responses", "00000"),
            ("synthetic_responses", "00001"),
        ]
        reasons = {r["partition"]: r["reason"] for r in report["invalid"]}
        assert set(reasons) == {"00002", "00003", "00004"}
        assert "unreadable Parquet" in reasons["00002"]
        assert "missing columns" in reasons["00003"]
        assert "incomplete" in reasons["00004"] and "1 missing" in reasons["00004"]

        # Recorded with their row counts; a missing-only backfill now skips them and regenerates the rest.
        event = instance.get_latest_materialization_event(dg.AssetKey("synthetic_responses"))
        assert event is not None
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("synthetic_responses"), asset_partitions=["00001"]), limit=5
        ).records
        metadata = records[0].asset_materialization.metadata
        assert metadata["dagster/partition_row_count"].value == 4
        assert metadata["ok"].value == 3 and metadata["failed"].value == 1
        assert "sample_id" in [c.name for c in metadata["dagster/column_schema"].schema.columns]
        assert metadata[SYNC_TAG].value is True
        plan = backfill.plan_missing(instance)
        assert plan.targets["synthetic_responses"] == ["00002", "00003", "00004"]

        # Idempotent: a second sync records nothing new.
        again = sync(instance, on_disk)
        assert again.recorded == [] and len(again.already) == 3 and len(again.invalid) == 3

        rows = {(r.asset, r.partition_key): r for r in status.partition_table(instance, on_disk)}
        assert rows["synthetic_responses", "00000"].where == status.BOTH
        assert rows["synthetic_responses", "00000"].rows_agree and rows["synthetic_responses", "00000"].synced
        assert rows["synthetic_responses", "00004"].where == status.DISK_ONLY
        assert rows["synthetic_responses", "00004"].disk_rows == 3
    assert cli.main(["status"]) == 0
    out = capsys.readouterr().out
    assert "summary: 2 both, 3 disk only" in out
    assert "UNREADABLE" in out.split("00002")[1].splitlines()[0]


def test_status_flags_a_recorded_partition_whose_file_is_gone(on_disk: DataLayout, capsys) -> None:
    with dg.DagsterInstance.get() as instance:
        sync(instance, on_disk)
        on_disk.responses_path("00001").unlink()
        rows = {(r.asset, r.partition_key): r for r in status.partition_table(instance, on_disk)}
        assert rows["synthetic_responses", "00001"].where == status.DAGSTER_ONLY
    assert cli.main(["status", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["partitions"]
    assert {"partition_key": "00001", "where": "dagster only"}.items() <= listed[1].items()


def test_counts_shows_status_and_tokens_and_names_a_broken_file(on_disk: DataLayout, capsys) -> None:
    assert cli.main(["counts"]) == 1  # 00002 is not Parquet: DuckDB's glob fails, the hint says where to look
    assert "eagle3 status" in capsys.readouterr().err
    for key in ("00002", "00003", "00004"):
        on_disk.responses_path(key).unlink()
    assert cli.main(["counts"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["partition", "synthetic_responses", *STATUS_COLUMNS]
    assert lines[3].split() == ["00001", "4", "3", "1", "0", "12", "40"]  # the failed row's tokens count too
    assert lines[-1].split() == ["total", "8", "7", "1", "0", "24", "80"]


def test_hidden_states_index_is_validated_against_the_ok_responses(on_disk: DataLayout) -> None:
    from eagle3_assets.operations.sync import validate_hidden_states

    ok_ids = pl.read_parquet(on_disk.responses_path("00001")).filter(pl.col("status") == "ok")["sample_id"].to_list()
    index = on_disk.hidden_states_index_path("00001")
    index.parent.mkdir(parents=True, exist_ok=True)

    def write_index(ids: list[str]) -> None:
        pl.DataFrame(
            {"sample_id": ids, "row": list(range(len(ids))), "seq_len": [8] * len(ids), "file": ["x"] * len(ids)}
        ).write_parquet(index)

    write_index(ok_ids)
    assert validate_hidden_states(on_disk, "00001").reason.startswith("no data folder")
    on_disk.hidden_states_dir("00001").mkdir()
    verdict = validate_hidden_states(on_disk, "00001")
    assert verdict.valid and verdict.metadata["rows"] == 3
    write_index(ok_ids[:-1])
    assert "not one per ok response" in validate_hidden_states(on_disk, "00001").reason
    index.write_bytes(b"garbage")
    assert "unreadable Parquet" in validate_hidden_states(on_disk, "00001").reason
