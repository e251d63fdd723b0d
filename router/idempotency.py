"""The store behind the ``Idempotency-Key`` header: one recorded response per (tenant scope, key).

A retry while the first run is live attaches to it and replays its chunks (from the start or after a
``Last-Event-ID`` index); a retry after it finished replays the stored result; nothing is generated
twice for one key. Single event loop: every method runs on the loop that serves the HTTP layer and
never awaits while it mutates state, so no thread locks are needed (or safe to call from threads).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

MAX_KEY_LEN = 255


class IdempotencyConflict(Exception):
    """The key was already used with a different request body (the HTTP layer answers 422)."""


class IdempotencyStoreFull(Exception):
    """Every entry is a live run, so none can be evicted (the HTTP layer answers 429)."""


class RecordedResponse:
    """One response being recorded: status and headers once, then body chunks, then finished.

    Each chunk is one SSE event, or the whole JSON body of a non-streamed response; its list index is
    the event id a client sends back as ``Last-Event-ID``.
    """

    def __init__(self, grace_s: float = 5.0, on_abandoned: Callable[[], object] | None = None) -> None:
        self.status: int = 0
        self.headers: dict[str, str] = {}
        self.media_type: str = ""
        self.chunks: list[str] = []
        self.finished: bool = False
        self.failed: bool = False
        self.grace_s = grace_s
        # runs at most once, when nobody listened for grace_s; the HTTP layer aborts generation there
        self.on_abandoned = on_abandoned
        self._listeners = 0
        self._abandoned = False
        self._grace_timer: asyncio.TimerHandle | None = None
        self._started = asyncio.Event()
        # replaced on every change, so a waiter grabbed before awaiting cannot miss a wake-up
        self._changed = asyncio.Event()
        # set by the store: called once with keep=False when the entry must be dropped
        self._on_end: Callable[[bool], None] | None = None

    @property
    def started(self) -> bool:
        return self._started.is_set()

    @property
    def listeners(self) -> int:
        """Active replay iterators plus writers between ``attach()`` and ``detach()``."""
        return self._listeners

    def start(self, status: int, headers: dict[str, str], media_type: str) -> None:
        """Record the status line and headers; must come before any ``append``."""
        if self.started:
            raise RuntimeError("RecordedResponse.start called twice")
        self.status, self.headers, self.media_type = status, dict(headers), media_type
        self._started.set()

    def append(self, chunk: str) -> None:
        """Record one body chunk and wake every replayer."""
        if not self.started:
            raise RuntimeError("RecordedResponse.append before start")
        if self.finished:
            raise RuntimeError("RecordedResponse.append after finish")
        self.chunks.append(chunk)
        self._notify()

    def finish(self) -> None:
        """Mark the body complete; idempotent. The store keeps the entry until its TTL runs out."""
        if self.finished:
            return
        self._end(keep=True)

    def fail(self, status: int, body: str, media_type: str = "application/json") -> None:
        """End the run with an error; no-op once finished.

        Before any chunk was sent the error becomes the whole response and the store drops the entry,
        so a retry generates anew (429/503 stay retryable). After streaming began, status and headers
        are already on the wire: ``body`` is appended as the last event and the run is kept as is.
        """
        if self.finished:
            return
        if self.chunks:
            if body:
                self.chunks.append(body)
            self._end(keep=True)
            return
        self.status, self.headers, self.media_type, self.failed = status, {}, media_type, True
        self.chunks.append(body)
        self._started.set()
        self._end(keep=False)

    async def wait_for(self, count: int, timeout_s: float) -> None:
        """Return once ``count`` chunks are recorded, the run finished, or ``timeout_s`` passed."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            changed = self._changed  # before the check: a change right after it still wakes us
            left = deadline - asyncio.get_running_loop().time()
            if len(self.chunks) >= count or self.finished or left <= 0:
                return
            try:
                await asyncio.wait_for(changed.wait(), left)
            except asyncio.TimeoutError:
                return

    async def wait_started(self) -> None:
        """Return once ``start`` (or ``fail``) recorded a status."""
        await self._started.wait()

    async def replay(self, after: int = -1) -> AsyncIterator[tuple[int, str]]:
        """Yield (index, chunk) for every chunk with index > ``after``, waiting for new ones until finished.

        Counts as a listener from the first ``__anext__`` until it ends or is closed; close it
        (``contextlib.aclosing``) when the client goes away rather than leave it to the GC.
        """
        self.attach()
        try:
            i = after + 1
            while True:
                while i < len(self.chunks):
                    yield i, self.chunks[i]
                    i += 1
                if self.finished:
                    return
                await self._changed.wait()
        finally:
            self.detach()

    def attach(self) -> None:
        """Count one more listener; cancels a pending abandonment."""
        self._listeners += 1
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None

    def detach(self) -> None:
        """Count one listener less; the last one leaving a live run starts the grace timer."""
        if self._listeners <= 0:
            raise RuntimeError("RecordedResponse.detach without a matching attach")
        self._listeners -= 1
        if self._listeners == 0 and not self.finished and not self._abandoned:
            loop = asyncio.get_running_loop()
            self._grace_timer = loop.call_later(self.grace_s, self._grace_over)

    @contextlib.contextmanager
    def listening(self) -> Iterator[RecordedResponse]:
        """``attach()`` for the duration of a ``with`` block (the original writer's connection)."""
        self.attach()
        try:
            yield self
        finally:
            self.detach()

    def _grace_over(self) -> None:
        self._grace_timer = None
        if self._listeners or self.finished or self._abandoned:
            return
        self._abandoned = True
        if self.on_abandoned is not None:
            self.on_abandoned()

    def _end(self, keep: bool) -> None:
        self.finished = True
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None
        self._notify()
        if self._on_end is not None:
            self._on_end(keep)

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


