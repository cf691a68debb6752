"""Publishing a rebuilt ``hidden_states`` partition with one atomic switch, and pinning what a reader reads.

Layout under ``hidden_states/`` (Dagster-free)::

    _versions/{key}/{version}/   one complete build: speculators' offline layout plus ``index.parquet`` and
                                 ``lineage.json`` (written last: a version holding both is complete)
    {key}  -> _versions/{key}/{version}    the pointer: a relative symlink, the partition's current version
    {key}.parquet -> {key}/index.parquet   a fixed link, so the index switches with the pointer
    _versions/{key}/_staging/    the build in progress (lineage.py ``begin_hidden_states``), beside the versions
                                 so that publishing it is a rename within one filesystem

Publishing renames the finished staging folder to a new version and then replaces the pointer with ``os.replace``
of a symlink: a reader sees the whole old version or the whole new one, its index and lineage included, and the
old version stays readable up to that one rename (and after it, for a reader that pinned it). A kill at any point
leaves either the old pointer (the new version an orphan, swept later) or the new one.

Recovery (:func:`recover`, run before every publish and by ``eagle3 status`` / ``backfill --missing``): a missing
or dangling pointer beside a complete version is pointed at the newest complete version (restored, never
deleted); a partition folder of the earlier layout (a real folder, or the ``.{key}.old-PID`` folder an earlier
swap left when killed between its two renames) is moved into ``_versions`` first. Leftovers (other versions,
``.{key}.old-PID`` folders) are swept only when the current version is complete, and a version a reader pinned
(a shared ``flock`` on its ``_pin.lock``, held by training while it reads) is never removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import time
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path

from eagle3_assets.core.partition_keys import KEY_PATTERN, check_partition_key
from eagle3_assets.core.storage import (
    DataLayout,
    PartitionBusyError,
    exclusive_lock,
    fsync_dir,
    fsync_tree,
    pid_alive,
    remove_dead_writers_temps,
)

logger = logging.getLogger(__name__)

ASSET = "hidden_states"
VERSIONS_DIR = "_versions"
INDEX_FILE = "index.parquet"
LINEAGE_FILE = "lineage.json"
PIN_FILE = "_pin.lock"
# files of a version that belong to that version only (never hard-linked into the next build)
VERSION_OWN_FILES = (INDEX_FILE, LINEAGE_FILE, PIN_FILE)
STAGING_NAME = "_staging"  # the build in progress, inside _versions/{key}/: same filesystem as the versions
_VERSION_NAME = re.compile(r"^v(?P<ns>\d+)-(?P<pid>\d+)$")
_OLD_FOLDER = re.compile(r"^\.(?P<key>\d{5,})\.old-(?P<pid>\d+)$")


class PublishError(RuntimeError):
    """A partition cannot be published or pinned; the message names the folder and the remedy."""


def versions_dir(layout: DataLayout, key: str) -> Path:
    return layout.asset_dir(ASSET) / VERSIONS_DIR / check_partition_key(key)


def staging_dir(layout: DataLayout, key: str) -> Path:
    """Where a rebuild of ``key`` is made: beside the versions it becomes one of, so publishing it is a rename
    within one folder even when ``_versions`` (or one key's folder in it) is a link to another disk."""
    return versions_dir(layout, key) / STAGING_NAME


def is_complete(folder: Path) -> bool:
    """A build holding its index and lineage (both written last, atomically)."""
    return (folder / INDEX_FILE).is_file() and (folder / LINEAGE_FILE).is_file()


def _pointed_version_name(layout: DataLayout, key: str) -> str | None:
    """The name of the version the pointer names, read from the link's own text (``_versions/{key}/{name}``).

    "Current" is a name, never a path compared with another path: when ``hidden_states``, ``_versions`` or the data
    directory is a symlink or a bind mount, a resolved path and an unresolved one name the same folder differently,
    and a sweep that compared them deleted the published version. A pointer edited by hand to another spelling of a
    folder in ``_versions/{key}`` (an absolute path, through another link) is matched by the folder's identity."""
    pointer = layout.hidden_states_dir(key)
    try:
        text = os.readlink(pointer)
    except OSError:
        return None
    parts = Path(text).parts
    if len(parts) == 3 and parts[:2] == (VERSIONS_DIR, key) and parts[2] not in {".", ".."}:
        return parts[2]
    target = pointer.parent / text
    with contextlib.suppress(OSError):
        if os.path.samefile(target.parent, versions_dir(layout, key)):
            return target.name
    return None


def current_version(layout: DataLayout, key: str) -> Path | None:
    """The version folder the pointer names when it is complete (as ``_versions/{key}/{name}`` under the data
    directory); a pointer to a complete folder elsewhere, that folder; a folder of the earlier layout itself;
    else None."""
    pointer = layout.hidden_states_dir(key)
    if pointer.is_symlink():
        name = _pointed_version_name(layout, key)
        target = versions_dir(layout, key) / name if name is not None else pointer.resolve()
        return target if is_complete(target) else None
    return pointer if pointer.is_dir() else None


def known_keys(layout: DataLayout) -> list[str]:
    """Every key with a pointer, a version, or a folder of an interrupted swap."""
    root = layout.asset_dir(ASSET)
    keys: set[str] = set()
    with contextlib.suppress(OSError):
        for entry in root.iterdir():
            old = _OLD_FOLDER.match(entry.name)
            if KEY_PATTERN.fullmatch(entry.name) or old:
                keys.add(old["key"] if old else entry.name)
    with contextlib.suppress(OSError):
        keys |= {p.name for p in (root / VERSIONS_DIR).iterdir() if KEY_PATTERN.fullmatch(p.name)}
    return sorted(keys)


def _relative(target: Path, start: Path) -> str:
    return os.path.relpath(target, start)


def _point(layout: DataLayout, key: str, version: Path) -> None:
    """THE switch: a symlink made aside and renamed over the pointer (atomic; the old target stays readable)."""
    pointer = layout.hidden_states_dir(key)
    tmp = pointer.with_name(f".{key}.tmp-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.symlink(_relative(version, pointer.parent), tmp)
    os.replace(tmp, pointer)
    fsync_dir(pointer.parent)


def _ensure_index_link(layout: DataLayout, key: str) -> None:
    """``{key}.parquet`` -> ``{key}/index.parquet``: made once; it follows the pointer from then on."""
    link = layout.hidden_states_index_path(key)
    wanted = f"{key}/{INDEX_FILE}"
    if link.is_symlink() and os.readlink(link) == wanted:
        return
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.symlink(wanted, tmp)
    os.replace(tmp, link)
    fsync_dir(link.parent)


def _new_version_name() -> str:
    return f"v{time.time_ns()}-{os.getpid()}"


def _adopt_legacy(layout: DataLayout, key: str, folder: Path) -> Path:
    """Move a partition folder of the earlier layout (index beside it, lineage under ``_lineage/``) into
    ``_versions`` as a complete version; each step is a rename, so a kill anywhere is finished by the next call."""
    index = layout.hidden_states_index_path(key)
    if index.is_file() and not index.is_symlink() and not (folder / INDEX_FILE).exists():
        os.link(index, folder / INDEX_FILE)  # the old name stays valid until the pointer replaces it
    old_lineage = layout.asset_dir(ASSET) / "_lineage" / f"{key}.json"
    if old_lineage.is_file() and not (folder / LINEAGE_FILE).exists():
        os.replace(old_lineage, folder / LINEAGE_FILE)
    if not (folder / LINEAGE_FILE).exists():
        (folder / LINEAGE_FILE).write_text("{}")  # no record: complete on disk, but never counted as checked
    target = versions_dir(layout, key) / _new_version_name()
    target.parent.mkdir(parents=True, exist_ok=True)
    os.rename(folder, target)
    fsync_dir(folder.parent)
    return target


def recover(layout: DataLayout, key: str) -> list[str]:
    """Finish what a kill interrupted (the caller holds the partition lock); returns what was done, for logs."""
    done: list[str] = []
    root = layout.asset_dir(ASSET)
    pointer = layout.hidden_states_dir(key)
    done += _move_earlier_staging(layout, key)
    if pointer.is_dir() and not pointer.is_symlink():
        _point(layout, key, _adopt_legacy(layout, key, pointer))
        done.append(f"moved the folder of the earlier layout into {VERSIONS_DIR}")
    if current_version(layout, key) is None:
        olds = sorted(p for p in root.glob(f".{key}.old-*") if p.is_dir() and not pid_alive(_pid(p)))
        candidates = _complete_versions(layout, key)
        if not candidates and olds:  # the earlier swap's old folder: restored, never deleted
            candidates = [_adopt_legacy(layout, key, olds[-1])]
        if candidates:
            _point(layout, key, candidates[-1])
            done.append(f"restored the pointer to {candidates[-1].name}")
    if current_version(layout, key) is not None:
        _ensure_index_link(layout, key)
        done += sweep(layout, key)
    return done


def _move_earlier_staging(layout: DataLayout, key: str) -> list[str]:
    """A build in progress at the earlier place (``hidden_states/_staging/{key}``) moves beside the versions, so its
    finished samples resume; where it cannot (another filesystem), it is left where it is, never deleted."""
    earlier = layout.asset_dir(ASSET) / STAGING_NAME / key
    staging = staging_dir(layout, key)
    if not earlier.is_dir() or earlier.is_symlink() or staging.exists():
        return []
    staging.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(earlier, staging)
    except OSError as error:
        logger.warning("hidden_states %s: the earlier build in progress %s stays where it is (%s)", key, earlier, error)
        return []
    fsync_dir(staging.parent)
    return [f"moved the build in progress from {earlier} to {staging}"]


def _pid(path: Path) -> int:
    match = _OLD_FOLDER.match(path.name)
    return int(match["pid"]) if match else os.getpid()


def _versions(layout: DataLayout, key: str) -> list[Path]:
    """The version folders of ``key`` (named ``v{ns}-{pid}``), oldest first; never the staging build."""
    folder = versions_dir(layout, key)
    try:
        entries = list(folder.iterdir())
    except OSError:
        return []
    found = [(int(m["ns"]), p) for p in entries if (m := _VERSION_NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def _complete_versions(layout: DataLayout, key: str) -> list[Path]:
    """Complete versions of ``key``, oldest first (names sort by creation time)."""
    return [p for p in _versions(layout, key) if is_complete(p)]


def sweep(layout: DataLayout, key: str) -> list[str]:
    """Remove versions other than the current one that no reader pins, and dead swaps' ``.{key}.old-PID`` folders;
    only while the current version is complete (otherwise nothing is deleted)."""
    current = current_version(layout, key)
    name = _pointed_version_name(layout, key)
    if current is None or name is None:  # nothing complete, or a pointer to a folder outside _versions: keep all
        return []
    removed: list[str] = []
    for version in _versions(layout, key):
        if version.name == name or _same_folder(version, current):
            continue
        if _remove_unless_pinned(version):
            removed.append(f"removed version {version.name}")
    # a killed switch's ``.{key}.tmp-PID`` link, an earlier swap's ``.{key}.old-PID`` folder (dead writers only)
    swept = remove_dead_writers_temps(layout.asset_dir(ASSET), {key, f"{key}.parquet"})
    return removed + [f"removed {p.name}" for p in swept]


def _same_folder(a: Path, b: Path) -> bool:
    """Whether two paths are one folder (a second guard beside the name: a sweep never deletes what is current)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return True  # unknown: treated as the same, so it is kept


def _remove_unless_pinned(version: Path) -> bool:
    try:
        fd = os.open(version / PIN_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a reader (training) pins it
        shutil.rmtree(version, ignore_errors=True)  # under the lock: a late pinner finds the folder gone
        return True
    finally:
        os.close(fd)


def publish(
    layout: DataLayout,
    key: str,
    staging: Path,
    build_marker: str | None = None,
    files_synced_in: Collection[str] = (),
) -> Path:
    """Make the complete build ``staging`` the partition's current version (the caller holds the partition lock).

    ``build_marker``: the file that marks ``staging`` as a build in progress (its resume key); it is removed from the
    version only after the rename, so a kill anywhere before leaves a build that resumes, not one redone whole.
    ``files_synced_in``: the build's subfolders whose files were each synced when written (``storage.fsync_tree``)."""
    if not is_complete(staging):
        raise PublishError(f"{staging} is not a complete build (no {INDEX_FILE} or {LINEAGE_FILE}); not published")
    for line in recover(layout, key):
        logger.info("hidden_states %s: %s", key, line)
    fsync_tree(staging, files_synced_in)  # every file durable before the switch makes it visible
    version = versions_dir(layout, key) / _new_version_name()
    version.parent.mkdir(parents=True, exist_ok=True)
    os.rename(staging, version)
    fsync_dir(version.parent)
    if build_marker is not None:
        (version / build_marker).unlink(missing_ok=True)
    _point(layout, key, version)
    _ensure_index_link(layout, key)
    sweep(layout, key)
    return layout.hidden_states_dir(key)


def recover_idle(layout: DataLayout, keys: Iterable[str] | None = None) -> dict[str, list[str]]:
    """:func:`recover` for every partition no run is writing (its lock is free); busy ones are left alone."""
    done: dict[str, list[str]] = {}
    on_disk = known_keys(layout)  # never a lock file (or folder) made for a partition with nothing on disk
    for key in on_disk if keys is None else [k for k in keys if k in set(on_disk)]:
        try:
            with exclusive_lock(layout.lock_path(ASSET, key), f"{ASSET} partition {key}"):
                actions = recover(layout, key)
        except (PartitionBusyError, OSError) as error:
            logger.debug("hidden_states %s: not recovered now: %s", key, error)
            continue
        if actions:
            done[key] = actions
    return done


# ------------------------------------------------------------------------------------------------ pinning


def _pin_one(layout: DataLayout, key: str, want: Path | None, stack: contextlib.ExitStack) -> Path:
    pointer = layout.hidden_states_dir(key)
    for _ in range(50):
        version = want or current_version(layout, key)
        if version is None:
            raise PublishError(
                f"hidden_states partition {key} has no complete published version at {pointer}: "
                "materialize hidden_states for it (or run `eagle3 status`, which restores an interrupted publish)"
            )
        if version == pointer:  # a folder of the earlier layout: readable, not pinnable (moved on its next publish)
            return pointer
        try:
            fd = os.open(version / PIN_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            fd = -1
        if fd >= 0:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a sweeper holds it to delete the folder
            if is_complete(version):
                stack.callback(os.close, fd)
                return version
            os.close(fd)
        if want is not None:
            raise PublishError(f"hidden_states partition {key}: version {version} is gone (swept); start over")
    raise PublishError(f"hidden_states partition {key}: its version kept changing while being pinned; retry")


@contextlib.contextmanager
def pinned(
    layout: DataLayout, keys: Iterable[str], versions: Mapping[str, str] | None = None
) -> Iterator[dict[str, Path]]:
    """Pin the current version of each partition (or the given version folders) for as long as the block runs:
    returns key -> version folder; no publish or sweep removes or changes a pinned version (a shared flock)."""
    with contextlib.ExitStack() as stack:
        dirs = {
            key: _pin_one(layout, key, Path(versions[key]) if versions and key in versions else None, stack)
            for key in keys
        }
        yield dirs
