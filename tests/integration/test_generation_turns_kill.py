"""Issue 25: SIGKILL a turn-by-turn (all-turns) generation mid-conversation, then resume.

At most the turns in flight at the kill are requested again, no turn is journaled twice, and every conversation
continues from its last journaled turn on the history the model wrote.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import polars as pl

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.generation import GenerationConfig, generate_partition
from eagle3_assets.generation.journal import read_journal
from eagle3_assets.generation.turns import turns_store_path
from fake_vllm import FakeConfig, FakeServerProcess, prompt_key
from support.common import child_env, journal_lines, reaped, sigkill_when
from support.safety_generation import prompts

KEY = "00025"
N, TURNS, C = 60, 4, 16

CHILD = textwrap.dedent(
    """
    import sys
    from eagle3_assets.generation import GenerationConfig, generate_partition
    from eagle3_assets.core.storage import DataLayout
    from support.safety_generation import prompts

    url, root, n, turns = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    config = GenerationConfig(base_urls=[url], model="fake-model", concurrency=16, max_tokens=4000,
                              regenerate="all-turns", fsync_interval_s=0.2, progress_interval_s=0.5)
    conversations = prompts(n, turns, tag="conv", answer="DATASET answer")  # the resume below generates the same
    generate_partition(conversations, "00025", DataLayout.at(root), config, log=lambda m: print(m, flush=True))
    """
)


def test_sigkill_mid_conversation_then_resume_requests_only_the_turns_in_flight(tmp_path: Path) -> None:
    layout = DataLayout.at(tmp_path / "data")
    journal_path = layout.responses_in_progress_path(KEY)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    # ~0.1 s a turn at C=16: 240 turns take ~1.5 s; the kill comes after ~90 turns, mid-conversation for most
    fake = FakeConfig(token_rate=1000, median_tokens=80, sigma=0.5)
    with FakeServerProcess(fake) as server:
        child = subprocess.Popen(
            [sys.executable, str(script), server.base_url, str(layout.root), str(N), str(TURNS)],
            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        with reaped(child):
            sigkill_when(child, lambda: journal_lines(journal_path) >= 90, timeout_s=60, interval_s=0.005)
        assert child.returncode == -signal.SIGKILL
        before = server.stats()
        contents = read_journal(journal_path)
        journaled = contents.records
        assert contents.corrupt_lines == 0 and len(journaled) == contents.lines  # one line per turn
        assert 90 <= len(journaled) < N * TURNS
        # mid-conversation: some conversations have turns journaled and turns left
        per_conv = Counter(tid.split("#")[0] for tid in journaled)
        assert any(0 < n < TURNS for n in per_conv.values())
        server.reset_stats()
        config = GenerationConfig(base_urls=[server.base_url], model="fake-model", concurrency=C, max_tokens=4000,
                                  regenerate="all-turns")  # fmt: skip
        result = generate_partition(prompts(N, TURNS, tag="conv", answer="DATASET answer"), KEY, layout, config)
        after = server.stats()

    turns = pl.read_parquet(turns_store_path(layout, KEY))
    assert turns.height == N * TURNS and turns["sample_id"].n_unique() == N * TURNS  # no turn duplicated
    keys = {r["sample_id"]: prompt_key(r["messages"]) for r in turns.iter_rows(named=True)}
    # the journaled turns are not asked again; the resume asks each remaining turn once
    assert not any(after["requests"].get(keys[tid]) for tid in journaled)
    assert set(after["requests"].values()) == {1}
    assert after["total_requests"] == N * TURNS - len(journaled) == result.requested
    # re-requested across the kill: only what the server had answered but the child had not journaled yet
    lost = [tid for tid in keys if tid not in journaled and before["requests"].get(keys[tid])]
    assert len(lost) <= C
    for record in turns.iter_rows(named=True):  # every history is the model's own
        assert not any("DATASET" in m["content"] for m in record["messages"])
    frame = pl.read_parquet(layout.responses_path(KEY))
    assert (result.ok, result.failed, result.total) == (N, 0, N)
    assert frame["turns_regenerated"].to_list() == [TURNS] * N
    assert result.turns_regenerated == N * TURNS
    assert not journal_path.exists()
