"""``eagle3 backfill --missing`` against a real on-disk Dagster instance; the slow test runs the daemon."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest

from eagle3_assets import cli
from eagle3_assets.core.storage import DataLayout
from eagle3_assets.operations import backfill
from eagle3_assets.prompts import prompt_table
from fake_vllm import FakeConfig, FakeServerProcess
from support.operations import (
    backfill_missing_through_daemon,
    initialize_storage,
    make_dagster_home,
    materialize_partitions,
    pipeline_env,
    sync_records_what_is_on_disk,
    write_prompts,
    write_workspace,
)

FAST_SERVER = FakeConfig(token_rate=20000, median_tokens=20)


def test_plan_and_launch_cover_only_missing_and_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    home = make_dagster_home(tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    layout = DataLayout.at(tmp_path / "data")
    dataset = write_prompts(tmp_path, 20)
    with dg.DagsterInstance.get() as instance:
        # 4 partitions: 00000 and 00002 recorded as materialized, 00001 failed in a real run, 00003 never run.
        prompt_table.build_prompt_table(dataset, layout, partition_size=5)
        instance.add_dynamic_partitions("prompt_partitions", ["00000", "00001", "00002", "00003"])
        for key in ("00000", "00002"):
            instance.report_runless_asset_event(dg.AssetMaterialization("synthetic_responses", partition=key))
        materialize_partitions(instance, layout, dataset, 5, "", ok=[], failed=["00001"], with_raw_prompts=False)
        capsys.readouterr()  # drop the runs' output

        plan = backfill.plan_missing(instance)
        assert plan.registered == ["00000", "00001", "00002", "00003"]
        assert plan.status["synthetic_responses"] == {
            "00000": "materialized",
            "00001": "failed",
            "00002": "materialized",
            "00003": "missing",
        }
        assert plan.targets["synthetic_responses"] == ["00001", "00003"]
        # Downstream partitioned assets (hidden_states, when defined) get at least the regenerated partitions.
        for name, keys in plan.targets.items():
            assert {"00001", "00003"} <= set(keys), name

        # --partitions narrows the scope; a materialized partition in it is not launched.
        assert backfill.plan_missing(instance, partitions=["00000", "00003"]).targets["synthetic_responses"] == [
            "00003"
        ]
        with pytest.raises(ValueError, match="not registered"):
            backfill.plan_missing(instance, partitions=["00099"])

        # The dry run lists and launches nothing.
        assert cli.main(["backfill", "--missing", "--dry-run"]) == 0
        listed = capsys.readouterr().out
        assert "synthetic_responses: 2 partition(s): 00001 (failed), 00003 (missing)" in listed
        assert cli.main(["backfill", "--missing", "--dry-run", "--json"]) == 0
        document = json.loads(capsys.readouterr().out)
        assert document["targets"]["synthetic_responses"] == ["00001", "00003"]
        assert document["backfill_id"] is None and instance.get_backfills() == []

        # The real launch stores ONE asset backfill over exactly those partitions (what the UI shows).
        assert cli.main(["backfill", "--missing", "--json"]) == 0
        backfill_id = json.loads(capsys.readouterr().out)["backfill_id"]
        [stored] = instance.get_backfills()
        assert stored.backfill_id == backfill_id and stored.is_asset_backfill
        assert backfill.backfill_targets(instance, backfill_id)["synthetic_responses"] == ["00001", "00003"]
        assert stored.tags[backfill.LAUNCHED_BY_TAG] == "eagle3 backfill --missing"

    assert cli.main(["backfill", "--missing", "--asset", "raw_prompts", "--dry-run"]) == 2
    assert "not partitioned" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_backfill_runs_through_the_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """dagster-daemon picks the backfill up and materializes exactly the missing and failed partitions."""
    home = make_dagster_home(tmp_path)
    layout = DataLayout.at(tmp_path / "data")
    dataset = write_prompts(tmp_path, 12)
    workspace = write_workspace(tmp_path)
    with FakeServerProcess(FAST_SERVER) as server:
        env = pipeline_env(layout.root, dataset, 4, server.base_url, home)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        # The daemon starts first, so loading its code location overlaps the materializations below; the
        # instance's SQLite schemas are created before it (two processes creating them at once collide).
        with dg.DagsterInstance.get() as instance:
            initialize_storage(instance)
        backfill_missing_through_daemon(workspace, env, layout, dataset, server.base_url, capsys)
    assert sorted(layout.partition_files("synthetic_responses")) == ["00000", "00001", "00002"]

    # DAGSTER_HOME lost: a fresh instance sees every partition as missing until `eagle3 sync` records the files.
    fresh = make_dagster_home(tmp_path / "new")
    monkeypatch.setenv("DAGSTER_HOME", str(fresh))
    sync_records_what_is_on_disk(capsys)
