"""A real EACCES for a child process run as root (the read-error tests of issue 31, clause 2).

Root reads a file whatever its mode through two Linux capabilities; a root child that exec()s with them dropped from
its bounding set meets mode 000 (or a folder it may not list) like any user, so ``chmod`` makes a file unreadable
for real instead of a patched ``open`` raising the error.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

# the capabilities that let root read a file whatever its mode (linux/capability.h), and prctl's request to drop one
# from the bounding set
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, PR_CAPBSET_DROP = 1, 2, 24


def without_root_file_access() -> None:
    """preexec_fn of a root child: drop the capabilities that bypass file modes (a real EACCES as root)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def file_modes_enforced(wanted: bool = True) -> Callable[[], None] | None:
    """The ``preexec_fn`` for a child that must meet file modes (when ``wanted``): :func:`without_root_file_access`
    where this process is root, None where file modes already apply to it."""
    return without_root_file_access if wanted and os.geteuid() == 0 else None
