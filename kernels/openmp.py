"""Keeps a process's OpenMP teams to the one compute thread, so libgomp's spin-waits stay on.

libgomp gives every thread that starts a parallel region a team of its own, and once the threads
of all teams in a process outnumber its CPUs it throttles every spin-wait to ~100 iterations:
each region then wakes a sleeping thread, 55-75 us on these VMs, about 20% of a decode step. So
one parallel torch op on a side thread (KV shipping, a Ray call) slows the engine thread for the
rest of the process's life. Side threads call ``serial_here`` before their first torch op.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

import torch

_lock = threading.Lock()
_runtime: ctypes.CDLL | None = None
_looked = False
_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: threads go, the runtime stays usable


def _omp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (found in /proc/self/maps so that a second copy is never
    loaded), or None where there is none."""
    global _runtime, _looked
    with _lock:
        if not _looked:
            _looked = True
            try:
                with open("/proc/self/maps") as maps:
                    paths = sorted({line.split()[-1] for line in maps if "omp" in line.rsplit("/", 1)[-1]})
            except OSError:  # not Linux
                paths = []
            for path in paths:
                try:
                    lib = ctypes.CDLL(path)
                    lib.omp_set_num_threads.argtypes, lib.omp_set_num_threads.restype = [ctypes.c_int], None
                except (OSError, AttributeError):
                    continue
                pause = getattr(lib, "omp_pause_resource_all", None)  # OpenMP 5.0; older runtimes lack it
                if pause is not None:
                    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
                _runtime = lib
                break
    return _runtime


def _omp_set_num_threads() -> Callable[[int], None] | None:
    lib = _omp_runtime()
    return lib.omp_set_num_threads if lib is not None else None


def serial_here() -> bool:
    """Run this thread's parallel regions (ATen ops, oneDNN, Baton's C kernels) on this thread
    alone, with no OpenMP team; other threads keep theirs. MKL's fp32 BLAS keeps its own
    per-thread count, so such a thread should not run fp32 matmuls (KV copies do not). False
    where torch has no OpenMP runtime to set (then nothing changes)."""
    # torch sets a thread's team size lazily, on its first parallel op (from the process-wide
    # value): trigger that first, or it would overwrite ours later.
    torch.get_num_threads()
    setter = _omp_set_num_threads()
    if setter is None:
        return False
    setter(1)
    return torch.get_num_threads() == 1


def release_team() -> bool:
    """End this thread's OpenMP team now (``omp_pause_resource_all``, soft): its threads exit
    instead of spinning on cores another process is about to use; the next parallel region
    starts a new team (~0.1 ms). Call outside any parallel region. False where the runtime
    cannot (then the team spins out its ``GOMP_SPINCOUNT`` as usual)."""
    pause = getattr(_omp_runtime(), "omp_pause_resource_all", None)
    return pause is not None and pause(_OMP_PAUSE_SOFT) == 0
