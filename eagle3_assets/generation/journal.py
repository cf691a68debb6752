"""The append-only in-progress journal of a partition: one JSON line per finished sample.

Each finished sample (``ok`` or terminally ``failed``) is written as one line with a single ``write``
on an ``O_APPEND`` descriptor, so it is in the kernel's page cache (safe from a killed process) at once;
``fsync`` runs at least every ``fsync_interval_s`` so a power loss costs seconds of work, not a partition.

A process killed mid-write can leave a torn last line. :func:`read_journal` drops it and
:meth:`Journal.open` cuts it off before appending, so the next line never glues onto a fragment.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from eagle3_assets.core import storage
from eagle3_assets.generation.records import STATUS_OK

_loads = orjson.loads


def _dumps(record: Mapping[str, Any]) -> bytes:
    return orjson.dumps(record)


@dataclass
class JournalContents:
    records: dict[str, dict[str, Any]] = field(default_factory=dict)  # sample_id -> winning record
    lines: int = 0
    torn_bytes: int = 0  # bytes of a torn last line that were dropped
    corrupt_lines: int = 0  # complete lines that did not parse (should not happen; counted, skipped)
    valid_size: int = 0  # file offset just after the last complete line
    # sample_id -> the latest record that answers another request than the current one (``current`` refused it)
    stale: dict[str, dict[str, Any]] = field(default_factory=dict)


def _better(new: Mapping[str, Any], old: Mapping[str, Any] | None) -> bool:
    # An ok record is never replaced by a failed one; otherwise the later line wins.
    if old is None:
        return True
    return not (old.get("status") == STATUS_OK and new.get("status") != STATUS_OK)


def read_journal(path: Path, current: Callable[[Mapping[str, Any]], bool] | None = None) -> JournalContents:
    """The winning record per sample. With ``current``, a record it refuses (another prompt or other settings,
    see ``generation/fingerprint.py``) never wins: it is kept aside in ``stale``, so an ok answer to an old
    request cannot shadow a failed attempt at the current one."""
    contents = JournalContents()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return contents
    end = data.rfind(b"\n") + 1
    contents.valid_size = end
    contents.torn_bytes = len(data) - end
    for line in data[:end].splitlines():
        if not line.strip():
            continue
        contents.lines += 1
        try:
            record = _loads(line)
            sample_id = record["sample_id"]
        except (ValueError, KeyError, TypeError):
            contents.corrupt_lines += 1
            continue
        if current is not None and not current(record):
            # the same rule: a later failed attempt at another request never hides an ok answer to be kept aside
            if _better(record, contents.stale.get(sample_id)):
                contents.stale[sample_id] = record
            continue
        if _better(record, contents.records.get(sample_id)):
            contents.records[sample_id] = record
    return contents


def merge_records(*sources: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Merge record maps given oldest first, with the same ok-wins-then-latest rule as the journal."""
    merged: dict[str, dict[str, Any]] = {}
    for source in sources:
        for sample_id, record in source.items():
            if _better(record, merged.get(sample_id)):
                merged[sample_id] = dict(record)
    return merged


class Journal:
    """An open journal for appending. Not thread-safe; the engine appends from its event loop only."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd
        self.appended = 0
        self._dirty = False
        self._size = os.fstat(fd).st_size  # end of the last complete line (we hold the partition's lock)

    @classmethod
    def open(cls, path: Path, valid_size: int | None = None) -> Journal:
        """Open for appending; if ``valid_size`` is given, first cut the file to it (drops a torn line)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if valid_size is not None and os.fstat(fd).st_size > valid_size:
            os.ftruncate(fd, valid_size)
            os.fsync(fd)
        return cls(path, fd)

    def append(self, record: Mapping[str, Any]) -> None:
        line = _dumps(record) + b"\n"
        try:
            written = os.write(self._fd, line)
            while written < len(line):  # a regular file writes fully unless the disk is full; be exact anyway
                written += os.write(self._fd, line[written:])
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                # a bare "[Errno 30] Read-only file system" (a disk remounted after errors) or EIO names no file
                raise type(error)(
                    error.errno,
                    f"cannot append to the journal {self.path} ({error.strerror}); the samples journaled so far are "
                    "kept and resumed: fix the disk or mount and run again",
                    str(self.path),
                ) from error
            # Cut a partly written line off again so the journal ends on a complete line, then say where and
            # how much: a bare "[Errno 28] No space left on device" names neither.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            free = storage.free_bytes(self.path)
            raise storage.DiskSpaceError(
                error.errno,
                f"disk full while journaling to {self.path}: a {len(line):,}-byte line did not fit, "
                f"{free:,} bytes free; free space and run again (journaled samples are kept and resumed)",
            ) from error
        self._size += len(line)
        self.appended += 1
        self._dirty = True

    def sync(self) -> None:
        """fsync if anything was appended since the last sync (safe to call from a worker thread)."""
        if self._dirty and self._fd >= 0:
            self._dirty = False
            try:
                os.fsync(self._fd)
            except OSError as error:  # EIO from a failing disk: say which file, as append does
                raise type(error)(
                    error.errno, f"cannot fsync the journal {self.path} ({error.strerror})", str(self.path)
                ) from error

    def close(self) -> None:
        if self._fd >= 0:
            self.sync()
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
