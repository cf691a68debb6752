"""Issue 8, secrets: with EAGLE3_API_KEY set (and the fake server requiring it), raw_prompts and a
synthetic_responses partition run through Dagster's materialize() on a real on-disk instance (DAGSTER_HOME in a
temporary folder), then a run with a wrong key fails. Neither key appears in any file under the data directory or
DAGSTER_HOME (SQLite event log and run storage, compute logs), in any Dagster event, or in the captured output.
(The engine alone is covered by tests/test_generation_engine.py::test_api_key_is_sent_and_never_written.)"""

from __future__ import annotations

import logging
from pathlib import Path

import dagster as dg
import pytest
from conftest import make_resources, write_jsonl

from eagle3_assets.defs.inference import RemoteVLLMResource
from eagle3_assets.defs.prompts import raw_prompts
from eagle3_assets.defs.responses import synthetic_responses
from eagle3_assets.fake_vllm import FakeConfig, FakeServerProcess
from eagle3_assets.storage import DataLayout

SECRET = "sk-reliability-7f3a9c-do-not-leak"
WRONG = "sk-wrong-key-5e1b2d-do-not-leak-either"


def _files_with(root: Path, needles: list[bytes]) -> list[str]:
    hits = []
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            hits += [f"{path}: {needle!r}" for needle in needles if needle in data]
    return hits


@pytest.mark.slow
def test_api_key_appears_in_no_file_event_or_log(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    dagster_home = tmp_path / "dagster_home"
    dagster_home.mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(dagster_home))
    monkeypatch.setenv("EAGLE3_API_KEY", SECRET)
    caplog.set_level(logging.DEBUG)
    layout = DataLayout.at(tmp_path / "data")
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"id": f"k{i}", "prompt": f"secret test {i}"} for i in range(12)])
    with (
        FakeServerProcess(FakeConfig(token_rate=5000, median_tokens=30, api_key=SECRET)) as server,
        dg.DagsterInstance.get() as instance,
    ):
        assert Path(instance.root_directory) == dagster_home  # a real on-disk instance, like `make dev`
        resources = make_resources(
            layout,
            dataset,
            partition_size=10,
            inference_server=RemoteVLLMResource(base_url=server.base_url, concurrency=4),
        )
        assert dg.materialize([raw_prompts], instance=instance, resources=resources).success
        ok = dg.materialize(
            [raw_prompts, synthetic_responses],
            selection=[synthetic_responses],
            partition_key="00000",
            instance=instance,
            resources=resources,
        )
        assert ok.success
        assert ok.asset_materializations_for_node("synthetic_responses")[0].metadata["ok"].value == 10

        monkeypatch.setenv("EAGLE3_API_KEY", WRONG)  # the server refuses it: the run fails
        refused = dg.materialize(
            [raw_prompts, synthetic_responses],
            selection=[synthetic_responses],
            partition_key="00001",
            instance=instance,
            resources=resources,
            raise_on_error=False,
        )
        assert not refused.success
        failure = refused.get_step_failure_events()[0].event_specific_data.error
        assert failure is not None and "API key" in failure.to_string()

        events = [str(record) for run in instance.get_runs() for record in instance.all_logs(run.run_id)]
        runs = [str(run) for run in instance.get_runs()]
    needles = [SECRET.encode(), WRONG.encode()]
    assert len(events) > 20
    for text in events + runs:
        assert SECRET not in text and WRONG not in text
    assert layout.responses_path("00000").exists()
    assert not _files_with(layout.root, needles)
    assert any(dagster_home.rglob("*.db")), list(dagster_home.rglob("*"))  # the SQLite storage was searched
    assert not _files_with(dagster_home, needles)
    assert not _files_with(tmp_path, needles)  # anything else the runs left in the temporary folder
    captured = capfd.readouterr()
    assert "synthetic_responses 00000" in captured.out + captured.err + caplog.text  # the run's log lines
    for text in (captured.out, captured.err, caplog.text):
        assert SECRET not in text and WRONG not in text
