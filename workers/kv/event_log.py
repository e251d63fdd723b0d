"""A worker's prefix-cache events, numbered, for routers that mirror its cache.

The block pool's events (``workers.kv.events``) land here on the engine thread. Readers on other
threads (routers, through the Worker's ``kv_events`` RPC) ask for everything after the last
sequence number they applied. A reader whose cursor is older than what the log still holds, or
that knows another epoch (this engine restarted), gets a full resync instead: the hashes cached
now, which the log mirrors so a resync never has to stop the engine thread.

Events carry only block hashes: a router compares a prompt's hash chain against them and never
needs the tokens again.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from dataclasses import dataclass, field

from baton_serve.workers.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"


@dataclass(frozen=True)
class KVEventBatch:
    """The answer to ``since``: numbered events after a cursor, or a resync.

    ``events`` holds ``(seq, kind, hashes)`` tuples in order, kinds ``stored``/``removed``/
    ``cleared``. When ``resync`` is set, ``hashes`` is the whole cache as of ``seq`` and the
    reader replaces what it knew; ``reason`` says why (``epoch`` or ``gap``).
    """

    epoch: str
    seq: int
    events: list[tuple[int, str, list[bytes]]] = field(default_factory=list)
    resync: bool = False
    hashes: list[bytes] = field(default_factory=list)
    reason: str = ""


class KVEventLog:
    """Numbers a worker's cache events, keeps the last ``capacity`` and mirrors the cached set."""

    def __init__(self, capacity: int = 4096) -> None:
        self.epoch = uuid.uuid4().hex[:12]  # a new engine is a new epoch: readers resync
        self.capacity = capacity
        self._events: deque[tuple[int, str, list[bytes]]] = deque(maxlen=capacity)
        self._cached: set[bytes] = set()
        self._seq = 0
        self._lock = threading.Lock()

    @property
    def seq(self) -> int:
        return self._seq

    def __call__(self, event: KVEvent) -> None:
        """The block pool's event sink (engine thread)."""
        if isinstance(event, BlockStored):
            kind, hashes = STORED, list(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            kind, hashes = REMOVED, list(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            kind, hashes = CLEARED, []
        else:
            raise TypeError(f"not a KV event: {event!r}")
        with self._lock:
            if kind == STORED:
                self._cached.update(hashes)
            elif kind == REMOVED:
                self._cached.difference_update(hashes)
            else:
                self._cached.clear()
            self._seq += 1
            self._events.append((self._seq, kind, hashes))

    def since(self, epoch: str | None, seq: int) -> KVEventBatch:
        """Events after ``seq`` of ``epoch``; a resync when the epoch differs or events were dropped."""
        with self._lock:
            if epoch != self.epoch or seq > self._seq:
                return self._resync("epoch")
            oldest = self._events[0][0] if self._events else self._seq + 1
            if seq < oldest - 1:
                return self._resync("gap")
            skip = seq - oldest + 1 if self._events else 0
            events = [self._events[i] for i in range(max(skip, 0), len(self._events))]
            return KVEventBatch(self.epoch, self._seq, events)

    def cached(self) -> set[bytes]:
        """The hashes cached now (a copy)."""
        with self._lock:
            return set(self._cached)

    def _resync(self, reason: str) -> KVEventBatch:
        return KVEventBatch(self.epoch, self._seq, resync=True, hashes=sorted(self._cached), reason=reason)
