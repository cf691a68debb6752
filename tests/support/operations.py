"""Helpers for the operations tests: a real DAGSTER_HOME on disk, partitions materialized against the fake
server, a failed partition, and a dagster-daemon subprocess. No tests here."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dagster as dg

from _common import dagster_process
from eagle3_assets.core.storage import DataLayout
from support.common import REPO_ROOT, make_resources, materialize_responses, write_jsonl


def make_dagster_home(root: Path) -> Path:
    """A DAGSTER_HOME with the repo's dagster.yaml (run queue, vllm pool, retries, monitoring)."""
    home = root / "dagster_home"
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO_ROOT / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    return home


def write_workspace(root: Path) -> Path:
    path = root / "workspace.yaml"
    path.write_text(
        "load_from:\n  - python_module:\n      module_name: eagle3_assets.definitions\n"
        "      location_name: eagle3_assets\n"
    )
    return path


def write_prompts(root: Path, count: int) -> Path:
    return write_jsonl(root / "prompts.jsonl", [{"id": f"s{i}", "prompt": f"question {i}"} for i in range(count)])


def pipeline_env(data_dir: Path, prompts: Path, partition_size: int, base_url: str, home: Path) -> dict[str, str]:
    """The environment a code location / daemon / CLI of this test sees."""
    return {
        "DAGSTER_HOME": str(home),
        "EAGLE3_DATA_DIR": str(data_dir),
        "EAGLE3_PROMPTS_PATH": str(prompts),
        "EAGLE3_PARTITION_SIZE": str(partition_size),
        "EAGLE3_VLLM_BASE_URL": base_url,
        "EAGLE3_CONCURRENCY": "8",
    }


def materialize_partitions(
    instance: dg.DagsterInstance,
    layout: DataLayout,
    prompts: Path,
    partition_size: int,
    base_url: str,
    ok: list[str],
    failed: list[str],
    with_raw_prompts: bool = True,
) -> None:
    """raw_prompts, then ``ok`` partitions against the server and ``failed`` ones against a dead port."""
    from eagle3_assets.defs.inference import RemoteVLLMResource
    from eagle3_assets.defs.prompts import raw_prompts

    def resources(url: str) -> dict:
        server = RemoteVLLMResource(base_url=url, concurrency=8, max_attempts=1, request_timeout_s=5)
        return make_resources(layout, prompts, partition_size=partition_size, inference_server=server)

    if with_raw_prompts:
        assert dg.materialize([raw_prompts], instance=instance, resources=resources(base_url)).success
    for key, url in [(k, base_url) for k in ok] + [(k, "http://127.0.0.1:9/v1") for k in failed]:
        result = materialize_responses(
            key,
            instance,
            resources(url),
            raise_on_error=False,
        )
        assert result.success == (key in ok), f"partition {key}: success={result.success}"


def initialize_storage(instance: dg.DagsterInstance) -> None:
    """Create every SQLite storage (runs, events, schedules) now: they are created lazily, on first use."""
    instance.get_runs(limit=1)
    instance.get_backfills()
    instance.all_instigator_state()
    instance.get_daemon_heartbeats()
    instance.get_latest_materialization_event(dg.AssetKey("raw_prompts"))


def dagster_daemon(workspace: Path, env: dict[str, str], log_path: Path):  # type: ignore[no-untyped-def]
    """``dagster-daemon run`` over ``workspace`` (backfills, run queue, run monitoring)."""
    return dagster_process(["dagster-daemon", "run", "-w", str(workspace)], env, workspace.parent, log_path)


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 1.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def wait_for_backfill(
    instance: dg.DagsterInstance, daemon: subprocess.Popen[bytes], daemon_log: Path, backfill_id: str, runs: int
) -> list[dg.DagsterRun]:
    """The ``runs`` runs of a backfill once all have finished under ``daemon`` (its log printed on a timeout)."""
    tags = dg.RunsFilter(tags={"dagster/backfill": backfill_id})

    def done() -> bool:
        assert daemon.poll() is None, daemon_log.read_text()[-3000:]
        found = instance.get_runs(tags)
        return len(found) == runs and all(run.is_finished for run in found)

    try:
        wait_for(done, 300, f"the runs of backfill {backfill_id}", interval_s=2)
    except TimeoutError:
        print(daemon_log.read_text()[-5000:])
        raise
    return list(instance.get_runs(tags))


def backfill_missing_through_daemon(
    workspace: Path, env: dict[str, str], layout: DataLayout, dataset: Path, base_url: str, capsys: Any
) -> str:
    """With ``dagster-daemon`` running over ``workspace`` (its log beside it): partition 00000 ok, 00001 failed,
    00002 missing (12 prompts, 4 a partition); ``eagle3 backfill --missing`` launches one backfill that the daemon
    runs to exactly 00001 and 00002, both successful. Returns the backfill's id."""
    from eagle3_assets import cli
    from eagle3_assets.operations import backfill

    log = workspace.parent / "daemon.log"
    with dagster_daemon(workspace, env, log) as daemon, dg.DagsterInstance.get() as instance:
        materialize_partitions(instance, layout, dataset, 4, base_url, ok=["00000"], failed=["00001"])
        capsys.readouterr()  # drop the runs' output
        assert cli.main(["backfill", "--missing", "--no-downstream", "--json"]) == 0
        backfill_id = json.loads(capsys.readouterr().out)["backfill_id"]
        assert backfill.backfill_targets(instance, backfill_id) == {"synthetic_responses": ["00001", "00002"]}
        runs = wait_for_backfill(instance, daemon, log, backfill_id, runs=2)
        assert sorted(run.tags["dagster/partition"] for run in runs) == ["00001", "00002"]
        assert all(run.status == dg.DagsterRunStatus.SUCCESS for run in runs)
        assert backfill.plan_missing(instance, downstream=False).empty
        stored = instance.get_backfill(backfill_id)
        assert stored is not None and stored.status.value not in ("FAILED", "CANCELED", "COMPLETED_FAILED")
    return backfill_id


def sync_records_what_is_on_disk(capsys: Any) -> None:
    """With DAGSTER_HOME pointing at an empty instance: ``eagle3 sync`` records raw_prompts and the 3 partitions on
    disk, after which nothing is missing and ``eagle3 status`` finds disk and Dagster agreeing."""
    from eagle3_assets import cli

    assert cli.main(["sync"]) == 0
    assert "4 recorded" in capsys.readouterr().out  # raw_prompts and the 3 partitions
    assert cli.main(["backfill", "--missing", "--no-downstream", "--dry-run"]) == 0
    assert "nothing missing or failed among 3 partitions" in capsys.readouterr().out
    assert cli.main(["status"]) == 0
    assert "summary: 3 both" in capsys.readouterr().out
