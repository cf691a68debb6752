"""Guards around the embedded vLLM server process: it dies with its parent, only a server this project started
(for the same model) is reused, and an API key never travels on a command line.

Kept apart from ``local/vllm_server.py`` so the server module calls a few functions and holds no policy.

* Parent death: :data:`DEATHSIG_PROLOGUE` runs in the child before it ``exec``s vLLM and asks the kernel
  (``prctl(PR_SET_PDEATHSIG, SIGTERM)``, which survives ``exec``) to send it SIGTERM when the thread that started it
  dies, SIGKILL included; vLLM's SIGTERM path then stops its engine core. If the parent died before the prologue
  ran (the race the man page warns of), the child stops itself. Detached servers (``start``) do not use it.
* Launchers: :func:`with_parent_death_signal` wraps any command (torchrun) in a tiny exec wrapper that asks for the
  same signal, so a SIGKILLed Dagster step does not leave training running and its lock held.
* Ownership: :func:`write_marker` records every server started here (pid, port, model folder, served name) in a
  per-user folder; :func:`reuse_refusal` accepts a running server only when such a record exists, its pid is alive,
  belongs to the current user (as does the socket listening on the port) and still runs vLLM on that port for that
  model folder, and it serves that name.
* Shared hosts: logs, pid files and markers live in :func:`user_dir` (``$TMPDIR/eagle3-vllm-UID``, 0700) or a folder
  the caller names; :func:`private_dir` and :func:`open_private_file` never follow a symbolic link planted at a
  folder's or a file's name and refuse a folder another user owns (anyone may create names in ``/tmp``).
* Keys: :func:`refuse_key_args` rejects ``--api-key`` in extra arguments (visible to every user in ``ps`` and
  written to the server log's command line); the key goes in the server's environment as ``VLLM_API_KEY``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pwd
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

PARENT_PID_ENV = "EAGLE3_VLLM_PARENT_PID"

# One statement line, prepended to the server's ``-c`` shim (which ends in ``os.execv``). PR_SET_PDEATHSIG = 1.
DEATHSIG_PROLOGUE = (
    "import ctypes as _c, os as _o, signal as _s; "
    "_c.CDLL(None, use_errno=True).prctl(1, int(_s.SIGTERM), 0, 0, 0); "
    f"_p = _o.environ.get('{PARENT_PID_ENV}'); "
    "(_p and _o.getppid() != int(_p)) and _o._exit(0); "
)


def with_parent_death_signal(command: Sequence[str], sig: int = signal.SIGTERM) -> list[str]:
    """``command`` behind an exec wrapper that first asks the kernel to send it ``sig`` when the thread that starts
    it dies (Linux ``prctl(PR_SET_PDEATHSIG)``, kept across ``exec``); elsewhere ``command`` unchanged.

    Start the result from the thread that lives as long as the command should (Dagster's step thread). The wrapper
    exits at once when its parent is already gone (the race the man page warns of): the process starting it is this
    one, whose pid is written into the wrapper.
    """
    if not sys.platform.startswith("linux"):
        return list(command)
    code = (
        "import ctypes, os, sys; "
        f"ctypes.CDLL(None, use_errno=True).prctl(1, {int(sig)}, 0, 0, 0); "
        f"os.getppid() != {os.getpid()} and os._exit(1); "
        "os.execvp(sys.argv[1], sys.argv[1:])"
    )
    return [sys.executable, "-c", code, *command]


class KeyInArgumentsError(ValueError):
    """An API key was given as a command-line argument."""


def _names_the_key(arg: str) -> bool:
    """Whether vLLM's argument parser reads ``arg`` as ``--api-key``: it turns ``_`` into ``-`` in option names
    (``--api_key``), takes ``--opt=value``, and argparse accepts any unambiguous prefix (``--api-k``). Every prefix of
    ``api-key`` from two letters on is refused: one that vLLM finds ambiguous fails there anyway."""
    if not arg.startswith("--"):
        return False
    name = arg[2:].split("=", 1)[0].replace("_", "-").lower()
    return len(name) >= 2 and "api-key".startswith(name)


def refuse_key_args(args: Sequence[str]) -> None:
    """Raise when ``args`` carry the API key option in any spelling vLLM accepts (the message never repeats the
    value)."""
    for arg in args:
        if _names_the_key(str(arg)):
            option = str(arg).split("=", 1)[0]
            raise KeyInArgumentsError(
                f"extra_args: {option} is refused (vLLM reads it as --api-key; a command line is visible to every "
                "user and lands in the server log); put the key in the server's environment as VLLM_API_KEY "
                "(extra_env, or the caller's env)"
            )


class UnsafePathError(RuntimeError):
    """A server log, pid file or reuse marker would be written through a symbolic link, or into a folder another
    user owns (a shared host: anyone may create names in ``/tmp``)."""


def user_dir() -> Path:
    """The per-user folder of server logs and reuse markers: ``$TMPDIR/eagle3-vllm-UID`` (created 0700)."""
    return Path(tempfile.gettempdir()) / f"eagle3-vllm-{os.getuid()}"


def _owner_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _open_dir(path: Path) -> int:
    """A descriptor of the folder ``path``: never through a symbolic link, never one another user owns."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            what = "a symbolic link" if os.path.islink(path) else "not a folder"
            raise UnsafePathError(
                f"{path} is {what}; refused (server logs and markers are never written through a link someone else "
                "may have planted): remove it, or choose another folder with $EAGLE3_VLLM_LOG_DIR / --log-dir"
            ) from None
        raise
    owner = os.fstat(fd).st_uid
    if owner != os.getuid():
        os.close(fd)
        raise UnsafePathError(
            f"{path} belongs to {_owner_name(owner)}, not to the current user {_owner_name(os.getuid())}; refused "
            "(another user could read or replace what is written there): remove it, or choose another folder with "
            "$EAGLE3_VLLM_LOG_DIR / --log-dir"
        )
    return fd


def private_dir(path: Path) -> Path:
    """``path`` as a folder of the current user: created 0700 when missing (parents as usual), refused when it is a
    symbolic link, not a folder, or another user's (:class:`UnsafePathError`, naming it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    os.close(_open_dir(path))
    return path


def open_private_file(directory: Path, name: str, flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC) -> int:
    """Open ``directory/name`` (``directory`` checked as :func:`private_dir` does) without following a symbolic
    link at either; a file to write must be a regular file with no other hard link. Returns a descriptor."""
    directory = private_dir(directory)
    dir_fd = _open_dir(directory)
    try:
        try:
            fd = os.open(name, (flags & ~os.O_TRUNC) | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise UnsafePathError(
                    f"{directory / name} is a symbolic link; refused (nothing is written through it): remove it"
                ) from None
            raise
    finally:
        os.close(dir_fd)
    info = os.fstat(fd)
    if flags & (os.O_WRONLY | os.O_RDWR) and (not stat.S_ISREG(info.st_mode) or info.st_nlink > 1):
        os.close(fd)
        raise UnsafePathError(f"{directory / name} is not a plain file of its own (a link to another?); refused")
    if flags & os.O_TRUNC:
        os.ftruncate(fd, 0)  # only now: truncating before the checks would have emptied a planted hard link's target
    return fd


def marker_dir() -> Path:
    return user_dir() / "servers"


def marker_path(host: str, port: int) -> Path:
    return marker_dir() / f"{host}-{port}.json"


def write_marker(host: str, port: int, pid: int, model: Path, served_name: str) -> None:
    """Record a server this process started (read back by :func:`reuse_refusal`)."""
    private_dir(user_dir())
    path = marker_path(host, port)
    record = {"pid": pid, "port": port, "model": str(Path(model).resolve()), "served_name": served_name}
    tmp = f".{path.name}.tmp-{os.getpid()}"
    fd = open_private_file(path.parent, tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps({**record, "started_at": time.time()}))
    dir_fd = _open_dir(path.parent)
    try:  # a rename replaces a link planted at the marker's name, never writes through it
        os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def _read_marker(host: str, port: int) -> dict:
    private_dir(user_dir())
    path = marker_path(host, port)
    with os.fdopen(open_private_file(path.parent, path.name, os.O_RDONLY)) as handle:
        return json.loads(handle.read())


def remove_marker(host: str, port: int, pid: int | None = None) -> None:
    """Forget the server on host:port (only the record of ``pid`` when given: never another one's)."""
    path = marker_path(host, port)
    with contextlib.suppress(OSError, ValueError, UnsafePathError):
        if pid is None or _read_marker(host, port).get("pid") == pid:
            path.unlink()


def process_owner(pid: int) -> int | None:
    """The real uid of process ``pid`` (``/proc/PID/status``); None when it is gone or there is no ``/proc``."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def listener_owners(port: int) -> set[int]:
    """The uids owning a socket that listens on TCP ``port`` (``/proc/net/tcp`` and ``tcp6``); empty when none is
    seen there (no ``/proc``: the pid's owner is then the only check)."""
    owners: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                # sl local_address rem_address st ... uid: st 0A is LISTEN, the port is the local address's hex tail
                if len(fields) > 7 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    owners.add(int(fields[7]))
    return owners


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def reuse_refusal(host: str, port: int, model: Path, served_name: str) -> str | None:
    """None when the server on host:port may be reused; otherwise why not."""
    path = marker_path(host, port)
    try:
        record = _read_marker(host, port)
        pid = int(record["pid"])
    except UnsafePathError as error:
        return str(error)
    except (OSError, ValueError, KeyError, TypeError):
        return f"it was not started by eagle3 (no record in {path.parent})"
    me = os.getuid()
    owner = process_owner(pid)
    if owner is not None and owner != me:  # the recorded pid now runs another user's process (pids are recycled)
        return f"the process {pid} recorded there belongs to {_owner_name(owner)}, not to {_owner_name(me)}"
    strangers = listener_owners(port) - {me}
    if strangers:
        who = ", ".join(_owner_name(uid) for uid in sorted(strangers))
        return f"the socket listening on port {port} belongs to {who}, not to {_owner_name(me)}"
    argv = _cmdline(pid)
    wanted = str(Path(model).resolve())
    if not argv or "--port" not in argv or str(port) not in argv:
        return f"the server eagle3 started there (pid {pid}) is gone; another process holds the port"
    if record.get("model") != wanted or wanted not in argv:
        return f"it serves the model folder {record.get('model')!r}, not {wanted!r}"
    if record.get("served_name") != served_name:
        return f"it serves the name {record.get('served_name')!r}, not {served_name!r}"
    return None
