"""The simulator's virtual clock: a discrete-event loop. Events at the same instant run in the
order they were scheduled, so a run is the same, event for event, for the same inputs."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventLoop:
    """Callbacks at virtual times (seconds from 0). ``now`` is the time of the event running."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.events_run = 0

    def clock(self) -> float:
        """The virtual time, as a ``time.monotonic`` stand-in for the code under simulation."""
        return self.now

    def at(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` at virtual time ``when`` (now, if that has passed)."""
        heapq.heappush(self._queue, (max(when, self.now), next(self._seq), fn))

    def after(self, delay_s: float, fn: Callable[[], None]) -> None:
        self.at(self.now + delay_s, fn)

    def run(self, until: Callable[[], bool] | None = None, max_time_s: float = float("inf")) -> None:
        """Run events in time order until none is left, ``until()`` holds after one, or the next
        is past ``max_time_s``."""
        queue = self._queue
        while queue:
            when, _, fn = queue[0]
            if when > max_time_s:
                self.now = max_time_s
                return
            heapq.heappop(queue)
            self.now = when
            fn()
            self.events_run += 1
            if until is not None and until():
                return
