"""Issue 22: ``hidden_states`` with the ``vllm`` backend, its extraction server stuck (every request hangs), stops on
SIGTERM through the real ``dagster asset materialize``: within 30 s, its requests cancelled, no process left, no
partition published and nothing marked materialized."""

from __future__ import annotations

import signal
from pathlib import Path

import dagster as dg
import pytest

from eagle3_assets.core.storage import DataLayout
from support.hidden_states_data import cached_tiny_verifier, fabricate_responses
from support.signals import hanging_server, log_text, make_pipeline, materialize_command, run, stop_mid_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
KEY = "00000"
EXTRACT = materialize_command("hidden_states", KEY)


def test_vllm_extraction_stuck_on_its_server_stops_on_sigterm(tmp_path: Path) -> None:
    (tmp_path / "transfer").mkdir()
    with hanging_server("eagle3-verifier") as server:
        pipeline = make_pipeline(
            tmp_path, 4, 4, "http://127.0.0.1:9/v1", EAGLE3_VERIFIER_PATH=str(cached_tiny_verifier()),
            EAGLE3_LAYER_IDS="1,2,3", EAGLE3_HIDDEN_STATES_BACKEND="vllm", EAGLE3_HIDDEN_STATES_URL=server.base_url,
            EAGLE3_HIDDEN_STATES_STORAGE=str(tmp_path / "transfer"),  # remote extraction needs its storage root
        )  # fmt: skip
        layout = DataLayout.at(pipeline.data_dir)
        fabricate_responses(layout, KEY, 16)
        with dg.DagsterInstance.from_config(str(pipeline.home)) as instance:
            instance.add_dynamic_partitions("prompt_partitions", [KEY])
        in_flight = "extraction requests in flight"
        stop_mid_run(pipeline, EXTRACT, "extract", lambda: server.posts >= 4, in_flight, signal.SIGTERM, 180)
    assert not layout.hidden_states_index_path(KEY).exists()
    with dg.DagsterInstance.from_config(str(pipeline.home)) as instance:
        assert instance.get_latest_materialization_event(dg.AssetKey("hidden_states")) is None
        runs = instance.get_runs()
        assert runs and runs[0].status == dg.DagsterRunStatus.FAILURE


def _stored(data_dir: Path) -> int:
    return sum(1 for _ in (data_dir / "hidden_states").rglob("hs_*.safetensors"))


def test_hf_extraction_stops_on_sigint_keeps_its_files_and_resumes(tmp_path: Path) -> None:
    pipeline = make_pipeline(
        tmp_path, 4, 4, "http://127.0.0.1:9/v1", EAGLE3_VERIFIER_PATH=str(cached_tiny_verifier()),
        EAGLE3_LAYER_IDS="1,2,3", EAGLE3_HIDDEN_STATES_BACKEND="hf",
    )  # fmt: skip
    layout = DataLayout.at(pipeline.data_dir)
    samples = 3000  # one fsynced file each: the extraction takes long enough to be stopped in the middle
    fabricate_responses(layout, KEY, samples, min_words=5, max_words=10)
    with dg.DagsterInstance.from_config(str(pipeline.home)) as instance:
        instance.add_dynamic_partitions("prompt_partitions", [KEY])
    fifty = "50 stored sample files"
    stop_mid_run(pipeline, EXTRACT, "extract", lambda: _stored(pipeline.data_dir) >= 50, fifty, signal.SIGINT, 180)
    kept = _stored(pipeline.data_dir)
    assert 50 <= kept < samples
    assert not layout.hidden_states_index_path(KEY).exists()
    assert run(pipeline, EXTRACT, "resume") == 0, log_text(pipeline, "resume")
    resumed = log_text(pipeline, "resume")
    stored_before = int(resumed.split(f"hidden_states {KEY}: {samples} samples, ")[1].split(" already stored")[0])
    assert stored_before >= kept - 8  # the files stored whole are reused (a few torn by the stop are redone)
    assert layout.hidden_states_index_path(KEY).exists()
