"""Acceptance 2 of issue 3: SIGKILL a materialization mid-partition, then resume without re-requesting."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import polars as pl

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.generation import GenerationConfig, PromptToGenerate, generate_partition
from eagle3_assets.generation.journal import read_journal
from fake_vllm import FakeConfig, FakeServerProcess, prompt_key
from support.common import child_env, journal_lines, reaped, sigkill_when

KEY = "00003"
N = 1000

# The child builds the same prompts as make_prompts below.
CHILD = textwrap.dedent(
    """
    import sys
    from eagle3_assets.generation import GenerationConfig, PromptToGenerate, generate_partition
    from eagle3_assets.core.storage import DataLayout

    url, root, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    prompts = [PromptToGenerate(f"kill-{i:05d}", [{"role": "user", "content": f"kill test prompt {i}"}])
               for i in range(n)]
    config = GenerationConfig(base_urls=[url], model="fake-model", concurrency=32, max_tokens=4000,
                              fsync_interval_s=0.2, progress_interval_s=0.5)
    generate_partition(prompts, "00003", DataLayout.at(root), config, log=lambda m: print(m, flush=True))
    """
)


def make_prompts(n: int) -> list[PromptToGenerate]:
    return [PromptToGenerate(f"kill-{i:05d}", [{"role": "user", "content": f"kill test prompt {i}"}]) for i in range(n)]


def test_sigkill_mid_partition_then_resume_requests_only_the_missing(tmp_path: Path) -> None:
    layout = DataLayout.at(tmp_path / "data")
    journal_path = layout.responses_in_progress_path(KEY)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    prompts = make_prompts(N)
    key_of = {p.sample_id: prompt_key([dict(m) for m in p.messages]) for p in prompts}
    # ~0.2 s per response at C=32: the whole partition would take ~7 s, the kill comes after ~300 samples
    fake = FakeConfig(token_rate=1000, median_tokens=150, sigma=0.8)
    with FakeServerProcess(fake) as server:
        env = child_env()
        child = subprocess.Popen(
            [sys.executable, str(script), server.base_url, str(layout.root), str(N)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        with reaped(child):
            sigkill_when(child, lambda: journal_lines(journal_path) >= 300, timeout_s=60, interval_s=0.01)
        assert child.returncode == -signal.SIGKILL
        assert not layout.responses_path(KEY).exists()  # killed before the end: no final file

        before = server.stats()
        contents = read_journal(journal_path)
        journaled = set(contents.records)
        assert contents.corrupt_lines == 0
        assert 300 <= len(journaled) < N
        assert all(r["status"] == "ok" for r in contents.records.values())
        assert len(journaled) == contents.lines  # one line per sample, no duplicates
        # Every response the server finished before the kill is in the journal, except at most the ones the
        # client had received but not yet written in the instant of the kill (bounded by the pool size).
        assert before["completed"] - len(journaled) <= 32
        # the journal only holds samples that really were requested
        assert all(before["requests"].get(key_of[sid], 0) == 1 for sid in journaled)

        server.reset_stats()
        logs: list[str] = []
        config = GenerationConfig(base_urls=[server.base_url], model="fake-model", concurrency=32, max_tokens=4000)
        result = generate_partition(prompts, KEY, layout, config, log=logs.append)
        after = server.stats()

    missing = [p for p in prompts if p.sample_id not in journaled]
    # the fake server's counters: exactly the missing samples were requested, each once
    assert after["total_requests"] == len(missing) == result.requested
    assert set(after["requests"]) == {key_of[p.sample_id] for p in missing}
    assert set(after["requests"].values()) == {1}
    assert (result.resumed, result.ok, result.failed, result.total) == (len(journaled), N, 0, N)

    frame = pl.read_parquet(layout.responses_path(KEY))
    assert frame.height == N and frame["sample_id"].n_unique() == N
    assert frame["sample_id"].to_list() == [p.sample_id for p in prompts]
    assert set(frame["status"]) == {"ok"}
    kept = frame.filter(pl.col("sample_id").is_in(list(journaled)))
    for row in kept.head(20).iter_rows(named=True):  # the journaled rows are kept as they were
        assert row["finished_at"] == contents.records[row["sample_id"]]["finished_at"]
    assert not journal_path.exists()