@dataclass
class _Entry:
    fingerprint: str
    run: RecordedResponse
    finished_at: float | None = None


class IdempotencyStore:
    """Runs by (scope, key): live ones never expire nor get evicted; finished ones live ``ttl_s``.

    Beyond ``max_entries`` the earliest-finished entry is evicted first (the same order TTL expiry
    takes); when every entry is live, ``begin`` raises ``IdempotencyStoreFull``.
    """

    def __init__(self, ttl_s: float = 3600.0, max_entries: int = 10000, grace_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 seconds, got {ttl_s}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if not grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0 seconds, got {grace_s}")
        self.ttl_s, self.max_entries, self.grace_s = ttl_s, max_entries, grace_s
        self._clock = clock
        self._entries: dict[tuple[str, str], _Entry] = {}
        # finished keys in finish order; a monotonic clock makes it finished_at order too
        self._finished: OrderedDict[tuple[str, str], None] = OrderedDict()

    def begin(self, scope: str, key: str, fingerprint: str) -> tuple[RecordedResponse, bool]:
        """Return (run, created): created=False means attach to (replay) the run already there.

        Raises ``IdempotencyConflict`` when ``key`` was used with another fingerprint in ``scope``,
        ``IdempotencyStoreFull`` when no entry can be evicted, ``ValueError`` for a malformed key.
        """
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_LEN:
            length = len(key) if isinstance(key, str) else type(key).__name__
            raise ValueError(f"Idempotency-Key must be 1 to {MAX_KEY_LEN} characters, got {length}")
        self._expire()
        k = (scope, key)
        entry = self._entries.get(k)
        if entry is not None:
            if entry.fingerprint != fingerprint:
                raise IdempotencyConflict(
                    f"Idempotency-Key {key!r} was already used with a different request body")
            return entry.run, False
        if len(self._entries) >= self.max_entries:
            if not self._finished:
                raise IdempotencyStoreFull(
                    f"all {self.max_entries} idempotency entries are live runs; retry later")
            oldest, _ = self._finished.popitem(last=False)
            del self._entries[oldest]
        run = RecordedResponse(grace_s=self.grace_s)
        entry = _Entry(fingerprint, run)
        run._on_end = lambda keep: self._ended(k, entry, keep)
        self._entries[k] = entry
        return run, True

    def get(self, scope: str, key: str) -> RecordedResponse | None:
        """The run recorded under (scope, key), if it is still kept (for another front's replay)."""
        self._expire()
        entry = self._entries.get((scope, key))
        return entry.run if entry is not None else None

    @staticmethod
    def fingerprint(body: bytes, path: str) -> str:
        """sha256 of the path and the canonical JSON of the body (raw bytes when it is not JSON)."""
        try:
            canon = json.dumps(json.loads(body), sort_keys=True, separators=(",", ":"),
                               ensure_ascii=False).encode()
        except ValueError:  # JSONDecodeError and UnicodeDecodeError both
            # cannot collide with a canonical form: that one always parses, these bytes do not
            canon = body
        h = hashlib.sha256(path.encode())
        h.update(b"\0")  # a NUL cannot occur in a request path, so path/body never run together
        h.update(canon)
        return h.hexdigest()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def stats(self) -> dict[str, int]:
        """Entry counts: live runs and finished (replayable) ones."""
        self._expire()
        finished = len(self._finished)
        return {"live": len(self._entries) - finished, "finished": finished}

    def _ended(self, k: tuple[str, str], entry: _Entry, keep: bool) -> None:
        if self._entries.get(k) is not entry:
            return
        if keep:
            entry.finished_at = self._clock()
            self._finished[k] = None
        else:
            del self._entries[k]

    def _expire(self) -> None:
        now = self._clock()
        while self._finished:
            k = next(iter(self._finished))
            finished_at = self._entries[k].finished_at
            if finished_at is None or now - finished_at < self.ttl_s:
                break
            del self._finished[k]
            del self._entries[k]
