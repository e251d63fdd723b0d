"""Who is admitted next: waiting-queue policies chosen by name (``fcfs``, ``priority`` or ``fair``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # annotations only: config.py imports POLICY_NAMES from here without torch
    from baton_serve.workers.engine.request import Request


class WaitingQueue(Protocol):
    """Holds requests not running; ``peek`` names the next one to admit without removing it.

    ``peek`` is side-effect free: the scheduler may peek and then not admit (no KV space). When it
    does admit the peeked request it calls ``admitted`` then ``remove``; ``remove`` alone (an abort)
    takes a request out without charging anyone.
    """

    def push(self, request: Request) -> None: ...
    def push_front(self, request: Request) -> None: ...
    def peek(self, now: float) -> Request: ...
    def admitted(self, request: Request) -> None: ...
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

    def admitted(self, request: Request) -> None:
        """No accounting to do."""

    def remove(self, request: Request) -> None:
        if self._queue and self._queue[0] is request:
            self._queue.popleft()
        else:
            self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


def _check_aging(aging_seconds: float) -> None:
    if aging_seconds <= 0:
        raise ValueError(f"aging_seconds must be > 0, got {aging_seconds}")


class PriorityAgingQueue:
    """Lowest ``priority`` value first (vLLM's convention), with aging so nothing starves.

    A request's effective priority drops by one for every ``aging_seconds`` it has waited, so
    a low-priority request eventually overtakes a stream of newer high-priority ones.
    Preempted requests keep their original arrival time, which already puts them ahead.
    """

    def __init__(self, aging_seconds: float) -> None:
        _check_aging(aging_seconds)
        self.aging_seconds = aging_seconds
        self._items: list[Request] = []

    def _key(self, r: Request, now: float) -> tuple[float, float]:
        return (r.priority - (now - r.arrival_time) / self.aging_seconds, r.arrival_time)

    def push(self, request: Request) -> None:
        self._items.append(request)

    push_front = push

    def peek(self, now: float) -> Request:
        return min(self._items, key=lambda r: self._key(r, now))

    def admitted(self, request: Request) -> None:
        """No accounting to do."""

    def remove(self, request: Request) -> None:
        self._items.remove(request)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)


def _cost(r: Request) -> int:
    """What admitting ``r`` charges its tenant: the positions it still has to compute."""
    return max(1, r.num_tokens - r.num_computed_tokens)


@dataclass
class _Tenant:
    queue: deque[Request] = field(default_factory=deque)  # oldest first
    deficit: int = 0


class _Round:
    """Deficit round robin over the tenants of one priority class.

    ``order[0]`` is the tenant whose turn it is and ``granted`` says whether it has had this turn's
    quantum. A tenant in the round always has waiting requests; one that empties leaves it, and its
    deficit with it.
    """

    def __init__(self, quantum: int) -> None:
        self.quantum = quantum
        self.tenants: dict[str, _Tenant] = {}
        self.order: deque[str] = deque()
        self.granted = False

    def push(self, r: Request, front: bool) -> None:
        t = self.tenants.get(r.tenant)
        if t is None:  # (re)joins at the end of the round with nothing saved
            t = self.tenants[r.tenant] = _Tenant()
            self.order.append(r.tenant)
        if front:
            t.queue.appendleft(r)
        else:
            t.queue.append(r)

    def remove(self, r: Request) -> None:
        t = self.tenants[r.tenant]
        q = t.queue
        del q[next(i for i, x in enumerate(q) if x is r)]
        if q:
            return
        del self.tenants[r.tenant]
        if self.order[0] == r.tenant:
            self.order.popleft()
            self.granted = False  # the next tenant's turn starts with its quantum
        else:
            self.order.remove(r.tenant)

    def _positions(self) -> Iterator[tuple[str, int]]:
        """Each tenant with the visit (1 = the next) at which it next gets a quantum."""
        n = len(self.order)
        for i, name in enumerate(self.order):
            yield name, (n if i == 0 else i) if self.granted else i + 1

    def plan(self) -> tuple[str, int]:
        """The tenant served next and on which visit (0: the turn in progress), without changing anything.

        A tenant whose head costs ``c`` with deficit ``d`` needs ``max(1, ceil((c - d) / quantum))``
        visits, one every ``len(order)``; the first to be covered wins (visits are all distinct).
        """
        cur = self.tenants[self.order[0]]
        if self.granted and cur.deficit >= _cost(cur.queue[0]):
            return self.order[0], 0
        n = len(self.order)
        best: tuple[str, int] | None = None
        for name, pos in self._positions():
            t = self.tenants[name]
            visits = max(1, -(-(_cost(t.queue[0]) - t.deficit) // self.quantum))
            visit = (visits - 1) * n + pos
            if best is None or visit < best[1]:
                best = (name, visit)
        assert best is not None  # a class in use has a tenant
        return best

    def peek(self) -> Request:
        return self.tenants[self.plan()[0]].queue[0]

    def charge(self, r: Request) -> None:
        """Play the round forward to ``r``'s tenant's turn, then take ``r``'s cost from its deficit.

        A request taken out of turn (not what ``peek`` names) is charged without moving the round.
        """
        name, visit = self.plan()
        if visit and self.tenants[name].queue[0] is r:
            n = len(self.order)
            for other, pos in list(self._positions()):
                if pos <= visit:
                    self.tenants[other].deficit += ((visit - pos) // n + 1) * self.quantum
            self.order.rotate(-self.order.index(name))
            self.granted = True
        self.tenants[r.tenant].deficit -= _cost(r)


class FairShareQueue:
    """Priority classes with aging as in ``PriorityAgingQueue``; tenants share a class by deficit
    round robin (Shreedhar & Varghese, "Efficient fair queuing using deficit round robin", 1995)
    counted in tokens.

    The best class is the one whose oldest request has the lowest aged priority. Inside it each
    tenant (``Request.tenant``; "" is one tenant) with waiting requests has a deficit; every visit
    of the round adds ``quantum_tokens`` and a tenant's turn lasts while its deficit covers its
    oldest request's cost (positions still to compute). So from when two tenants start waiting, as
    long as both still wait, their admitted tokens differ by at most a quantum plus one request.

    Accounting happens in ``admitted`` only. A preempted request (``push_front``) goes back to the
    head of its tenant, which keeps its place in the round, and is charged again when readmitted.
    """

    def __init__(self, aging_seconds: float, quantum_tokens: int = 512) -> None:
        _check_aging(aging_seconds)
        if quantum_tokens <= 0:
            raise ValueError(f"quantum_tokens must be > 0, got {quantum_tokens}")
        self.aging_seconds = aging_seconds
        self.quantum_tokens = quantum_tokens
        self._classes: dict[int, _Round] = {}
        self._len = 0

    def _push(self, r: Request, front: bool) -> None:
        cls = self._classes.get(r.priority)
        if cls is None:
            cls = self._classes[r.priority] = _Round(self.quantum_tokens)
        cls.push(r, front)
        self._len += 1

    def push(self, request: Request) -> None:
        self._push(request, front=False)

    def push_front(self, request: Request) -> None:
        self._push(request, front=True)

    def peek(self, now: float) -> Request:
        def key(item: tuple[int, _Round]) -> tuple[float, float]:
            oldest = min(r.arrival_time for t in item[1].tenants.values() for r in t.queue)
            return (item[0] - (now - oldest) / self.aging_seconds, oldest)

        return min(self._classes.items(), key=key)[1].peek()

    def admitted(self, request: Request) -> None:
        """Charge ``request``'s tenant; call while it is still queued, before ``remove``."""
        self._classes[request.priority].charge(request)

    def remove(self, request: Request) -> None:
        cls = self._classes[request.priority]
        cls.remove(request)
        if not cls.tenants:
            del self._classes[request.priority]
        self._len -= 1

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        return (r for cls in self._classes.values() for t in cls.tenants.values() for r in t.queue)


_POLICIES: dict[str, Callable[[float, int], WaitingQueue]] = {
    "fcfs": lambda aging, quantum: FCFSQueue(),
    "priority": lambda aging, quantum: PriorityAgingQueue(aging),
    "fair": FairShareQueue,
}
POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)


def make_waiting_queue(policy: str, aging_seconds: float, quantum_tokens: int = 512) -> WaitingQueue:
    """The queue for ``policy`` (one of ``POLICY_NAMES``); ``quantum_tokens`` is used by ``fair`` only."""
    try:
        make = _POLICIES[policy]
    except KeyError:
        raise ValueError(f"scheduling policy must be one of {', '.join(map(repr, POLICY_NAMES))}, "
                         f"got {policy!r}") from None
    return make(aging_seconds, quantum_tokens)
