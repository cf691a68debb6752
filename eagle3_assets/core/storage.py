"""The on-disk layout: where every asset's files live, how they are written, locked and counted.

Every file a stage writes goes through this module. Layout under the data directory::

    raw_prompts/prompts.parquet            all accepted prompts: sample_id, position, partition_key, messages
    raw_prompts/rejects.jsonl              rejected rows: line number, reason, a prefix of the raw text
    raw_prompts/manifest.json              partition size and counts of the last materialization
    synthetic_responses/{key}.parquet      one finished partition of responses
    synthetic_responses/_in_progress/{key}.jsonl   append-only log of a partition being generated
    synthetic_responses/_manifests/{key}.json      lineage: the request settings every row answers, digests
    synthetic_responses/_superseded/{key}.parquet  ok rows of earlier settings, reused if those come back
    synthetic_responses/_turns/{key}.parquet       all-turns regeneration: every regenerated turn (generation/turns.py)
    synthetic_responses/_corrupt/{name}.{time}-{pid}-{n}   a file proven corrupt (bad magic, footer), set aside
    {asset}/_lineage/{key}.json            data version, inputs and check outcomes of a partition (lineage.py)
    hidden_states/_versions/{key}/{version}/   one complete build: speculators' offline layout, index.parquet
                                           (per-sample index) and lineage.json; see publish.py
    hidden_states/{key} -> _versions/...   the partition's current version (a symlink, switched atomically)
    hidden_states/{key}.parquet            a fixed link to {key}/index.parquet
    vocab_mapping/                         vocab_mapping.safetensors (d2t and t2d, one file), token_freq.pt
    draft_model/                           checkpoints/ and final/ (speculators format)
    draft_evaluation/                      report.json and plots

Finished files are written to a temporary name and renamed, so a reader (DuckDB, a downstream asset)
never sees half a file, and ``*.parquet`` globs never match an unfinished one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_assets.core.partition_keys import KEY_PATTERN, check_partition_key

if TYPE_CHECKING:
    import polars as pl

PARTITIONED_ASSETS = ("synthetic_responses", "hidden_states")


class PartitionBusyError(RuntimeError):
    """Another process holds the lock of this partition."""


class DiskSpaceError(OSError):
    """Not enough free space for a write; names the path and the bytes needed."""


@dataclass(frozen=True)
class DataLayout:
    """Every path of the data directory. A partition key becomes a path only here, and only after
    ``check_partition_key``: a key such as ``../../x`` (Dagster accepts any string as a dynamic partition) is
    refused before anything is opened, so nothing outside the data directory is ever written for it."""

    root: Path

    @classmethod
    def at(cls, root: str | os.PathLike[str]) -> DataLayout:
        return cls(Path(root).expanduser().resolve())

    def asset_dir(self, asset: str) -> Path:
        return self.root / asset

    # raw_prompts
    @property
    def prompts_path(self) -> Path:
        return self.asset_dir("raw_prompts") / "prompts.parquet"

    @property
    def rejects_path(self) -> Path:
        return self.asset_dir("raw_prompts") / "rejects.jsonl"

    @property
    def prompts_manifest_path(self) -> Path:
        return self.asset_dir("raw_prompts") / "manifest.json"

    # synthetic_responses
    def responses_path(self, partition_key: str) -> Path:
        return self.asset_dir("synthetic_responses") / f"{check_partition_key(partition_key)}.parquet"

    @property
    def responses_in_progress_dir(self) -> Path:
        return self.asset_dir("synthetic_responses") / "_in_progress"

    def responses_in_progress_path(self, partition_key: str) -> Path:
        return self.responses_in_progress_dir / f"{check_partition_key(partition_key)}.jsonl"

    def responses_manifest_path(self, partition_key: str) -> Path:
        return self.asset_dir("synthetic_responses") / "_manifests" / f"{check_partition_key(partition_key)}.json"

    def responses_turns_path(self, partition_key: str) -> Path:
        """The all-turns store: every regenerated turn of the partition's conversations (generation/turns.py)."""
        return self.asset_dir("synthetic_responses") / "_turns" / f"{check_partition_key(partition_key)}.parquet"

    @property
    def responses_corrupt_dir(self) -> Path:
        """Files of synthetic_responses proven corrupt, kept under a timestamped name, never overwritten."""
        return self.asset_dir("synthetic_responses") / "_corrupt"

    def responses_superseded_path(self, partition_key: str) -> Path:
        return self.asset_dir("synthetic_responses") / "_superseded" / f"{check_partition_key(partition_key)}.parquet"

    def lineage_path(self, asset: str, partition_key: str) -> Path:
        if asset == "hidden_states":  # inside the published version: it switches with the folder (publish.py)
            return self.hidden_states_dir(partition_key) / "lineage.json"
        return self.asset_dir(asset) / "_lineage" / f"{check_partition_key(partition_key)}.json"

    # hidden_states
    def hidden_states_index_path(self, partition_key: str) -> Path:
        """A fixed link to ``{key}/index.parquet``: it follows the partition's pointer (publish.py)."""
        return self.asset_dir("hidden_states") / f"{check_partition_key(partition_key)}.parquet"

    def hidden_states_dir(self, partition_key: str) -> Path:
        """The partition's pointer: a symlink to its current version under ``_versions/{key}/`` (publish.py)."""
        return self.asset_dir("hidden_states") / check_partition_key(partition_key)

    # unpartitioned downstream assets
    @property
    def vocab_mapping_dir(self) -> Path:
        return self.asset_dir("vocab_mapping")

    @property
    def draft_model_dir(self) -> Path:
        return self.asset_dir("draft_model")

    @property
    def evaluation_dir(self) -> Path:
        return self.asset_dir("draft_evaluation")

    def lock_path(self, asset: str, partition_key: str | None = None) -> Path:
        name = check_partition_key(partition_key) if partition_key is not None else "_asset"
        return self.asset_dir(asset) / "_locks" / f"{name}.lock"

    def partition_files(self, asset: str) -> dict[str, Path]:
        """Finished partition files of a partitioned asset, by partition key."""
        folder = self.asset_dir(asset)
        if not folder.is_dir():
            return {}
        return {p.stem: p for p in sorted(folder.glob("*.parquet")) if KEY_PATTERN.fullmatch(p.stem)}

    def in_progress_partitions(self) -> dict[str, Path]:
        """Journals of ``synthetic_responses`` partitions being (or left half) generated, by partition key."""
        folder = self.responses_in_progress_dir
        if not folder.is_dir():
            return {}
        return {p.stem: p for p in sorted(folder.glob("*.jsonl")) if KEY_PATTERN.fullmatch(p.stem)}

    def generated_partitions(self) -> list[str]:
        """Keys that hold generated work in any form: a finished file of a partitioned asset or a journal.

        Anything keyed by partition must be kept where it is: re-partitioning would give these keys other samples.
        """
        keys = set(self.in_progress_partitions())
        for asset in PARTITIONED_ASSETS:
            keys |= set(self.partition_files(asset))
        return sorted(keys)


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_tree(folder: Path, files_synced_in: Collection[str] = ()) -> None:
    """fsync every file under ``folder`` and every folder in it, deepest first, then ``folder``: what a rename is
    about to make visible (a published version, a saved draft) is durable before it can be seen.

    ``files_synced_in``: subfolders (relative to ``folder``) whose files were each written through
    :func:`atomic_path`, so already durable: their folders are still synced (a hard link made into one is a new entry),
    their files are not (an fsync of a clean file is still a disk cache flush, ~2 ms: minutes for 100k samples)."""
    skipped = {os.path.join(str(folder), name) for name in files_synced_in}
    for dirpath, _dirnames, filenames in os.walk(folder, topdown=False):
        for name in filenames if dirpath not in skipped else ():
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def _temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def pid_alive(pid: int, send: Callable[[int, int], None] = os.kill) -> bool:
    """Whether signal 0 reaches ``pid``: a process, or with ``send=os.killpg`` a process group (one another user
    owns exists too)."""
    try:
        send(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# A writer's temporary entry: ``.{name}.tmp-{pid}`` (atomic_path, or a folder renamed into place whole) or
# ``.{name}.old-{pid}`` (the previous version moved aside while a folder is replaced).
_TEMP_ENTRY = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)$")


