"""Several partition runs of one asset at once, each in its own process, as the daemon's backfill runs them.

Dagster's in-process execution is not thread-safe: two ``materialize`` calls on two threads of one process
deadlock on the ``logging`` module's lock (one run's log manager reconfigures logging while the other's event
handler holds it). So each run is a child Python process that opens the same instance (from its serialized
``InstanceRef``: the SQLite files or Postgres of ``DAGSTER_HOME``, or a test's temporary instance) and the same
definitions (``build_definitions()``, from the same environment) and materializes one partition; the parent reads
the run's events back from the instance. A stop (SIGINT, SIGTERM, an exception in the parent) stops every child
within the process-group budget; the runs it cut are left as Dagster leaves any interrupted run, and their
partitions resume on the next materialization.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg

from eagle3_assets.core.process_guard import with_parent_death_signal
from eagle3_assets.local.process_group import stop_process_group
from eagle3_assets.operations.dagster_internals import instance_from_ref_json, instance_ref_json


@dataclass
class ChildRun:
    """What the parent reads back of one child's run: the fields the demo's progress lines use."""

    run_id: str | None
    success: bool
    all_events: list[Any] = field(default_factory=list)
    exit_code: int | None = None

    def get_asset_materialization_events(self) -> list[Any]:
        return [event for event in self.all_events if event.is_step_materialization]


def _command(instance: dg.DagsterInstance, asset: str, partition_key: str, run_config: Any, out: Path) -> list[str]:
    payload = {
        "instance_ref": instance_ref_json(instance),
        "asset": asset,
        "partition_key": partition_key,
        "run_config": run_config,
        "run_id_file": str(out),
    }
    return [sys.executable, "-m", "eagle3_assets.operations.partition_runs", json.dumps(payload)]


def _read_back(instance: dg.DagsterInstance, out: Path, exit_code: int) -> ChildRun:
    run_id = out.read_text().strip() if out.exists() else ""
    if not run_id:  # the child ended before its run started (an import error, a signal): its stderr is in the log
        return ChildRun(run_id=None, success=False, exit_code=exit_code)
    run = instance.get_run_by_id(run_id)
    events = [entry.dagster_event for entry in instance.all_logs(run_id) if entry.dagster_event is not None]
    success = run is not None and run.status == dg.DagsterRunStatus.SUCCESS and exit_code == 0
    return ChildRun(run_id=run_id, success=success, all_events=events, exit_code=exit_code)


def run_partitions(
    instance: dg.DagsterInstance,
    asset: str,
    partition_keys: Sequence[str],
    run_config: dict[str, Any] | None,
    at_once: int,
    on_done: Callable[[int, str, ChildRun, float], bool],
) -> None:
    """Materialize ``asset`` for each key, ``at_once`` child processes at a time, started in key order.
    ``on_done(i, key, run, seconds)`` is called in key order as runs end; when it returns False no further run
    starts (those already going end first)."""
    children: dict[str, subprocess.Popen[bytes]] = {}
    stopping = False

    def run_one(key: str) -> tuple[ChildRun, float]:
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="eagle3-run-") as scratch:
            out = Path(scratch) / "run_id"
            if stopping:
                return ChildRun(run_id=None, success=False), 0.0
            # its own process group: a stop reaches the child and whatever it started, and nothing else; and a
            # SIGTERM from the kernel should this process die without stopping it (SIGKILL, a default SIGTERM)
            command = with_parent_death_signal(_command(instance, asset, key, run_config, out))
            child = subprocess.Popen(command, start_new_session=True)
            children[key] = child
            code = child.wait()
            return _read_back(instance, out, code), time.monotonic() - started

    pool = ThreadPoolExecutor(max_workers=max(1, at_once), thread_name_prefix=f"runs-{asset}")
    try:
        futures = [pool.submit(run_one, key) for key in partition_keys]
        for i, (key, future) in enumerate(zip(partition_keys, futures, strict=True), start=1):
            if future.cancelled():
                continue
            run, seconds = future.result()
            if not on_done(i, key, run, seconds) and not stopping:
                stopping = True
                for pending in futures:
                    pending.cancel()
    except BaseException:
        stopping = True
        for child in list(children.values()):
            if child.poll() is None:
                stop_process_group(child.pid, process=child)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _child_main(payload_json: str) -> int:
    """The child: one partition of one asset, with the definitions this environment builds."""
    # lazy: loads dagster (heavy), which only this path needs
    from eagle3_assets.definitions import build_definitions

    payload = json.loads(payload_json)
    with instance_from_ref_json(payload["instance_ref"]) as instance:
        defs = build_definitions()
        run_id_file = Path(payload["run_id_file"])
        result = dg.materialize(
            list(defs.assets or []),
            selection=[dg.AssetKey.from_user_string(payload["asset"])],
            partition_key=payload["partition_key"],
            instance=instance,
            resources=defs.resources,
            run_config=payload["run_config"],
            raise_on_error=False,
        )
        run_id_file.write_text(result.run_id)
        return 0 if result.success else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(_child_main(sys.argv[1]))
