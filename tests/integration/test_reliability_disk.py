"""Issue 8, disk full: generation into a size-limited filesystem (a small tmpfs the test mounts; skipped where mount
is not permitted). Earlier partitions stay intact, the failure names the path and the space, and after space is
freed the partial partition resumes without losing a journaled sample."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest

from eagle3_assets.core import storage
from eagle3_assets.core.storage import DataLayout, DiskSpaceError
from eagle3_assets.generation import generate_partition
from eagle3_assets.generation.journal import read_journal
from fake_vllm import FakeConfig, FakeServerProcess
from support.reliability import key_of, make_prompts, quick_config


def _mount(point: Path, size: str) -> None:
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(point)],
        check=True,
        capture_output=True,
        text=True,
    )


class SmallFs:
    def __init__(self, point: Path) -> None:
        self.point = point

    def resize(self, size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.point)], check=True, capture_output=True)

    def fill(self) -> Path:
        """Write a ballast file until the filesystem is full."""
        ballast = self.point / "ballast"
        fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError as error:
            assert error.errno == errno.ENOSPC
        finally:
            os.close(fd)
        return ballast


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[SmallFs]:
    point = tmp_path / "small_fs"
    point.mkdir()
    try:
        _mount(point, "256k")
    except (subprocess.CalledProcessError, FileNotFoundError) as error:
        detail = getattr(error, "stderr", "") or error
        pytest.skip(f"cannot mount a size-limited tmpfs here (needs root / CAP_SYS_ADMIN): {detail}")
    try:
        yield SmallFs(point)
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False, capture_output=True)


@pytest.fixture
def server() -> Iterator[FakeServerProcess]:
    # ~1,300 tokens a response (~8 KB per journal line): 256 KiB hold about 30 of them
    with FakeServerProcess(FakeConfig(token_rate=20000, median_tokens=1300, sigma=0.2)) as running:
        yield running


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _earlier_partition(layout: DataLayout, url: str) -> str:
    """A small finished partition 00000 before the disk fills up; returns its digest."""
    result = generate_partition(
        make_prompts(3, "early"), "00000", layout, quick_config(url, max_tokens=40), log=lambda _m: None
    )
    assert result.ok == 3
    return _digest(layout.responses_path("00000"))


def test_disk_full_while_journaling_keeps_earlier_partitions_and_resumes_after_space_is_freed(
    small_fs: SmallFs, server: FakeServerProcess
) -> None:
    layout = DataLayout.at(small_fs.point / "data")
    early = _earlier_partition(layout, server.base_url)
    prompts = make_prompts(120, "full")
    key = "00001"
    with pytest.raises(OSError) as raised:
        generate_partition(prompts, key, layout, quick_config(server.base_url), log=lambda _m: None)
    assert raised.value.errno == errno.ENOSPC, raised.value
    assert _digest(layout.responses_path("00000")) == early  # the earlier partition is intact
    assert not layout.responses_path(key).exists()
    assert sorted(layout.partition_files("synthetic_responses")) == ["00000"]
    journal = layout.responses_in_progress_path(key)
    before = read_journal(journal)
    assert 5 < len(before.records) < 120 and before.corrupt_lines == 0
    assert all(record["status"] == "ok" for record in before.records.values())

    # Space is freed (here: the filesystem grows); the partition resumes from its journal.
    small_fs.resize("16m")
    server.reset_stats()
    logs: list[str] = []
    result = generate_partition(prompts, key, layout, quick_config(server.base_url), log=logs.append)
    assert (result.total, result.ok, result.resumed) == (120, 120, len(before.records))
    requested = server.stats()["requests"]
    assert not {key_of(p) for p in prompts if p.sample_id in before.records} & set(requested)
    assert len(requested) == 120 - len(before.records)
    frame = pl.read_parquet(layout.responses_path(key))
    assert frame["sample_id"].to_list() == [p.sample_id for p in prompts]
    for row in frame.filter(pl.col("sample_id").is_in(list(before.records))).iter_rows(named=True):
        assert row["finished_at"] == before.records[row["sample_id"]]["finished_at"]
    assert _digest(layout.responses_path("00000")) == early
    assert not journal.exists()


def test_disk_full_writing_the_final_parquet_names_path_and_space_and_keeps_the_journal(
    small_fs: SmallFs, server: FakeServerProcess
) -> None:
    small_fs.resize("2m")
    layout = DataLayout.at(small_fs.point / "data")
    early = _earlier_partition(layout, server.base_url)
    prompts = make_prompts(40, "final")
    key = "00001"
    ballast: list[Path] = []

    def log(message: str) -> None:
        # The engine's last line: every sample is journaled, the Parquet is about to be written. Fill the disk now.
        if "finished:" in message:
            ballast.append(small_fs.fill())

    with pytest.raises(DiskSpaceError) as raised:
        generate_partition(prompts, key, layout, quick_config(server.base_url), log=log)
    message = str(raised.value)
    assert str(layout.responses_path(key)) in message
    assert "bytes needed" in message and "free" in message
    assert not layout.responses_path(key).exists()
    assert not list(layout.asset_dir("synthetic_responses").glob(".*.tmp-*"))  # no half-written file left
    assert _digest(layout.responses_path("00000")) == early
    journaled = read_journal(layout.responses_in_progress_path(key))
    assert len(journaled.records) == 40

    ballast[0].unlink()
    server.reset_stats()
    result = generate_partition(prompts, key, layout, quick_config(server.base_url), log=lambda _m: None)
    assert (result.requested, result.resumed, result.ok) == (0, 40, 40)
    assert server.stats()["total_requests"] == 0


def test_disk_full_while_journaling_names_the_path_and_the_space(small_fs: SmallFs, server: FakeServerProcess) -> None:
    layout = DataLayout.at(small_fs.point / "data")
    with pytest.raises(OSError) as raised:
        generate_partition(
            make_prompts(120, "msg"), "00001", layout, quick_config(server.base_url), log=lambda _m: None
        )
    message = str(raised.value)
    assert isinstance(raised.value, DiskSpaceError)
    assert str(layout.responses_in_progress_path("00001")) in message and "free" in message


def test_full_disk_is_refused_before_any_request(small_fs: SmallFs, server: FakeServerProcess) -> None:
    layout = DataLayout.at(small_fs.point / "data")
    layout.asset_dir("synthetic_responses").mkdir(parents=True)
    ballast = small_fs.fill()
    try:
        with pytest.raises(DiskSpaceError, match=str(layout.asset_dir("synthetic_responses"))):
            generate_partition(
                make_prompts(20, "nospace"), "00002", layout, quick_config(server.base_url), log=lambda _m: None
            )
        assert server.stats()["total_requests"] == 0
    finally:
        ballast.unlink()


def test_parquet_writer_disk_full_is_reported_with_path_and_space(small_fs: SmallFs) -> None:
    """storage.write_parquet_atomic: polars reports ENOSPC as a ComputeError; it must still become a
    DiskSpaceError naming the path and the bytes, and leave no temporary file."""
    frame = pl.DataFrame({"text": [os.urandom(2000).hex() for _ in range(200)]})  # ~800 KB, incompressible
    target = small_fs.point / "table.parquet"
    with pytest.raises(DiskSpaceError) as raised:
        storage.write_parquet_atomic(frame, target)
    assert raised.value.errno == errno.ENOSPC
    assert str(target) in str(raised.value) and "bytes needed" in str(raised.value)
    assert list(small_fs.point.iterdir()) == []


def test_lock_on_a_full_disk_is_still_taken(small_fs: SmallFs) -> None:
    """The lock file's holder note cannot be written on a full disk; the lock must still work (flock) instead
    of failing with a bare ENOSPC."""
    lock = small_fs.point / "_locks" / "00000.lock"
    lock.parent.mkdir()
    small_fs.fill()
    with (
        storage.exclusive_lock(lock, "partition 00000"),
        pytest.raises(storage.PartitionBusyError),
        storage.exclusive_lock(lock, "partition 00000"),
    ):
        pass


# ------------------------------------------------------------------------------------- read-only disk (issue 31)


def _remount(point: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(point)], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def _read_only(point: Path) -> Iterator[None]:
    """The filesystem at ``point`` read-only for the block (as a disk the kernel remounted after errors)."""
    _remount(point, "ro")
    try:
        yield
    finally:
        _remount(point, "rw")


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): _digest(p) for p in sorted(root.rglob("*")) if p.is_file()}


def test_generation_on_a_read_only_disk_names_the_path_keeps_everything_and_resumes(
    small_fs: SmallFs, server: FakeServerProcess
) -> None:
    small_fs.resize("16m")
    layout = DataLayout.at(small_fs.point / "data")
    _earlier_partition(layout, server.base_url)
    prompts = make_prompts(20, "ro")
    key = "00001"
    first = generate_partition(prompts[:10], key, layout, quick_config(server.base_url), log=lambda _m: None)
    assert first.ok == 10
    before = _tree(layout.root)
    server.reset_stats()
    with _read_only(small_fs.point), pytest.raises(OSError) as raised:
        generate_partition(prompts, key, layout, quick_config(server.base_url), log=lambda _m: None)
    assert raised.value.errno == errno.EROFS
    assert str(layout.root) in str(raised.value) and "writable" in str(raised.value)
    assert server.stats()["total_requests"] == 0
    assert _tree(layout.root) == before  # nothing published lost or changed

    result = generate_partition(prompts, key, layout, quick_config(server.base_url), log=lambda _m: None)
    assert (result.ok, result.resumed, result.requested) == (20, 10, 10)  # writable again: it resumes


def test_a_read_only_journal_folder_fails_naming_the_journal_before_any_request(
    small_fs: SmallFs, server: FakeServerProcess, tmp_path: Path
) -> None:
    """Only the in-progress folder is read-only (a read-only bind mount over it): the lock is taken, the journal
    cannot be opened; the error names the journal and nothing is requested or lost."""
    small_fs.resize("16m")
    layout = DataLayout.at(small_fs.point / "data")
    early = _earlier_partition(layout, server.base_url)
    journal_dir = layout.responses_in_progress_path("00001").parent
    journal_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(journal_dir), str(journal_dir)], check=True, capture_output=True)
    try:
        _remount(journal_dir, "bind,ro")
        server.reset_stats()
        with pytest.raises(OSError) as raised:
            generate_partition(make_prompts(8, "rj"), "00001", layout, quick_config(server.base_url), log=print)
        assert raised.value.errno == errno.EROFS
        assert str(layout.responses_in_progress_path("00001")) in str(raised.value)
        assert server.stats()["total_requests"] == 0
        assert _digest(layout.responses_path("00000")) == early
    finally:
        subprocess.run(["umount", str(journal_dir)], check=False, capture_output=True)
    result = generate_partition(make_prompts(8, "rj"), "00001", layout, quick_config(server.base_url), log=print)
    assert (result.ok, result.requested) == (8, 8)


@pytest.mark.slow  # three extractions with the tiny verifier
def test_extraction_on_a_read_only_disk_names_the_path_keeps_the_published_states_and_resumes(
    small_fs: SmallFs,
) -> None:
    from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
    from support.hidden_states_data import cached_tiny_verifier, fabricate_responses

    small_fs.resize("64m")
    layout = DataLayout.at(small_fs.point / "data")
    verifier = cached_tiny_verifier()
    config = HiddenStatesConfig(layer_ids=[1, 2, 3], max_seq_len=96)
    fabricate_responses(layout, "00000", 12)
    first = extract_partition(layout, "00000", verifier, config)
    assert first.stored == 12
    before = _tree(layout.root)
    with _read_only(small_fs.point), pytest.raises(OSError) as raised:
        extract_partition(layout, "00000", verifier, config)
    assert raised.value.errno == errno.EROFS
    assert str(layout.root) in str(raised.value) and "writable" in str(raised.value)
    assert _tree(layout.root) == before  # the published hidden states and everything else kept

    again = extract_partition(layout, "00000", verifier, config)
    assert (again.samples, again.stored, again.samples_with_states) == (12, 0, 12)  # resumed: nothing recomputed


@pytest.mark.slow  # three extractions with the tiny verifier
def test_extraction_whose_sample_folder_turns_read_only_names_the_file_keeps_the_published_states_and_resumes(
    tmp_path: Path,
) -> None:
    """The rebuild's sample folder becomes read-only just before the forward passes (a read-only bind mount over
    it): the write error names the sample file, the published version is untouched, and once the folder is
    writable again the rebuild resumes."""
    from eagle3_assets.hidden_states import HiddenStatesConfig, extract_partition
    from eagle3_assets.hidden_states.samples import HS_SUBDIR
    from eagle3_assets.hidden_states.versions import hidden_states_staging_dir
    from support.hidden_states_data import cached_tiny_verifier, fabricate_responses

    layout = DataLayout.at(tmp_path / "data")
    verifier = cached_tiny_verifier()
    config = HiddenStatesConfig(layer_ids=[1, 2, 3], max_seq_len=96)
    fabricate_responses(layout, "00000", 8)
    extract_partition(layout, "00000", verifier, config)
    version = layout.hidden_states_dir("00000").resolve()
    published = _tree(version)
    fabricate_responses(layout, "00000", 16)  # the partition grew: a rebuild beside the published version
    sample_dir = hidden_states_staging_dir(layout, "00000") / HS_SUBDIR
    mounted: list[Path] = []

    def read_only_before_computing(message: str) -> None:
        if "to compute" in message and not mounted:
            sample_dir.mkdir(parents=True, exist_ok=True)
            try:
                subprocess.run(["mount", "--bind", str(sample_dir), str(sample_dir)], check=True, capture_output=True)
            except (subprocess.CalledProcessError, FileNotFoundError) as error:
                pytest.skip(f"cannot bind-mount here (needs root / CAP_SYS_ADMIN): {error}")
            mounted.append(sample_dir)
            _remount(sample_dir, "bind,ro")

    try:
        with pytest.raises(OSError) as raised:
            extract_partition(layout, "00000", verifier, config, log=read_only_before_computing)
    finally:
        for point in mounted:
            subprocess.run(["umount", str(point)], check=False, capture_output=True)
    assert mounted, "the extraction never reached its forward passes"
    assert raised.value.errno == errno.EROFS
    assert str(sample_dir / "hs_") in str(raised.value), raised.value  # the sample file it could not write
    assert layout.hidden_states_dir("00000").resolve() == version and _tree(version) == published

    again = extract_partition(layout, "00000", verifier, config)
    assert (again.samples, again.samples_with_states) == (16, 16)
    assert 0 < again.stored < 16  # resumed: the samples the published version had were reused
