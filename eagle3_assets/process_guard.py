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
  per-user folder; :func:`reuse_refusal` accepts a running server only when such a record exists, its pid is alive
  and still runs vLLM on that port for that model folder, and it serves that name.
* Keys: :func:`refuse_key_args` rejects ``--api-key`` in extra arguments (visible to every user in ``ps`` and
  written to the server log's command line); the key goes in the server's environment as ``VLLM_API_KEY``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
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


def marker_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"eagle3-vllm-servers-{os.getuid()}"


def marker_path(host: str, port: int) -> Path:
    return marker_dir() / f"{host}-{port}.json"


def write_marker(host: str, port: int, pid: int, model: Path, served_name: str) -> None:
    """Record a server this process started (read back by :func:`reuse_refusal`)."""
    path = marker_path(host, port)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    record = {"pid": pid, "port": port, "model": str(Path(model).resolve()), "served_name": served_name}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({**record, "started_at": time.time()}))
    os.replace(tmp, path)


def remove_marker(host: str, port: int, pid: int | None = None) -> None:
    """Forget the server on host:port (only the record of ``pid`` when given: never another one's)."""
    path = marker_path(host, port)
    with contextlib.suppress(OSError, ValueError):
        if pid is None or json.loads(path.read_text()).get("pid") == pid:
            path.unlink()


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
        record = json.loads(path.read_text())
        pid = int(record["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"it was not started by eagle3 (no record in {path.parent})"
    argv = _cmdline(pid)
    wanted = str(Path(model).resolve())
    if not argv or "--port" not in argv or str(port) not in argv:
        return f"the server eagle3 started there (pid {pid}) is gone; another process holds the port"
    if record.get("model") != wanted or wanted not in argv:
        return f"it serves the model folder {record.get('model')!r}, not {wanted!r}"
    if record.get("served_name") != served_name:
        return f"it serves the name {record.get('served_name')!r}, not {served_name!r}"
    return None
