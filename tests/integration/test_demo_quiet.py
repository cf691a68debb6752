"""``make demo`` is quiet: one terminal line per stage and partition; Dagster's event log goes to a file (issue 16)."""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg
import pytest

from eagle3_assets.definitions import build_definitions
from eagle3_assets.operations import demo
from fake_vllm import FakeConfig, serve_in_thread
from support.operations import write_prompts


def test_stages_print_one_line_per_partition_and_log_everything_else(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    dataset = write_prompts(tmp_path, 30)
    monkeypatch.setenv("EAGLE3_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("EAGLE3_PROMPTS_PATH", str(dataset))
    monkeypatch.setenv("EAGLE3_PARTITION_SIZE", "10")
    log = tmp_path / "demo.log"
    lines: list[str] = []
    with serve_in_thread(FakeConfig(token_rate=20000, median_tokens=20)) as base_url:
        # the generation partitions run in processes of their own, with the definitions the environment builds
        monkeypatch.setenv("EAGLE3_VLLM_BASE_URL", base_url)
        monkeypatch.setenv("EAGLE3_CONCURRENCY", "8")
        defs = build_definitions()
        with dg.instance_for_test() as instance, demo.output_to(log) as say:
            os.write(2, b"a subprocess writing to fd 2\n")  # noise of any kind goes to the log
            print("a stray print")

            def keep(line: str) -> None:
                lines.append(line)
                say(line)

            timings = demo.run_stages(
                defs, instance, keep, lambda _name: None, only=["raw_prompts", "synthetic_responses"]
            )
    out, err = capfd.readouterr()
    assert out.splitlines() == lines and err == ""
    assert len(lines) == 4  # raw_prompts + 3 partitions
    assert lines[0].startswith("raw_prompts: ok in ") and lines[0].endswith(", 30 rows")
    assert lines[3].startswith("synthetic_responses partition 00002 (3/3): ok in ") and lines[3].endswith("10 rows")
    text = log.read_text()
    assert "a stray print" in text and "a subprocess writing to fd 2" in text
    assert text.count("RUN_SUCCESS") == 4 and "STEP_START" in text  # Dagster's DEBUG event log
    assert [t[:2] for t in timings] == [("raw_prompts", "-"), ("synthetic_responses", "3")]


def test_a_failed_stage_names_itself_in_one_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EAGLE3_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("EAGLE3_PROMPTS_PATH", str(tmp_path / "missing.jsonl"))
    lines: list[str] = []
    with dg.instance_for_test() as instance, demo.output_to(tmp_path / "demo.log") as say:
        with pytest.raises(SystemExit, match="raw_prompts failed"):
            demo.run_stages(build_definitions(), instance, lines.append, lambda _n: None, only=["raw_prompts"])
        say(lines[0])
    out, _err = capfd.readouterr()
    missing = tmp_path / "missing.jsonl"
    assert out.splitlines() == [f"raw_prompts: FAILED: EAGLE3_PROMPTS_PATH='{missing}': no such file"]
