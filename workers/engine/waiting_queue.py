"""Who is admitted next: waiting-queue policies chosen by name (``fcfs`` or ``priority``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Protocol

from workers.engine.request import Request


class WaitingQueue(Protocol):
    """Holds requests not running; ``peek`` names the next one to admit without removing it."""

    def push(self, request: Request) -> None: ...
    def push_front(self, request: Request) -> None: ...
    def peek(self, now: float) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._queue.append(request)

    def push_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self, now: float) -> Request:
        return self._queue[0]

    def remove(self, request: Request) -> None:
        if self._queue and self._queue[0] is request:
            self._queue.popleft()
        else:
            self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityAgingQueue:
    """Lowest ``priority`` value first (vLLM's convention), with aging so nothing starves.

    A request's effective priority drops by one for every ``aging_seconds`` it has waited, so
    a low-priority request eventually overtakes a stream of newer high-priority ones.
    Preempted requests keep their original arrival time, which already puts them ahead.
    """

    def __init__(self, aging_seconds: float) -> None:
        if aging_seconds <= 0:
            raise ValueError(f"aging_seconds must be > 0, got {aging_seconds}")
        self.aging_seconds = aging_seconds
        self._items: list[Request] = []

    def _key(self, r: Request, now: float) -> tuple[float, float]:
        return (r.priority - (now - r.arrival_time) / self.aging_seconds, r.arrival_time)

    def push(self, request: Request) -> None:
        self._items.append(request)

    push_front = push

    def peek(self, now: float) -> Request:
        return min(self._items, key=lambda r: self._key(r, now))

    def remove(self, request: Request) -> None:
        self._items.remove(request)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)


def make_waiting_queue(policy: str, aging_seconds: float) -> WaitingQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityAgingQueue(aging_seconds)
    raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {policy!r}")
