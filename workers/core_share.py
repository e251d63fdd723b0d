"""Turn-taking on one machine's cores for co-located workers whose threads outnumber them.

When a prefill and a decode worker share cores, fixed OpenMP teams either oversubscribe them
(a spinning thread then burns the core its partner needs) or sleep at every wait (each of a
decode step's ~200 parallel regions then wakes a thread: ~20% of the step on a VM). Instead
each engine step asks a small shared board for room: it starts when its threads fit the cores
beside the steps already running, in the order the workers asked (so two busy workers
alternate, step by step, as a colocated engine interleaves prefill chunks and decodes). Every
step then runs a full team that spins, and no core is ever asked for twice.

The board is a file in shared memory: a ticket counter, then one slot per worker (pid, state,
ticket, threads). Updates happen under ``flock``; a worker whose pid is gone stops counting.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

_HEADER = struct.Struct("q")  # next ticket
_SLOT = struct.Struct("qqqq")  # pid, state, ticket, threads
IDLE, WAITING, RUNNING = 0, 1, 2
_POLL_S = (0.0001, 0.001)  # first and longest sleep between tries while waiting for room


def create_board(num_slots: int, directory: str | None = None) -> Path:
    """A zeroed board for ``num_slots`` workers; the caller removes the file when they are gone."""
    if num_slots < 1:
        raise ValueError("a core-share board needs at least one slot")
    folder = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    fd, path = tempfile.mkstemp(prefix="baton-cores-", dir=folder)
    with os.fdopen(fd, "wb") as f:
        f.write(bytes(_HEADER.size + _SLOT.size * num_slots))
    return Path(path)


class CoreShare:
    """One worker's seat at the board. ``before_step``/``after_step`` bracket each engine step.

    Used from the engine loop thread only.
    """

    def __init__(self, path: str | os.PathLike, slot: int, cores: int, threads: int) -> None:
        if cores < 1 or threads < 1:
            raise ValueError("cores and threads must be >= 1")
        self.path, self.slot, self.cores = Path(path), slot, cores
        self.threads = min(threads, cores)  # what a step asks for: more can never fit
        self._file = open(self.path, "r+b")
        self._map = mmap.mmap(self._file.fileno(), 0)
        self._pid = os.getpid()
        self.num_slots = (len(self._map) - _HEADER.size) // _SLOT.size
        if not 0 <= slot < self.num_slots:
            self._map.close()
            self._file.close()
            raise ValueError(f"slot {slot} outside the board's {self.num_slots} slots")
        self.wait_seconds = 0.0  # total time steps waited for room (for stats)
        with self._locked():
            self._write(IDLE, 0)

    def before_step(self, meanwhile: Callable[[float], None] = time.sleep) -> None:
        """Block until this worker's step fits the cores, taking turns with earlier askers.

        Between tries it calls ``meanwhile(seconds)``: the engine loop handles its inbox there
        (KV reservations, admissions, aborts), so a worker waiting for the cores still answers.
        """
        with self._locked():
            ticket = _HEADER.unpack_from(self._map, 0)[0] + 1
            _HEADER.pack_into(self._map, 0, ticket)
            self._write(WAITING, ticket)
            if self._admit(ticket):
                return
        started, pause = time.monotonic(), _POLL_S[0]
        while True:
            meanwhile(pause)
            pause = min(pause * 2, _POLL_S[1])
            with self._locked():
                if self._admit(ticket):
                    break
        self.wait_seconds += time.monotonic() - started

    def after_step(self) -> None:
        """Give the cores back (the next step takes a new turn)."""
        with self._locked():
            self._write(IDLE, 0)

    def state(self) -> list[tuple[int, int, int, int]]:
        """Every slot as (pid, state, ticket, threads): for tests and debugging."""
        return [_SLOT.unpack_from(self._map, self._offset(i)) for i in range(self.num_slots)]

    def close(self) -> None:
        if not self._map.closed:
            with self._locked():
                self._write(IDLE, 0)
            self._map.close()
        self._file.close()

    # -- under the lock ------------------------------------------------------------------
    def _admit(self, ticket: int) -> bool:
        running = 0
        for i in range(self.num_slots):
            if i == self.slot:
                continue
            pid, state, their_ticket, threads = _SLOT.unpack_from(self._map, self._offset(i))
            if state == IDLE or not _alive(pid):
                continue
            if state == RUNNING:
                running += threads
            elif their_ticket < ticket:  # asked first: it goes first
                return False
        if running + self.threads > self.cores:
            return False
        self._write(RUNNING, ticket)
        return True

    def _write(self, state: int, ticket: int) -> None:
        _SLOT.pack_into(self._map, self._offset(self.slot), self._pid, state, ticket, self.threads)

    def _offset(self, i: int) -> int:
        return _HEADER.size + i * _SLOT.size

    def _locked(self) -> _FileLock:
        return _FileLock(self._file.fileno())


class _FileLock:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
