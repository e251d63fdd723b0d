"""Workers taking turns at shared cores, as ``workers.actor.core_share`` makes them on one machine:
a step starts when its threads fit beside the steps running, in the order the workers asked."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable


class CoreBoard:
    """``cores`` cores shared by the workers that name this board; FIFO turns, as the real board's
    tickets give them (a later asker never overtakes an earlier one)."""

    def __init__(self, name: str, cores: int) -> None:
        if cores < 1:
            raise ValueError(f"a core board needs at least one core, got {cores}")
        self.name = name
        self.cores = cores
        self.running = 0
        self._waiting: deque[tuple[int, Callable[[], None]]] = deque()

    def ask(self, threads: int, start: Callable[[], None]) -> None:
        """Call ``start()`` once ``threads`` cores are this asker's (now, or when a turn frees them)."""
        self._waiting.append((min(threads, self.cores), start))
        self._admit()

    def give_back(self, threads: int) -> None:
        """A step that held ``threads`` cores ended."""
        self.running -= min(threads, self.cores)
        self._admit()

    def _admit(self) -> None:
        while self._waiting and self.running + self._waiting[0][0] <= self.cores:
            threads, start = self._waiting.popleft()
            self.running += threads
            start()
