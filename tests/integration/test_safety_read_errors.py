"""Issue 31, clause 2: a read error is not corruption.

A finished ``synthetic_responses`` file (the partition's Parquet, or the all-turns mode's turn store) that cannot be
read (EACCES, EIO, a stale NFS handle, ENOSPC, MemoryError) fails the run naming the file and keeps it byte for byte:
no request is sent, nothing is written over it. Only a file proven corrupt (bad magic, a footer that does not fit)
is set aside, moved to ``synthetic_responses/_corrupt/`` under a timestamped name, and its rows generated again.

The fault is injected into a real child process: EACCES for real (the file is made unreadable with chmod 000; a
root child runs without the capabilities that bypass file modes), the others by making the child's reads of that
one file raise the error (Python's ``Path.read_bytes`` and polars' ``read_parquet``, the two ways to read it).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest

from eagle3_assets.core.storage import DataLayout
from eagle3_assets.generation import generate_partition
from eagle3_assets.generation.turns import turns_store_path
from fake_vllm import FakeConfig, FakeServerProcess
from support.common import child_env
from support.root_file_access import file_modes_enforced

KEY = "00001"
N = 6

CHILD = textwrap.dedent(
    """
    import errno, os, pathlib, sys
    import polars

    url, root, mode, fault, target = sys.argv[1:6]
    if fault != "EACCES":  # EACCES is real (chmod 000); the others are raised by every read of the target file
        def fail():
            if fault == "MemoryError":
                raise MemoryError()
            code = getattr(errno, fault)
            raise OSError(code, os.strerror(code), target)
        read_bytes, read_parquet = pathlib.Path.read_bytes, polars.read_parquet
        def faulty_read_bytes(self):
            if str(self) == target:
                fail()
            return read_bytes(self)
        def faulty_read_parquet(source, *args, **kwargs):
            if str(source) == target:
                fail()
            return read_parquet(source, *args, **kwargs)
        pathlib.Path.read_bytes, polars.read_parquet = faulty_read_bytes, faulty_read_parquet

    from support.safety_generation import config, prompts
    from eagle3_assets.generation import generate_partition
    from eagle3_assets.core.storage import DataLayout
    generate_partition(prompts(), "00001", DataLayout.at(root), config(url, mode), log=lambda m: print(m, flush=True))
    """
)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` with its content hash (lock files excluded: their holder note changes)."""
    return {
        str(p.relative_to(root)): _digest(p) for p in sorted(root.rglob("*")) if p.is_file() and p.suffix != ".lock"
    }


@pytest.fixture
def server() -> Iterator[FakeServerProcess]:
    with FakeServerProcess(FakeConfig(token_rate=20000, median_tokens=40, sigma=0.2)) as running:
        yield running


def _run_child(tmp: Path, url: str, root: Path, mode: str, fault: str, target: Path) -> subprocess.CompletedProcess:
    script = tmp / "child.py"
    script.write_text(CHILD)
    if fault == "EACCES":
        os.chmod(target, 0o000)
    try:
        return subprocess.run(
            [sys.executable, str(script), url, str(root), mode, fault, str(target)],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=60,
            preexec_fn=file_modes_enforced(fault == "EACCES"),
        )
    finally:
        if fault == "EACCES":
            os.chmod(target, 0o644)


FAULTS = [
    pytest.param("last-turn", "EACCES", id="last-turn-EACCES"),
    pytest.param("last-turn", "EIO", id="last-turn-EIO"),
    pytest.param("last-turn", "ESTALE", id="last-turn-ESTALE"),
    pytest.param("last-turn", "ENOSPC", id="last-turn-ENOSPC"),
    pytest.param("last-turn", "MemoryError", id="last-turn-MemoryError"),
    pytest.param("all-turns", "EACCES", id="all-turns-EACCES"),
    pytest.param("all-turns", "EIO", id="all-turns-EIO"),
]


