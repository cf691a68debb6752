"""Stopping a server's whole process tree (API server + engine core + whatever they started): SIGINT, then SIGTERM,
then SIGKILL, all within :data:`STOP_BUDGET_S`.

The server leads its own process group; a child that left it (its own session, a daemonized helper) or that was
re-parented when the leader died is still found: the tree below the leader is snapshotted before each signal and
every process in it gets the same signal as the group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from eagle3_assets.core.storage import pid_alive

# A stop takes at most this long, whatever the server does with SIGINT and SIGTERM. Issue 31 allows a stage 30 s
# from a signal to its end with no process left, and an interrupted stage still has to stop its server inside that.
STOP_BUDGET_S = 15.0
TERM_WAIT_S = 4.0  # after SIGTERM: vLLM's SIGTERM path is its quick one
KILL_WAIT_S = 3.0  # after SIGKILL: the kernel only has to tear the processes down
# the rest is vLLM's graceful SIGINT path (measured 1-2 s on the CPU build, docs/local_vllm.md)
SIGINT_WAIT_S = STOP_BUDGET_S - TERM_WAIT_S - KILL_WAIT_S


def stop_process_group(
    pid: int, grace_s: float = SIGINT_WAIT_S, process: subprocess.Popen[bytes] | None = None
) -> int | None:
    """SIGINT, then SIGTERM, then SIGKILL to the process group led by ``pid`` and every process below it; wait for
    all of it to exit. ``grace_s`` (the wait after SIGINT) is capped so the whole stop fits :data:`STOP_BUDGET_S`.
    Returns the leader's exit code when ``process`` is its handle."""
    pgid = pid  # start_new_session=True makes the server its group leader
    deadline = time.monotonic() + STOP_BUDGET_S
    tree = descendants(pid)
    steps = ((signal.SIGINT, min(grace_s, SIGINT_WAIT_S)), (signal.SIGTERM, TERM_WAIT_S), (signal.SIGKILL, KILL_WAIT_S))
    for sig, wait_s in steps:
        tree |= descendants(pid)  # before each signal: a leader that exited no longer links its children to it
        group_alive = True
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            group_alive = False
        except PermissionError:
            pass  # not ours (a recycled pid): only the tree we saw is signalled
        for member in alive(tree):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(member, sig)
        if not group_alive and not alive(tree):
            break
        if _wait_gone(pgid, pid, tree, min(wait_s, deadline - time.monotonic()), process):
            break
    code = None
    if process is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = process.wait(timeout=max(0.5, deadline - time.monotonic()))
    return code


def _wait_gone(pgid: int, pid: int, tree: set[int], timeout_s: float, process: subprocess.Popen[bytes] | None) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if process is not None:
            process.poll()  # reap the leader so it does not linger as a zombie group member
        else:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
        if _group_gone(pgid) and not alive(tree):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _group_gone(pgid: int) -> bool:
    if not pid_alive(pgid, send=os.killpg):
        return True
    # The engine core may outlive the API server briefly; a zombie leader alone still counts as "gone".
    return only_zombies(pgid)


def _proc_stats() -> dict[int, list[str]]:
    """``/proc/PID/stat`` fields after the command name, per live pid (empty without ``/proc``)."""
    stats: dict[int, list[str]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return stats
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            # "pid (comm) state ppid pgrp ...": comm may contain spaces and parentheses, so split after the last ')'
            stats[int(entry.name)] = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
    return stats


def descendants(pid: int) -> set[int]:
    """Every live (non-zombie) process below ``pid``, children that started their own session included."""
    parents = {child: int(f[1]) for child, f in _proc_stats().items() if len(f) > 1 and f[0] != "Z"}
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (a zombie has exited: it holds nothing)."""
    if not pids:
        return set()
    return {p for p, f in _proc_stats().items() if p in pids and f and f[0] not in ("Z", "X")}


def only_zombies(pgid: int) -> bool:
    stats = _proc_stats()
    if not stats:
        return False
    return not any(len(f) > 2 and int(f[2]) == pgid and f[0] != "Z" for f in stats.values())
