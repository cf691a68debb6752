"""dagster_home/dagster.yaml loads in dagster 1.13.27 and means what its comments say."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from support.operations import make_dagster_home


@pytest.fixture
def instance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    # A copy: loading an instance creates storage folders next to dagster.yaml, never in the repo.
    monkeypatch.setenv("DAGSTER_HOME", str(make_dagster_home(tmp_path)))
    with dg.DagsterInstance.get() as loaded:
        yield loaded


def test_run_queue_and_vllm_pool(instance: dg.DagsterInstance) -> None:
    from dagster._core.run_coordinator import QueuedRunCoordinator

    assert isinstance(instance.run_coordinator, QueuedRunCoordinator)
    config = instance.get_concurrency_config()
    assert config.run_queue_config is not None and config.run_queue_config.max_concurrent_runs == 4
    assert config.pool_config.default_pool_limit == 4
    assert config.pool_config.pool_granularity is not None and config.pool_config.pool_granularity.value == "op"


def test_retries_do_not_stack_and_monitoring_is_on(instance: dg.DagsterInstance) -> None:
    assert instance.run_retries_enabled and instance.run_retries_max_retries == 1
    assert instance.run_retries_retry_on_asset_or_op_failure is False
    assert instance.run_monitoring_enabled
    settings = instance.run_monitoring_settings
    assert settings["start_timeout_seconds"] == 300 and settings["free_slots_after_run_end_seconds"] == 300
    assert instance.run_monitoring_max_runtime_seconds == 86400


def test_generation_declares_the_pool_and_partition_runs_stay_in_process() -> None:
    from eagle3_assets.definitions import defs

    graph = defs.resolve_asset_graph()
    assert graph.get(dg.AssetKey("synthetic_responses")).pools == {"vllm"}
    executor = defs.resolve_implicit_global_asset_job_def().executor_def
    assert executor.name == dg.in_process_executor.name


def test_a_conflicting_run_queue_key_is_rejected(tmp_path: Path) -> None:
    """Why max_concurrent_runs lives under concurrency.runs: 1.13 refuses it under run_queue next to pools."""
    from dagster._core.errors import DagsterInvalidConfigError

    home = make_dagster_home(tmp_path)
    text = (home / "dagster.yaml").read_text()
    (home / "dagster.yaml").write_text(text + "\nrun_queue:\n  max_concurrent_runs: 4\n")
    with pytest.raises(DagsterInvalidConfigError, match="max_concurrent_runs"):
        dg.DagsterInstance.from_config(str(home))