def remove_dead_writers_temps(folder: Path, names: Collection[str] | None = None) -> list[Path]:
    """Remove the temporary files and folders in ``folder`` left by writers that were killed mid-write (their pid
    is gone), of the targets ``names`` (None: of any target). Returns what was removed.

    A killed writer's temporary entry is never renamed into place, so without this sweep every kill leaks a file or
    folder the size of what was being written. A live writer's entry is kept (another process may be writing it),
    and so is this process's own (its writer cleans up after itself); a reused pid only keeps a stale entry longer.
    """
    removed: list[Path] = []
    try:
        entries = list(folder.iterdir())
    except OSError:  # no folder yet: nothing was ever written there
        return removed
    for entry in entries:
        match = _TEMP_ENTRY.match(entry.name)
        if match is None or (names is not None and match["name"] not in names):
            continue
        pid = int(match["pid"])
        if pid == os.getpid() or pid_alive(pid):
            continue
        with contextlib.suppress(OSError):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
    return removed


def replace_dir_atomic(tmp: Path, target: Path) -> None:
    """Put the finished folder ``tmp`` (next to ``target``, e.g. ``.NAME.tmp-PID``) in place at ``target``,
    replacing the previous ``target`` if any.

    A folder cannot be renamed over a non-empty one, and removing the old one first would leave a half-removed
    folder at ``target`` when killed (or nothing at all while the new one is still only a temporary). So the old
    one is renamed aside to ``.NAME.old-PID``, the new one renamed into place, and only then is the old one
    removed: ``target`` is always the whole old folder or the whole new one (absent only between the two renames).
    A kill leaves ``.NAME.tmp-PID`` / ``.NAME.old-PID``, which `remove_dead_writers_temps` sweeps on the next run.
    If the second rename fails, the old folder is put back.
    """
    fsync_tree(tmp)  # durable before visible: the rename below must never expose a folder of unsynced files
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    moved_aside = False
    if target.exists() or target.is_symlink():
        os.replace(target, old)
        moved_aside = True
    try:
        os.replace(tmp, target)
    except BaseException:
        if moved_aside and not target.exists():
            with contextlib.suppress(OSError):
                os.replace(old, target)
        raise
    fsync_dir(target.parent)
    if moved_aside:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def archive_corrupt(path: Path, archive_dir: Path, why: str, log: Callable[[str], None], consequence: str) -> Path:
    """Move a file proven corrupt to ``archive_dir`` under a timestamped name (never over another file), and say so
    through ``log`` with ``why`` and its ``consequence``. Only a file whose bytes prove it corrupt comes here: a file
    that could not be read (EIO, EACCES, ...) is not corrupt, and its reader fails naming it instead."""
    archive_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for attempt in itertools.count():
        target = archive_dir / f"{path.name}.{stamp}-{os.getpid()}-{attempt}"
        try:
            os.link(path, target)  # fails when the name exists: an earlier archive is never replaced
        except FileExistsError:
            continue
        break
    fsync_dir(archive_dir)
    path.unlink()
    fsync_dir(path.parent)
    log(f"{path} is corrupt ({why}); moved to {target}, {consequence}")
    return target


def read_error_keeping(error: OSError, path: Path, what: str, remedy: str) -> OSError:
    """The error to raise when reading ``what`` at ``path`` failed with ``error`` (EIO, EACCES, ESTALE, ENOSPC, ...):
    same type and errno, naming the file and saying it was kept. A read error is never corruption: a disk, mount or
    permission problem must not turn into setting the file aside or computing its contents again."""
    return type(error)(error.errno, f"cannot read {what} {path} ({error.strerror or error}); {remedy}", str(path))


# Writers that wrap the OS error in their own exception (polars raises ComputeError "... No space left on device
# (os error 28)") are recognized by the message.
_DISK_FULL_TEXT = ("os error 28)", "os error 122)", "No space left on device", "Disk quota exceeded")


def _is_disk_full(error: BaseException) -> bool:
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    return any(text in str(error) for text in _DISK_FULL_TEXT)


def _raise_if_disk_full(error: BaseException, path: Path, needed_bytes: int | None) -> None:
    if _is_disk_full(error) and not isinstance(error, DiskSpaceError):
        need = f" (about {needed_bytes:,} bytes needed)" if needed_bytes else ""
        code = error.errno if isinstance(error, OSError) and error.errno else errno.ENOSPC
        raise DiskSpaceError(code, f"no space left writing {path}{need}; free {free_bytes(path):,} bytes") from error


@contextlib.contextmanager
def atomic_path(path: Path, needed_bytes: int | None = None) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success fsync it and rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_path(path)
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except Exception as error:
        tmp.unlink(missing_ok=True)
        _raise_if_disk_full(error, path, needed_bytes)
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_parquet_atomic(frame: pl.DataFrame, path: Path) -> None:
    # Once per partition file, so the directory scan is cheap (not in atomic_path: per-sample files use that).
    remove_dead_writers_temps(path.parent, {path.name})
    with atomic_path(path, needed_bytes=int(frame.estimated_size())) as tmp:
        frame.write_parquet(tmp, compression="zstd", statistics=True)


def write_bytes_atomic(data: bytes, path: Path) -> None:
    with atomic_path(path, needed_bytes=len(data)) as tmp:
        tmp.write_bytes(data)


