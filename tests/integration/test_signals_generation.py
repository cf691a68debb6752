"""Issue 22: a generating run stops on SIGTERM and SIGINT (the real ``dagster asset materialize`` in a subprocess,
against a slow fake server), keeps what it journaled, leaves no process, marks nothing materialized, and a re-run
resumes and completes."""

from __future__ import annotations

import signal
from pathlib import Path

import dagster as dg
import pytest

from eagle3_assets.core.storage import DataLayout
from support.signals import (
    assert_kept_unpublished,
    journal_lines,
    materialize_command,
    resume_requests_only_the_rest,
    slow_generation,
    stop_mid_run,
)

pytestmark = [pytest.mark.slow]

KEY = "00000"
PROMPTS = 16


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_generating_run_stops_on_a_signal_keeps_its_rows_and_resumes(tmp_path: Path, sig: signal.Signals) -> None:
    with slow_generation(tmp_path, PROMPTS) as (pipeline, server):
        journal = DataLayout.at(pipeline.data_dir).responses_in_progress_path(KEY)
        command = materialize_command("synthetic_responses", KEY)
        stop_mid_run(pipeline, command, "generate", lambda: journal_lines(journal) >= 2, "two journaled rows", sig, 120)
        kept = assert_kept_unpublished(pipeline, KEY, PROMPTS)
        with dg.DagsterInstance.from_config(str(pipeline.home)) as instance:
            runs = instance.get_runs()
            assert runs and runs[0].status == dg.DagsterRunStatus.FAILURE

        resumed = resume_requests_only_the_rest(pipeline, server, KEY, PROMPTS, kept)
    assert f"{kept} already ok on disk" in resumed
