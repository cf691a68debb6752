"""Issue 22: ``hidden_states`` with the ``vllm`` backend, its extraction server stuck (every request hangs), stops on
SIGTERM through the real ``dagster asset materialize``: within 30 s, its requests cancelled, no process left, no
partition published and nothing marked materialized."""

from __future__ import annotations

import signal
from pathlib import Path

import dagster as dg
import pytest

from eagle3_assets.storage import DataLayout
from support.hidden_states_data import cached_tiny_verifier, fabricate_responses
from support.signals import (
    STOP_WITHIN_S,
    HangingServer,
    cleanup,
    log_text,
    make_pipeline,
    materialize_command,
    signal_and_wait,
    start,
    wait_until,
)

pytestmark = [pytest.mark.timeout(300)]
KEY = "00000"


def test_vllm_extraction_stuck_on_its_server_stops_on_sigterm(tmp_path: Path) -> None:
    with HangingServer("eagle3-verifier") as server:
        pipeline = make_pipeline(
            tmp_path, 4, 4, "http://127.0.0.1:9/v1", EAGLE3_VERIFIER_PATH=str(cached_tiny_verifier()),
            EAGLE3_LAYER_IDS="1,2,3", EAGLE3_HIDDEN_STATES_BACKEND="vllm", EAGLE3_HIDDEN_STATES_URL=server.base_url,
        )  # fmt: skip
        layout = DataLayout.at(pipeline.data_dir)
        fabricate_responses(layout, KEY, 16)
        with dg.DagsterInstance.from_config(str(pipeline.home)) as instance:
            instance.add_dynamic_partitions("prompt_partitions", [KEY])
        with cleanup(start(pipeline, materialize_command("hidden_states", KEY), "extract")) as proc:
            wait_until(lambda: server.posts >= 4, proc, 180, "extraction requests in flight")
            stopped = signal_and_wait(proc, signal.SIGTERM)
    output = log_text(pipeline, "extract")
    assert stopped.code is not None, f"still running {STOP_WITHIN_S:.0f} s after SIGTERM:\n{output[-3000:]}"
    assert stopped.code != 0 and stopped.seconds < STOP_WITHIN_S, output[-3000:]
    assert not stopped.left_behind, f"processes left running: {stopped.left_behind}"
    assert not layout.hidden_states_index_path(KEY).exists()
    with dg.DagsterInstance.from_config(str(pipeline.home)) as instance:
        assert instance.get_latest_materialization_event(dg.AssetKey("hidden_states")) is None
        runs = instance.get_runs()
        assert runs and runs[0].status == dg.DagsterRunStatus.FAILURE