def write_json_atomic(obj: Any, path: Path) -> None:
    write_bytes_atomic(json.dumps(obj, indent=2, sort_keys=True).encode(), path)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def free_bytes(path: Path) -> int:
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def ensure_free_space(path: Path, needed_bytes: int, what: str, headroom: float = 1.1) -> None:
    """Fail before expensive work starts when ``path``'s filesystem cannot hold ``needed_bytes``."""
    free = free_bytes(path)
    if free < needed_bytes * headroom:
        raise DiskSpaceError(
            errno.ENOSPC,
            f"{what} needs about {needed_bytes:,} bytes at {path} but only {free:,} bytes are free",
        )


@contextlib.contextmanager
def exclusive_lock(lock_path: Path, what: str) -> Iterator[None]:
    """A per-partition writer lock (flock: released by the kernel when the holder dies, even on SIGKILL).

    A second writer fails at once with a message instead of interleaving lines in the same file.
    """
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:  # same type and errno (a full disk stays a full disk), with the file and the remedy
        raise type(error)(
            error.errno,
            f"cannot create the lock file of {what} ({error.strerror}); the data directory must be writable: "
            "fix its permissions or mount, or set EAGLE3_DATA_DIR to a writable folder",
            str(lock_path),
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            raise PartitionBusyError(
                f"{what} is being written by {holder}; wait for that run to finish or stop it (lock: {lock_path})"
            ) from None
        # Who holds the lock, for the message of a refused second writer. Best effort: on a full disk the write
        # fails, and the lock (held by the kernel, not by the file's content) is still good.
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode(), 0)
        yield
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------- counts


def _duckdb_glob(folder: Path) -> str:
    return str(folder / "*.parquet").replace("'", "''")


class UnreadablePartitionError(ValueError):
    """A partition file is not readable Parquet; the message names each such file."""


def footer_row_counts(files: dict[str, Path]) -> tuple[dict[str, int], dict[str, str]]:
    """Rows per partition file from its Parquet footer (no data scan), file by file so one broken file does
    not hide the rest. Returns (rows by partition key, error by partition key for unreadable files)."""
    # lazy: loads duckdb (heavy), which only this path needs
    import duckdb

    rows: dict[str, int] = {}
    errors: dict[str, str] = {}
    with duckdb.connect() as con:
        for key, path in files.items():
            quoted = str(path).replace("'", "''")
            try:
                found = con.execute(f"SELECT sum(num_rows) FROM parquet_file_metadata('{quoted}')").fetchone()
            except duckdb.Error as error:
                errors[key] = (str(error).strip().splitlines() or ["unreadable"])[0][:200]
                continue
            rows[key] = int(found[0] or 0) if found else 0
    return rows, errors


def partition_row_counts(layout: DataLayout) -> dict[str, dict[str, int]]:
    """Rows per partition file for every partitioned asset; raises UnreadablePartitionError naming bad files."""
    counts: dict[str, dict[str, int]] = {}
    for asset in PARTITIONED_ASSETS:
        files = layout.partition_files(asset)
        if not files:
            continue
        rows, errors = footer_row_counts(files)
        if errors:
            raise UnreadablePartitionError("; ".join(f"{files[key]}: {error}" for key, error in sorted(errors.items())))
        counts[asset] = rows
    return counts


def response_status_counts(layout: DataLayout) -> dict[str, dict[str, int]]:
    """Per-partition ok/failed/truncated and token sums of ``synthetic_responses`` (reads 4 small columns)."""
    # lazy: loads duckdb (heavy), which only this path needs
    import duckdb

    if not layout.partition_files("synthetic_responses"):
        return {}
    sql = f"""
        SELECT regexp_extract(filename, '([0-9]+)\\.parquet$', 1) AS partition_key,
               count(*) AS rows,
               count(*) FILTER (WHERE status = 'ok') AS ok,
               count(*) FILTER (WHERE status = 'failed') AS failed,
               count(*) FILTER (WHERE finish_reason = 'length') AS truncated,
               coalesce(sum(prompt_tokens), 0) AS prompt_tokens,
               coalesce(sum(completion_tokens), 0) AS completion_tokens
        FROM read_parquet('{_duckdb_glob(layout.asset_dir("synthetic_responses"))}', filename = true)
        GROUP BY 1 ORDER BY 1
    """
    with duckdb.connect() as con:
        cursor = con.execute(sql)
        names = [d[0] for d in cursor.description]
        return {row[0]: dict(zip(names[1:], map(int, row[1:]), strict=True)) for row in cursor.fetchall()}
