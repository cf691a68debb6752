"""``make demo``/``demo-real`` and the learning curve keep the server full across partitions (issue 33 item 3):
the next partition's requests are queued while the one before drains, as under the daemon's backfill, and the
command says how full the server was."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import polars as pl
import pytest

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.definitions import build_definitions
from eagle3_assets.generation import GenerationConfig, PromptToGenerate
from eagle3_assets.generation.fullness import ServerFullness
from eagle3_assets.generation.partition_run import generate_partitions
from eagle3_assets.local.process_group import descendants
from eagle3_assets.operations import demo
from fake_vllm import FakeConfig, serve_in_thread
from support.common import child_env, journal_lines, reaped
from support.operations import write_prompts

# ~3 s per answer, 8 slots: each partition of 16 lasts two waves, longer than a run process takes to start (~3 s)
SLOW = FakeConfig(token_rate=100, median_tokens=300, sigma=0.5, max_num_seqs=8)


def spans(data_dir: Path) -> dict[str, tuple[float, float]]:
    """Per partition: (first request sent, last answer back), from the rows' own timestamps."""
    frames = [pl.read_parquet(path) for path in sorted((data_dir / "synthetic_responses").glob("*.parquet"))]
    frame = pl.concat(frames).with_columns(sent=pl.col("finished_at") - pl.col("latency_s"))
    grouped = frame.group_by("partition_key").agg(pl.col("sent").min(), pl.col("finished_at").max())
    return {row[0]: (row[1], row[2]) for row in grouped.sort("partition_key").iter_rows()}


def assert_overlapped(spans_by_key: dict[str, tuple[float, float]]) -> None:
    """From the first request to the last answer some partition always had requests out: no partition's tail was
    drained alone before the next one started (whichever order the runs took the room in)."""
    assert len(spans_by_key) == 3
    ordered = sorted(spans_by_key.values())
    covered_until = ordered[0][1]
    for sent, answered in ordered[1:]:
        assert sent < covered_until, (sent, covered_until, spans_by_key)
        covered_until = max(covered_until, answered)


def test_demo_overlaps_generation_partitions_and_reports_fullness(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dataset = write_prompts(tmp_path, 48)
    monkeypatch.setenv("EAGLE3_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("EAGLE3_PROMPTS_PATH", str(dataset))
    monkeypatch.setenv("EAGLE3_PARTITION_SIZE", "16")
    lines: list[str] = []
    with serve_in_thread(SLOW) as base_url:
        # each partition runs in its own process, with the definitions the environment builds (as the demo's)
        monkeypatch.setenv("EAGLE3_VLLM_BASE_URL", base_url)
        monkeypatch.setenv("EAGLE3_CONCURRENCY", "8")
        with dg.instance_for_test() as instance:

            def watch(name: str) -> ServerFullness | None:
                return ServerFullness(base_url, 8, interval_s=0.05) if name == demo.GENERATION_ASSET else None

            demo.run_stages(
                build_definitions(), instance, lines.append, lambda _n: None,
                only=["raw_prompts", "synthetic_responses"], watch_server=watch,
            )  # fmt: skip
    # one line per partition, in key order, then the fullness line
    assert [line.split(":")[0] for line in lines[1:4]] == [
        f"synthetic_responses partition 0000{i} ({i + 1}/3)" for i in range(3)
    ]
    assert lines[4].startswith("server fullness during synthetic_responses: ") and " of 8 requests running" in lines[4]
    assert_overlapped(spans(tmp_path / "data"))


def test_generate_partitions_overlaps_and_returns_every_result(tmp_path: Path) -> None:
    layout = DataLayout.at(tmp_path / "data")
    prompts = {
        f"0000{k}": [PromptToGenerate(f"s{k}-{i}", [{"role": "user", "content": f"q {k} {i}"}]) for i in range(16)]
        for k in range(3)
    }
    with serve_in_thread(SLOW) as base_url:
        config = GenerationConfig(base_urls=(base_url,), max_tokens=1024, concurrency=8)
        with ServerFullness(base_url, 8, interval_s=0.05) as fullness:
            results = generate_partitions(prompts, layout, config, log=lambda _s: None)
    assert {key: (r.ok, r.failed) for key, r in results.items()} == {key: (16, 0) for key in prompts}
    assert_overlapped(spans(tmp_path / "data"))
    report = fullness.report
    assert report is not None and report.readings > 0 and 0 < report.share <= 1.0


# The demo's generation stage in a process of its own, as `eagle3 demo` runs it: partition runs in child processes.
STAGE_SCRIPT = """
import dagster as dg
from eagle3_assets.operations import demo
from eagle3_assets.definitions import build_definitions
demo.stop_on_sigterm()
with dg.DagsterInstance.get() as instance:
    demo.run_stages(build_definitions(), instance, print, lambda _n: None, only=["raw_prompts", "synthetic_responses"])
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_stopped_demo_leaves_no_partition_run_behind_and_resumes(tmp_path: Path, sig: signal.Signals) -> None:
    """SIGTERM (handled as Ctrl-C) or SIGKILL (nothing handled: the kernel's parent-death signal) to the demo while
    its partition runs generate: every process it started ends within 30 s, and a re-run resumes with every
    journaled answer kept."""
    dataset = write_prompts(tmp_path, 48)
    env = child_env(
        DAGSTER_HOME=str(tmp_path / "dagster_home"), EAGLE3_DATA_DIR=str(tmp_path / "data"),
        EAGLE3_PROMPTS_PATH=str(dataset), EAGLE3_PARTITION_SIZE="16", EAGLE3_CONCURRENCY="8",
    )  # fmt: skip
    (tmp_path / "dagster_home").mkdir()
    layout = DataLayout.at(tmp_path / "data")
    # answers of ~30 s: a partition run left behind would still be generating long after the 30 s allowed
    with serve_in_thread(FakeConfig(token_rate=10, median_tokens=300, sigma=0.3, max_num_seqs=8)) as base_url:
        env["EAGLE3_VLLM_BASE_URL"] = base_url
        child = subprocess.Popen([sys.executable, "-c", STAGE_SCRIPT], env=env, stdout=subprocess.DEVNULL)
        with reaped(child):
            deadline = time.monotonic() + 180
            while journal_lines(layout.responses_in_progress_path("00000")) < 1:
                assert time.monotonic() < deadline and child.poll() is None, "no partition run answered"
                time.sleep(0.2)
            started = descendants(child.pid)
            assert started, "the partition runs are child processes"
            journaled = journal_lines(layout.responses_in_progress_path("00000"))
            child.send_signal(sig)
            child.wait(timeout=30)
            deadline = time.monotonic() + 30
            while _alive(started) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not _alive(started), f"left running: {sorted(_alive(started))}"
    with serve_in_thread(SLOW) as base_url:  # the re-run, against a faster server (the same model and settings)
        env["EAGLE3_VLLM_BASE_URL"] = base_url
        rerun = subprocess.run(
            [sys.executable, "-c", STAGE_SCRIPT], env=env, capture_output=True, text=True, timeout=300
        )
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    rows = pl.read_parquet(layout.responses_path("00000"))
    assert rows.height == 16 and rows["sample_id"].n_unique() == 16
    # the journaled answers were kept, not requested again (the partition run's own log line, in its stderr)
    kept = re.search(r"synthetic_responses 00000: 16 prompts; (\d+) already ok on disk", rerun.stderr)
    assert kept is not None and int(kept[1]) >= journaled, rerun.stderr[-2000:]


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        with contextlib.suppress(OSError):  # a zombie waiting for its reaper is gone for this purpose
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                continue
        alive.add(pid)
    return alive