@pytest.mark.parametrize(("mode", "fault"), FAULTS)
def test_a_finished_file_that_cannot_be_read_fails_the_run_naming_it_and_keeps_everything(
    tmp_path: Path, layout: DataLayout, server: FakeServerProcess, mode: str, fault: str
) -> None:
    from support.safety_generation import config, prompts

    first = generate_partition(prompts(), KEY, layout, config(server.base_url, mode), log=lambda _m: None)
    assert first.ok == N
    # what the run resumes from: the partition's file (last-turn), the turn store (all-turns)
    target = layout.responses_path(KEY) if mode == "last-turn" else turns_store_path(layout, KEY)
    before = _tree(layout.root)
    server.reset_stats()

    child = _run_child(tmp_path, server.base_url, layout.root, mode, fault, target)

    assert child.returncode != 0, f"the run went on over an unreadable {target.name}:\n{child.stdout}"
    assert str(target) in child.stderr, child.stderr
    assert fault in child.stderr or os.strerror(getattr(errno, fault, 0)) in child.stderr, child.stderr
    assert server.stats()["total_requests"] == 0  # nothing regenerated
    assert _tree(layout.root) == before  # every file kept byte for byte, the unreadable one included
    assert not (layout.asset_dir("synthetic_responses") / "_corrupt").exists()  # a read error is not corruption

    # the fault cleared, the re-run resumes everything from the kept files
    again = generate_partition(prompts(), KEY, layout, config(server.base_url, mode), log=lambda _m: None)
    assert (again.ok, again.requested) == (N, 0)
    assert server.stats()["total_requests"] == 0


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_corrupt_partition_file_is_archived_not_overwritten_and_its_rows_generated_again(
    layout: DataLayout, server: FakeServerProcess, damage: str
) -> None:
    from support.safety_generation import config, prompts

    generate_partition(prompts(), KEY, layout, config(server.base_url, "last-turn"), log=lambda _m: None)
    path = layout.responses_path(KEY)
    data = path.read_bytes()
    broken = b"not a parquet file " * 40 if damage == "garbage" else data[: len(data) // 2]
    path.write_bytes(broken)
    server.reset_stats()
    logs: list[str] = []

    result = generate_partition(prompts(), KEY, layout, config(server.base_url, "last-turn"), log=logs.append)

    assert (result.ok, result.requested) == (N, N)  # proven corrupt: its rows are generated again
    archived = list((layout.asset_dir("synthetic_responses") / "_corrupt").iterdir())
    assert len(archived) == 1 and archived[0].name.startswith(f"{KEY}.parquet.")
    assert archived[0].read_bytes() == broken  # kept as it was, under a timestamped name
    assert any(str(path) in line and "corrupt" in line and str(archived[0]) in line for line in logs), logs
    assert pl.read_parquet(path).height == N

    # a second corrupt copy never replaces the first archive
    path.write_bytes(broken)
    generate_partition(prompts(), KEY, layout, config(server.base_url, "last-turn"), log=lambda _m: None)
    assert sorted(p.read_bytes() for p in (layout.asset_dir("synthetic_responses") / "_corrupt").iterdir()) == [
        broken,
        broken,
    ]


def test_a_corrupt_turn_store_is_archived_and_its_turns_generated_again(
    layout: DataLayout, server: FakeServerProcess
) -> None:
    from support.safety_generation import config, prompts

    generate_partition(prompts(), KEY, layout, config(server.base_url, "all-turns"), log=lambda _m: None)
    store = turns_store_path(layout, KEY)
    store.write_bytes(b"PAR1 torn")
    result = generate_partition(prompts(), KEY, layout, config(server.base_url, "all-turns"), log=lambda _m: None)
    assert result.ok == N
    (archived,) = (layout.asset_dir("synthetic_responses") / "_corrupt").iterdir()
    assert archived.read_bytes() == b"PAR1 torn"


EXTRACT_CHILD = textwrap.dedent(
    """
    import sys
    from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
    from eagle3_assets.core.storage import DataLayout
    from support.hidden_states_data import cached_tiny_verifier

    config = HiddenStatesConfig(layer_ids=[1, 2, 3], max_seq_len=96)
    extract_partition(DataLayout.at(sys.argv[1]), "00000", cached_tiny_verifier(), config, log=print)
    """
)


@pytest.mark.slow  # three extractions with the tiny verifier
def test_a_stored_sample_file_that_cannot_be_read_fails_the_extraction_naming_it_and_is_kept(
    tmp_path: Path, layout: DataLayout
) -> None:
    """A rebuild resumes from the published version's sample files (hard links); one that cannot be read (EACCES,
    for real) fails the run naming it, instead of being deleted and computed again."""
    from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
    from support.hidden_states_data import cached_tiny_verifier, fabricate_responses

    config = HiddenStatesConfig(layer_ids=[1, 2, 3], max_seq_len=96)
    fabricate_responses(layout, "00000", 8)
    extract_partition(layout, "00000", cached_tiny_verifier(), config)
    version = layout.hidden_states_dir("00000").resolve()
    sample = version / "hidden_states" / "hs_0.safetensors"
    before = _tree(version)
    fabricate_responses(layout, "00000", 12)  # the partition grew: a rebuild that reuses the stored samples
    script = tmp_path / "extract.py"
    script.write_text(EXTRACT_CHILD)
    os.chmod(sample, 0o000)
    try:
        child = subprocess.run(
            [sys.executable, str(script), str(layout.root)],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=file_modes_enforced(),
        )
    finally:
        with contextlib.suppress(FileNotFoundError):  # a run that went on deleted it with the old version
            os.chmod(sample, 0o644)
    assert child.returncode != 0, f"the extraction went on over an unreadable sample file:\n{child.stdout}"
    last_line = child.stderr.strip().splitlines()[-1]
    assert "hs_0.safetensors" in last_line and "Permission denied" in last_line, child.stderr
    assert layout.hidden_states_dir("00000").resolve() == version and _tree(version) == before

    again = extract_partition(layout, "00000", cached_tiny_verifier(), config)  # readable again: it resumes
    assert (again.samples, again.samples_with_states) == (12, 12) and again.stored < 12


def test_a_journal_with_an_unparseable_line_is_archived_not_deleted(
    layout: DataLayout, server: FakeServerProcess
) -> None:
    """A complete journal line that does not parse is proven corrupt: the rest resumes, and the journal is archived
    in ``_corrupt/`` when the partition is written (it was deleted with that line)."""
    import orjson

    from support.safety_generation import config, prompts

    generate_partition(prompts(), KEY, layout, config(server.base_url, "last-turn"), log=lambda _m: None)
    rows = pl.read_parquet(layout.responses_path(KEY)).head(3).to_dicts()
    layout.responses_path(KEY).unlink()
    journal = layout.responses_in_progress_path(KEY)
    content = b"".join(orjson.dumps(row) + b"\n" for row in rows) + b'{"sample_id": "safe-0\x00 damaged\n'
    journal.write_bytes(content)
    server.reset_stats()

    result = generate_partition(prompts(), KEY, layout, config(server.base_url, "last-turn"), log=lambda _m: None)

    assert (result.ok, result.resumed, result.requested) == (N, 3, N - 3)
    assert not journal.exists()
    (archived,) = (layout.asset_dir("synthetic_responses") / "_corrupt").iterdir()
    # as it was, with the lines this run appended after it
    assert archived.name.startswith(f"{KEY}.jsonl.") and archived.read_bytes().startswith(content)
