"""Stopping a server's whole process group (API server + engine core): SIGINT, then SIGTERM, then SIGKILL."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def stop_process_group(pid: int, grace_s: float = 30.0, process: subprocess.Popen[bytes] | None = None) -> int | None:
    """SIGINT, then SIGTERM, then SIGKILL to the process group led by ``pid``; wait for all of it to exit."""
    pgid = pid  # start_new_session=True makes the server its group leader
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        if _wait_group_gone(pgid, pid, wait_s, process):
            break
    code = None
    if process is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = process.wait(timeout=5)
    return code


def _wait_group_gone(pgid: int, pid: int, timeout_s: float, process: subprocess.Popen[bytes] | None) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None:
            process.poll()  # reap the leader so it does not linger as a zombie group member
        else:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        # The engine core may outlive the API server briefly; a zombie leader alone still counts as "gone".
        if only_zombies(pgid):
            return True
        time.sleep(0.25)
    return False


def only_zombies(pgid: int) -> bool:
    proc = Path("/proc")
    if not proc.is_dir():
        return False
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # /proc/PID/stat: "pid (comm) state ppid pgrp ..." - comm may contain spaces, so split after ')'.
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            return False
    return True
