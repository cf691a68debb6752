"""A run's measurement file (issue 32 item 1): one file per run and commit, rewritten after every stage so a stopped
run keeps what it measured, and a resumed run adds to the same file instead of starting a second one."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_assets.evaluation.evaluation_report import REPORT_JSON
from eagle3_assets.operations.measurement import MeasurementFile, commit_of
from eagle3_assets.operations.measurement_tables import render_stages


def test_stages_are_on_disk_as_they_end_and_a_resumed_run_adds_to_the_same_file(tmp_path: Path) -> None:
    out = tmp_path / "measurements"
    first = MeasurementFile(out, "recipe", {"environment": {"EAGLE3_MAX_TOKENS": "256"}}, commit="abc1234")
    first.stage("raw_prompts", "-", 1.04)
    first.stage("synthetic_responses", "4", 950.0, server_fullness={"share": 0.97})
    written = json.loads(first.path.read_text())  # a kill here keeps both stages
    assert first.path == out / "recipe_abc1234.json"
    assert written["complete"] is False and written["commit"] == "abc1234"
    assert written["stages"][0] == {"stage": "raw_prompts", "partitions": "-", "seconds": 1.0, "attempt": 1}
    assert written["stages"][1]["server_fullness"] == {"share": 0.97}
    assert written["machine"]["cores"] >= 1 and written["settings"]["environment"] == {"EAGLE3_MAX_TOKENS": "256"}

    resumed = MeasurementFile(out, "recipe", {}, commit="abc1234")
    resumed.stage("synthetic_responses", "4", 5.0)  # re-run over published partitions: seconds, nothing generated
    resumed.stage("hidden_states", "4", 240.0)
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / REPORT_JSON).write_text(json.dumps({"online": {"humaneval": 1.9}}))
    path = resumed.finish(tmp_path, tmp_path / "eval" / REPORT_JSON, tmp_path / "missing.json", {"rows": {}})
    record = json.loads(path.read_text())
    # the first attempt's 950 s of generation stays beside the resumed attempt's 5 s re-run (it once replaced it)
    assert [(s["stage"], s["attempt"], s["seconds"]) for s in record["stages"]] == [
        ("raw_prompts", 1, 1.0), ("synthetic_responses", 1, 950.0), ("synthetic_responses", 2, 5.0),
        ("hidden_states", 2, 240.0),
    ]  # fmt: skip
    assert len(record["attempts"]) == 2 and record["started"] == written["started"]
    assert record["complete"] is True and record["seconds_total"] == 1196.0
    assert record["evaluation"] == {"online": {"humaneval": 1.9}} and record["training"] == {"config": None}
    assert sorted(p.name for p in out.iterdir()) == ["recipe_abc1234.json"]  # no temporary file left behind


def test_the_commit_is_this_checkouts() -> None:
    commit, _dirty = commit_of()
    assert commit != "unknown" and len(commit) >= 7


def test_a_demo_run_is_finished_from_what_it_left_in_its_data_dir(tmp_path: Path) -> None:
    measurement = MeasurementFile(tmp_path / "m", "demo", {}, commit="abc1234")
    measurement.stage("raw_prompts", "-", 1.0)
    # nothing generated, trained or evaluated
    record = json.loads(measurement.finish_run(tmp_path / "data").read_text())
    assert record["complete"] is True and record["evaluation"] is None and record["training"] == {"config": None}
    assert record["data_dir"] == str(tmp_path / "data") and record["counts"] is not None


def test_a_resumed_runs_stages_table_says_which_attempt_each_row_is() -> None:
    one = {"stage": "draft_model", "partitions": "-", "seconds": 3942.1}
    assert render_stages({"stages": [one]}).splitlines()[0] == "| stage | partitions | seconds | server fullness |"
    table = render_stages({"stages": [{**one, "attempt": 1}, {**one, "seconds": 1.2, "attempt": 2}]}).splitlines()
    assert table[0] == "| stage | attempt | partitions | seconds | server fullness |"
    assert table[2:] == ["| draft_model | 1 | - | 3942.1 | - |", "| draft_model | 2 | - | 1.2 | - |"]
