"""The files a hidden-states connector writes, read from this process's side (Dagster-free, no network).

Each extraction request's answer is one ``*.safetensors`` file in the connector's ``shared_storage_path``, written
under an exclusive ``flock`` on ``{file}.lock``. This module names the file a reply points at (only its name: a reply
never points outside the storage root), waits for the writer's lock (bounded, naming the holder), reads and checks the
file (regular files only, never through a link), and sweeps what killed clients left. The errors it raises are the
backend's errors (:class:`ExtractionError`, and :class:`LocalStorageError` for this machine's own faults).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import threading
import time
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The name every file of this project's connector starts with (local/vllm_plugins/eagle3_hs_connector.py spells it
# too: that module runs in the vLLM server and imports nothing from here). The sweep touches nothing else.
CONNECTOR_FILE_PREFIX = "eagle3-hs-"


class ExtractionError(RuntimeError):
    """An extraction server answered with something unusable (wrong token ids, shape, NaN) or kept failing.

    ``sample_index``: the failing sample's position in the batch given to ``extract`` (the caller names the sample).
    """

    def __init__(self, message: str, sample_index: int | None = None) -> None:
        super().__init__(message)
        self.sample_index = sample_index


class ExtractionStopped(ExtractionError):
    """The run cannot go on: the servers refuse the key, all stayed down past the budget, or the embedded one died."""


class LocalStorageError(ExtractionStopped):
    """This machine's side failed (the transfer folder not readable or writable, ...): no server is to blame, and no
    retry or other server would help, so the run stops at once naming the path."""


def local_file(server_path: str, storage_root: str | Path) -> Path:
    """The connector's file under this process's storage root (the shared volume's local mount).

    Only the file NAME of the reply's path is used, so no reply can point outside the root (``../``, ``/etc/...``);
    a name that is not a ``*.safetensors`` file name is refused.
    """
    name = PurePosixPath(str(server_path)).name
    if not name.endswith(".safetensors") or name.startswith(".") or name != Path(name).name:
        raise ExtractionError(f"the server named {str(server_path)[:200]!r}, not a connector file (*.safetensors)")
    return Path(storage_root) / name


def _open_regular(path: Path) -> int | None:
    """A descriptor of ``path`` if it is a regular file (never through a symbolic link, never blocking on a FIFO);
    None if it does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ExtractionError(f"{path} is a symbolic link; refused (only regular files are read)") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ExtractionError(f"{path} is not a regular file; refused")
    return fd


LOCK_POLL_S = 0.05  # how often a wait for the connector's write lock looks again (and at a stop request)


def lock_holders(fd: int) -> list[str]:
    """Who holds a lock on the file open as ``fd``: ``pid N (command)`` per holder in ``/proc/locks`` (pids of this
    machine's pid namespace: a writer on another host of a shared volume is not listed)."""
    info = os.fstat(fd)
    wanted = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    holders: list[str] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            # "1: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE 0 EOF"; "1: -> FLOCK ..." lines are waiters, not holders
            if "->" in fields or len(fields) < 6 or fields[5] != wanted:
                continue
            pid = fields[4]
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                command = "?"
            holders.append(f"pid {pid} ({command.strip()[:120]})")
    return holders


def _wait_for_writer(lock: Path, timeout_s: float, stopping: threading.Event | None = None) -> None:
    """Wait until the connector releases its write lock (it holds LOCK_EX until the file is written whole), at most
    ``timeout_s`` (then :class:`ExtractionError` naming the holder), or until ``stopping`` is set."""
    fd = _open_regular(lock)
    if fd is None:
        return
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            if stopping is not None and stopping.is_set():
                raise ExtractionError(f"stopped while waiting for the connector's lock {lock}")
            if time.monotonic() >= deadline:
                holders = lock_holders(fd) or ["a process this machine cannot see (another host of the volume?)"]
                raise ExtractionError(
                    f"{lock} is still locked by {', '.join(holders)} after {timeout_s:g} s (the request timeout): "
                    f"the connector never finished writing {lock.stem}. If that extraction server is hung, restart "
                    "it; the file is left in place and swept by a later run"
                )
            time.sleep(LOCK_POLL_S)
    finally:
        os.close(fd)


def _read_bytes(path: Path) -> bytes:
    fd = _open_regular(path)
    if fd is None:
        raise ExtractionError(
            f"the server named {path.name} but {path} does not exist here: is EAGLE3_HIDDEN_STATES_STORAGE the local "
            "mount of the connector's shared_storage_path?"
        )
    with os.fdopen(fd, "rb") as handle:
        return handle.read()


def read_connector_file(
    path: Path,
    token_ids: Sequence[int],
    n_states: int,
    hidden_size: int,
    lock_timeout_s: float = 600.0,
    stopping: threading.Event | None = None,
) -> torch.Tensor:
    """Wait for the connector's write lock (at most ``lock_timeout_s``), load the file and check it.

    The file (and its lock) is deleted only once its token ids equal the request's: then it is this request's answer,
    whatever else is wrong with it. A file that is unreadable or carries other ids is left alone (it may be anything
    that happens to lie in the folder: the reply is not trusted to say what may be deleted).
    """
    # lazy: loads torch (heavy), which only this path needs
    import torch
    from safetensors.torch import load

    lock = path.with_name(f"{path.name}.lock")
    _wait_for_writer(lock, lock_timeout_s, stopping)
    try:
        tensors = load(_read_bytes(path))
    except (ExtractionError, OSError):  # an OSError is this machine's (EIO, EACCES): the caller reports it as local
        raise
    except Exception as error:  # SafetensorError, or whatever a broken header raises: left in place
        why = f"{type(error).__name__}: {error}"
        raise ExtractionError(f"{path.name} is not a readable safetensors file ({why})") from None
    states, stored_ids = tensors.get("hidden_states"), tensors.get("token_ids")
    if states is None or stored_ids is None:
        raise ExtractionError(f"{path.name}: keys {sorted(tensors)}, expected hidden_states and token_ids")
    if stored_ids.tolist() != list(token_ids):
        raise ExtractionError(f"{path.name}: token_ids differ from the {len(token_ids)} ids sent (file left in place)")
    for done in (path, lock):  # this request's answer: removed whatever the checks below say
        with contextlib.suppress(FileNotFoundError):
            done.unlink()
    expected = (len(token_ids), n_states, hidden_size)
    if tuple(states.shape) != expected:
        raise ExtractionError(
            f"{path.name}: hidden_states shape {tuple(states.shape)} != {expected} (does the server extract the same "
            "eagle_aux_hidden_state_layer_ids?)"
        )
    if not bool(torch.isfinite(states).all()):
        raise ExtractionError(f"{path.name}: hidden states contain NaN or Inf")
    return states


def sweep_stale_files(storage: Path, older_than_s: float) -> int:
    """Delete this project's connector files (and locks) older than ``older_than_s``: what killed clients left.

    Only regular files named ``eagle3-hs-*.safetensors[.lock]`` (what ``CPUHiddenStatesConnector`` writes) are
    touched: anything else in the folder (model weights, another tool's files) is never deleted. Safe next to live
    clients: a client waits at most its request timeout for the answer and reads the file at once, so a file older
    than twice the timeout has no reader left.
    """
    cutoff = time.time() - older_than_s
    removed = 0
    for entry in storage.glob(f"{CONNECTOR_FILE_PREFIX}*.safetensors*"):
        if not entry.name.endswith((".safetensors", ".safetensors.lock")):
            continue
        with contextlib.suppress(FileNotFoundError):
            info = entry.lstat()
            if stat.S_ISREG(info.st_mode) and info.st_mtime < cutoff:
                entry.unlink()
                removed += 1
    return removed
