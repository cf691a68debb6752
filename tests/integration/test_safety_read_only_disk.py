"""Issue 31, clause 13: a disk that turns read-only (or fails writes) in the middle of a generation run.

Linux remounts a filesystem read-only after errors (ext4 ``errors=remount-ro``) under the open files of a run; an
operator cannot do that to a mounted test filesystem (a remount with files open for writing is refused: EBUSY), so the
child process's writes to the journal fail with EROFS, or EIO, after a few lines, the way the kernel fails them. The
run must stop with an error naming the journal, keep every journaled sample, and resume once the disk is back.
(A disk read-only before the run starts, for real: ``test_reliability_disk.py``.)
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.generation import generate_partition
from eagle3_assets.generation.journal import read_journal
from fake_vllm import FakeConfig, FakeServerProcess
from support.common import child_env
from support.safety_generation import config, prompts

KEY = "00013"
N, LINES_BEFORE_FAILING = 24, 5

CHILD = textwrap.dedent(
    """
    import errno, os, sys

    url, root, mode, fault, journal, allowed = sys.argv[1:7]
    write, written = os.write, [0]
    def failing_write(fd, data):
        # every write to the journal after the first few fails, as on a disk the kernel turned read-only
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target == journal:
            if written[0] >= int(allowed):
                code = getattr(errno, fault)
                raise OSError(code, os.strerror(code))
            written[0] += 1
        return write(fd, data)
    os.write = failing_write

    from support.safety_generation import config, prompts
    from eagle3_assets.generation import generate_partition
    from eagle3_assets.core.storage import DataLayout
    generate_partition(prompts(24, 1), "00013", DataLayout.at(root), config(url, mode, concurrency=2),
                       log=lambda m: print(m, flush=True))
    """
)


@pytest.fixture
def server() -> Iterator[FakeServerProcess]:
    with FakeServerProcess(FakeConfig(token_rate=20000, median_tokens=40, sigma=0.2)) as running:
        yield running


@pytest.mark.parametrize("fault", ["EROFS", "EIO"])
def test_journal_writes_failing_mid_run_stop_it_naming_the_journal_and_the_rerun_resumes(
    tmp_path: Path, layout: DataLayout, server: FakeServerProcess, fault: str
) -> None:
    journal = layout.responses_in_progress_path(KEY)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    args = [server.base_url, str(layout.root), "last-turn", fault, str(journal), str(LINES_BEFORE_FAILING)]
    child = subprocess.run(
        [sys.executable, str(script), *args], env=child_env(), capture_output=True, text=True, timeout=60
    )
    assert child.returncode != 0, child.stdout
    last_line = child.stderr.strip().splitlines()[-1]
    assert str(journal) in last_line and os.strerror(getattr(errno, fault)) in last_line, child.stderr
    assert not layout.responses_path(KEY).exists()
    kept = read_journal(journal)
    assert len(kept.records) == LINES_BEFORE_FAILING and kept.corrupt_lines == 0

    server.reset_stats()
    result = generate_partition(prompts(N, 1), KEY, layout, config(server.base_url, "last-turn"), log=lambda _m: None)
    assert (result.ok, result.resumed, result.requested) == (N, LINES_BEFORE_FAILING, N - LINES_BEFORE_FAILING)
