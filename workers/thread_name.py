"""Names the calling OS thread (Linux ``prctl(PR_SET_NAME)``), so ``top -H``, ``perf`` and the CPU
breakdown benchmark tell Baton's threads from Ray's: Python before 3.14 names only its own
``threading.Thread`` objects. Threads a named thread starts (the OpenMP team of the engine thread's
first parallel op) inherit the name."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_PR_SET_NAME = 15


def name_this_thread(name: str) -> None:
    """Set the OS name of the calling thread (first 15 bytes); a no-op off Linux or without libc."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass
