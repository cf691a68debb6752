"""Issue 22: a generating run stops on SIGTERM and SIGINT (the real ``dagster asset materialize`` in a subprocess,
against a slow fake server), keeps what it journaled, leaves no process, marks nothing materialized, and a re-run
resumes and completes."""

from __future__ import annotations

import signal
from pathlib import Path

import dagster as dg
import pytest

from eagle3_assets.generation.journal import read_journal
from eagle3_assets.storage import DataLayout
from support.fake_vllm import FakeConfig, FakeServerProcess
from support.signals import (
    journal_lines,
    log_text,
    make_pipeline,
    materialize_command,
    resume_requests_only_the_rest,
    run,
    stop_mid_run,
)

pytestmark = [pytest.mark.slow]

KEY = "00000"
PROMPTS = 16


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_generating_run_stops_on_a_signal_keeps_its_rows_and_resumes(tmp_path: Path, sig: signal.Signals) -> None:
    # ~100 tokens at 15 tok/s: about 7 s a response, 4 in flight: the partition would take ~30 s
    fake = FakeConfig(token_rate=15, median_tokens=100, sigma=0.3)
    with FakeServerProcess(fake) as server:
        pipeline = make_pipeline(
            tmp_path, PROMPTS, PROMPTS, server.base_url, EAGLE3_CONCURRENCY="4", EAGLE3_MAX_TOKENS="400"
        )
        assert run(pipeline, materialize_command("raw_prompts"), "raw_prompts") == 0, log_text(pipeline, "raw_prompts")
        layout = DataLayout.at(pipeline.data_dir)
        journal = layout.responses_in_progress_path(KEY)
        command = materialize_command("synthetic_responses", KEY)
        stop_mid_run(pipeline, command, "generate", lambda: journal_lines(journal) >= 2, "two journaled rows", sig, 120)
        # the rows finished before the signal stay journaled; no partition file, nothing materialized
        kept = read_journal(journal).records
        assert 2 <= len(kept) < PROMPTS
        assert not layout.responses_path(KEY).exists()
        with dg.DagsterInstance.from_config(str(pipeline.home)) as instance:
            assert instance.get_latest_materialization_event(dg.AssetKey("synthetic_responses")) is None
            runs = instance.get_runs()
            assert runs and runs[0].status == dg.DagsterRunStatus.FAILURE

        resumed = resume_requests_only_the_rest(pipeline, server, KEY, PROMPTS, len(kept))
    assert f"{len(kept)} already ok on disk" in resumed
