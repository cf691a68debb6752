"""Issue 22: "Terminate" in the Dagster UI (GraphQL ``terminateRun``, what the UI's button sends) stops a generating
run launched by the DefaultRunLauncher: the run ends CANCELED within 30 s, its run worker is gone, the rows it
finished stay journaled, nothing is marked materialized, and a re-run resumes and completes."""

from __future__ import annotations

import time
from pathlib import Path

import dagster as dg
import pytest
from dagster_graphql import DagsterGraphQLClient

from eagle3_assets.core.storage import DataLayout
from support.operations import dagster_process, wait_for, write_workspace
from support.reliability import free_port
from support.signals import (
    STOP_WITHIN_S,
    alive,
    assert_kept_unpublished,
    descendants,
    journal_lines,
    resume_requests_only_the_rest,
    slow_generation,
    wait_until,
)

pytestmark = [pytest.mark.slow]

KEY = "00000"
PROMPTS = 16

# Runs are launched at once by the DefaultRunLauncher (no daemon, no queue): the webserver's code server starts
# the run worker, and terminateRun goes back through it (the run worker sends itself SIGINT).
DAGSTER_YAML = """\
telemetry:
  enabled: false
run_coordinator:
  module: dagster._core.run_coordinator
  class: DefaultRunCoordinator
"""


def _webserver_up(client: DagsterGraphQLClient) -> bool:
    try:
        client._execute("{ version }")  # the client has no public health query
    except Exception:
        return False
    return True


def _run_worker_tree(home: Path, run_id: str) -> set[int]:
    """The run worker's pid (from its RUN_START event) and every process below it."""
    with dg.DagsterInstance.from_config(str(home)) as instance:
        (start,) = instance.all_logs(run_id, of_type=dg.DagsterEventType.RUN_START)
    assert start.dagster_event is not None and start.dagster_event.pid is not None
    return {start.dagster_event.pid, *descendants(start.dagster_event.pid)}


def test_terminate_from_the_ui_cancels_a_generating_run_which_then_resumes(tmp_path: Path) -> None:
    with slow_generation(tmp_path, PROMPTS, DAGSTER_YAML) as (pipeline, server):
        journal = DataLayout.at(pipeline.data_dir).responses_in_progress_path(KEY)
        workspace = write_workspace(tmp_path)
        port = free_port()
        args = ["dagster-webserver", "-w", str(workspace), "-h", "127.0.0.1", "-p", str(port)]
        with dagster_process(args, pipeline.env, tmp_path, pipeline.log_path("webserver")) as webserver:
            client = DagsterGraphQLClient("127.0.0.1", port_number=port)
            wait_for(lambda: _webserver_up(client), 180, "the webserver", interval_s=0.5)
            run_id = client.submit_job_execution(
                "__ASSET_JOB", asset_selection=["synthetic_responses"], tags={"dagster/partition": KEY}
            )
            wait_until(lambda: journal_lines(journal) >= 2, webserver, 180, "two journaled rows")
            workers = _run_worker_tree(pipeline.home, run_id)
            started = time.monotonic()
            client.terminate_run(run_id)
            wait_for(lambda: client.get_run_status(run_id).value == "CANCELED", STOP_WITHIN_S, "CANCELED", 0.25)
            seconds = time.monotonic() - started
            wait_for(lambda: not alive(workers), 10, "the run worker to exit", 0.25)
        assert seconds < STOP_WITHIN_S
        kept = assert_kept_unpublished(pipeline, KEY, PROMPTS)
        resume_requests_only_the_rest(pipeline, server, KEY, PROMPTS, kept)
