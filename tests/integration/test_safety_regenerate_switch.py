"""Issue 31, clause 3: switching ``EAGLE3_REGENERATE`` after an interrupted run loses no journaled row.

Both modes journal into the same ``synthetic_responses/_in_progress/{key}.jsonl``. A run is SIGKILLed in one mode
after some lines, the partition is then finished in the other mode, and finally built in the first mode again: every
row the killed run journaled must have been kept (in the superseded archive) and is reused, not requested again.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.generation import generate_partition
from eagle3_assets.generation.journal import read_journal
from fake_vllm import FakeConfig, FakeServerProcess, prompt_key
from support.common import child_env, journal_lines, reaped, sigkill_when
from support.safety_generation import config, prompts

KEY = "00031"
N, TURNS, C = 40, 2, 4
KILL_AFTER = 10  # journal lines

CHILD = textwrap.dedent(
    """
    import sys
    from support.safety_generation import config, prompts
    from eagle3_assets.generation import generate_partition
    from eagle3_assets.core.storage import DataLayout

    url, root, mode, key, n, turns, c = sys.argv[1:8]
    generate_partition(prompts(int(n), int(turns)), key, DataLayout.at(root), config(url, mode, concurrency=int(c)),
                       log=lambda m: print(m, flush=True))
    """
)


def _interrupted(tmp: Path, server: FakeServerProcess, layout: DataLayout, mode: str) -> dict[str, dict[str, Any]]:
    """SIGKILL a ``mode`` run after :data:`KILL_AFTER` journal lines; returns its journaled records."""
    script = tmp / "child.py"
    script.write_text(CHILD)
    journal = layout.responses_in_progress_path(KEY)
    args = [server.base_url, str(layout.root), mode, KEY, str(N), str(TURNS), str(C)]
    child = subprocess.Popen(
        [sys.executable, str(script), *args], env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    with reaped(child):
        sigkill_when(child, lambda: journal_lines(journal) >= KILL_AFTER, timeout_s=60, interval_s=0.005)
    assert child.returncode == -signal.SIGKILL
    records = read_journal(journal).records
    assert KILL_AFTER <= len(records) < N * (TURNS if mode == "all-turns" else 1)
    assert all(record["status"] == "ok" for record in records.values())
    return records


def _requested(server: FakeServerProcess) -> dict[str, int]:
    return server.stats()["requests"]


@pytest.fixture
def server() -> Iterator[FakeServerProcess]:
    # ~0.12 s a response at C=4: a mode's run takes ~1.2 s (last-turn) to ~2.4 s (all-turns), the kill comes early
    with FakeServerProcess(FakeConfig(token_rate=1000, median_tokens=120, sigma=0.3)) as running:
        yield running


@pytest.mark.parametrize(("first", "then"), [("last-turn", "all-turns"), ("all-turns", "last-turn")])
def test_switching_mode_after_a_kill_keeps_and_reuses_every_journaled_row(
    tmp_path: Path, layout: DataLayout, server: FakeServerProcess, first: str, then: str
) -> None:
    journaled = _interrupted(tmp_path, server, layout, first)
    keys = {sid: prompt_key(record["messages"]) for sid, record in journaled.items()}

    # the other mode finishes the partition (twice: a rewrite of the archive must not drop what it holds)
    for _ in range(2):
        result = generate_partition(prompts(N, TURNS), KEY, layout, config(server.base_url, then), log=lambda _m: None)
        assert result.ok == N
    assert not layout.responses_in_progress_path(KEY).exists()
    archive = pl.read_parquet(layout.responses_superseded_path(KEY))
    assert set(journaled) <= set(archive["sample_id"])  # every journaled row kept, in a named place

    # back to the first mode: the journaled rows answer its requests again and are reused as they were
    server.reset_stats()
    result = generate_partition(prompts(N, TURNS), KEY, layout, config(server.base_url, first), log=lambda _m: None)
    requested = _requested(server)
    assert not {keys[sid] for sid in journaled} & set(requested), "a journaled row was requested again"
    expected = N * (TURNS if first == "all-turns" else 1) - len(journaled)
    assert server.stats()["total_requests"] == expected
    assert result.ok == N
    if first == "last-turn":
        frame = pl.read_parquet(layout.responses_path(KEY))
        for row in frame.filter(pl.col("sample_id").is_in(list(journaled))).iter_rows(named=True):
            assert row["finished_at"] == journaled[row["sample_id"]]["finished_at"]
