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
Each slot also has a bell, a named pipe: a worker that frees cores rings the bells of those
waiting, so a turn passes at once. Waiters must not poll: every wake-up of a waiting thread
preempts a thread of the running step's spinning team, which stalls the whole team (polling
every millisecond made prefill chunks ~20% slower).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import select
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

_HEADER = struct.Struct("q")  # next ticket
_SLOT = struct.Struct("qqqq")  # pid, state, ticket, threads
IDLE, WAITING, RUNNING = 0, 1, 2
# A waiter re-reads the board at least this often even when no bell rings: a runner that died
# mid-step rings none.
_RECHECK_S = 0.05


def create_board(num_slots: int, directory: str | None = None) -> Path:
    """A zeroed board for ``num_slots`` workers, with their bells; ``remove_board`` deletes it."""
    if num_slots < 1:
        raise ValueError("a core-share board needs at least one slot")
    folder = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    fd, path = tempfile.mkstemp(prefix="baton-cores-", dir=folder)
    with os.fdopen(fd, "wb") as f:
        f.write(bytes(_HEADER.size + _SLOT.size * num_slots))
    for slot in range(num_slots):
        os.mkfifo(bell_path(path, slot), 0o600)
    return Path(path)


def remove_board(path: str | os.PathLike) -> None:
    """Delete a board and its bells (workers that still have them open keep working)."""
    path = Path(path)
    slots = 0
    try:
        slots = (path.stat().st_size - _HEADER.size) // _SLOT.size
    except FileNotFoundError:
        pass
    for slot in range(slots):
        bell_path(path, slot).unlink(missing_ok=True)
    path.unlink(missing_ok=True)


def bell_path(board: str | os.PathLike, slot: int) -> Path:
    """The named pipe that wakes the worker in ``slot``."""
    board = Path(board)
    return board.with_name(f"{board.name}.bell{slot}")


class CoreShare:
    """One worker's seat at the board. ``before_step``/``after_step`` bracket each engine step.

    Used from the engine loop thread only.
    """

    def __init__(self, path: str | os.PathLike, slot: int, cores: int, threads: int,
                 release_team: Callable[[], object] | None = None) -> None:
        if cores < 1 or threads < 1:
            raise ValueError("cores and threads must be >= 1")
        self.path, self.slot, self.cores = Path(path), slot, cores
        # Ends this worker's OpenMP team (kernels.openmp.release_team), whose threads would
        # otherwise spin out libgomp's default (~9 ms) on cores another worker's step is given:
        # called when a step hands the cores to a waiter, before a step waits for them, and by
        # the engine loop when it goes idle (``release``).
        self._release_team = release_team
        self.handoffs = 0
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
        # O_RDWR: the pipe always has a writer (no EOF) and opening it never blocks.
        self._bell = os.open(bell_path(self.path, slot), os.O_RDWR | os.O_NONBLOCK)
        self._bell_lock = threading.Lock()  # ring() comes from any thread; close() must not race it
        self._poller = select.poll()  # not select(): a Ray worker's descriptors can pass 1024
        self._poller.register(self._bell, select.POLLIN)
        self._peer_bells: dict[int, int] = {}
        with self._locked():
            self._write(IDLE, 0)

    def before_step(self, on_wake: Callable[[], None] | None = None) -> None:
        """Block until this worker's step fits the cores, taking turns with earlier askers.

        While waiting, ``on_wake()`` runs each time this worker's bell rings (``ring``): the engine
        loop handles its inbox there (KV reservations, admissions, aborts), so a worker waiting
        for the cores still answers at once.
        """
        with self._locked():
            ticket = _HEADER.unpack_from(self._map, 0)[0] + 1
            _HEADER.pack_into(self._map, 0, ticket)
            self._write(WAITING, ticket)
            if self._admit(ticket) is not None:
                return
        self.release()  # another worker's step has the cores: leave them to it while waiting
        started = time.monotonic()
        while True:
            self._poller.poll(_RECHECK_S * 1000)
            self._drain_bell()
            if on_wake is not None:
                on_wake()
            with self._locked():
                spare = self._admit(ticket)
                if spare is not None:
                    # a later asker held back only by this one's ticket may fit beside it now
                    waiting = self._waiting_slots() if spare > 0 else []
                    break
        self._ring_peers(waiting)
        self.wait_seconds += time.monotonic() - started

    def after_step(self) -> None:
        """Give the cores back (the next step takes a new turn) and wake those waiting for them."""
        with self._locked():
            self._write(IDLE, 0)
            waiting = self._waiting_slots()
        if waiting:
            self.handoffs += 1
            self.release()
        self._ring_peers(waiting)

    def release(self) -> None:
        """End this worker's spinning OpenMP team now, where a ``release_team`` hook was given
        (also when its engine goes idle: nothing of it should spin on shared cores then)."""
        if self._release_team is not None:
            self._release_team()

    def ring(self) -> None:
        """Wake this worker's ``before_step`` wait (from any thread), e.g. for a new command."""
        with self._bell_lock:
            if self._bell >= 0:
                try:
                    os.write(self._bell, b"\0")
                except BlockingIOError:  # the pipe is full: a wake-up is pending anyway
                    pass

    def state(self) -> list[tuple[int, int, int, int]]:
        """Every slot as (pid, state, ticket, threads): for tests and debugging."""
        return [_SLOT.unpack_from(self._map, self._offset(i)) for i in range(self.num_slots)]

    def close(self) -> None:
        waiting: list[int] = []
        if not self._map.closed:
            with self._locked():
                self._write(IDLE, 0)
                waiting = self._waiting_slots()
            self._map.close()
        self._ring_peers(waiting)
        with self._bell_lock:
            for fd in [self._bell, *self._peer_bells.values()]:
                if fd >= 0:
                    os.close(fd)
            self._bell, self._peer_bells = -1, {}
        self._file.close()

    # -- bells ---------------------------------------------------------------------------
    def _drain_bell(self) -> None:
        try:
            while os.read(self._bell, 4096):
                pass
        except BlockingIOError:
            pass

    def _ring_peers(self, slots: list[int]) -> None:
        for slot in slots:
            fd = self._peer_bells.get(slot)
            try:
                if fd is None:
                    fd = self._peer_bells[slot] = os.open(bell_path(self.path, slot), os.O_WRONLY | os.O_NONBLOCK)
                os.write(fd, b"\0")
            except BlockingIOError:  # full: that worker has a wake-up pending
                pass
            except OSError as exc:  # gone (no reader, board removed): it re-reads the board anyway
                if exc.errno not in (errno.ENXIO, errno.EPIPE, errno.ENOENT):
                    raise
                if fd is not None:
                    os.close(fd)
                self._peer_bells.pop(slot, None)

    # -- under the lock ------------------------------------------------------------------
    def _admit(self, ticket: int) -> int | None:
        """Take the cores if this step fits and no earlier asker waits: the cores left free, or None."""
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
                return None
        if running + self.threads > self.cores:
            return None
        self._write(RUNNING, ticket)
        return self.cores - running - self.threads

    def _waiting_slots(self) -> list[int]:
        return [i for i in range(self.num_slots)
                if i != self.slot and _SLOT.unpack_from(self._map, self._offset(i))[1] == WAITING]

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
