"""The router's global prefix index: which worker holds which prefix-cache blocks.

Fed by every worker's numbered KV events (``workers.kv.event_log``); a worker that restarted
(new epoch) or whose events the router fell behind on answers with a full resync, which replaces
what the index knew of it. A worker whose events have not arrived for ``ttl_s`` is *stale*: its
entries are dropped and it matches nothing until it answers again, so routing never leans on a
cache that may be gone.

Besides what workers reported, the index remembers for ``predict_ttl_s`` the blocks of prompts
it has just routed (``predict``): events arrive a poll interval after the prefill, and a burst
of requests sharing a new prefix should follow the first one rather than scatter. Lookups follow
a prompt's hash chain and stop at the first missing block, which is exactly what the worker's
own ``find_cached_prefix`` does.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from baton_serve.workers.kv.event_log import CLEARED, REMOVED, STORED


@dataclass
class _WorkerEntries:
    epoch: str | None = None
    seq: int = 0
    hashes: set[bytes] = field(default_factory=set)
    predicted: dict[bytes, float] = field(default_factory=dict)  # hash -> expiry (monotonic)
    last_update: float | None = None  # when events last arrived (None: never)
    stale: bool = True
    resyncs: int = 0


class PrefixIndex:
    """Per-worker sets of cached block hashes, kept in step with the workers' event logs."""

    def __init__(self, ttl_s: float = 10.0, predict_ttl_s: float = 2.0) -> None:
        self.ttl_s = ttl_s
        self.predict_ttl_s = predict_ttl_s
        self._workers: dict[str, _WorkerEntries] = {}

    # ------------------------------------------------------------------ feeding
    def cursor(self, worker_id: str) -> tuple[str | None, int]:
        """What to ask ``worker_id`` for next: events after ``(epoch, seq)``."""
        w = self._workers.get(worker_id)
        return (w.epoch, w.seq) if w is not None else (None, 0)

    def apply(self, worker_id: str, batch: Any, now: float | None = None) -> str | None:
        """Apply a ``KVEventBatch`` from ``worker_id``; returns the resync reason, or None.

        A batch whose events do not continue the cursor (a gap) is refused: the cursor is reset so
        the next ask gets a resync. Returns ``"gap"`` then.
        """
        now = time.monotonic() if now is None else now
        w = self._workers.setdefault(worker_id, _WorkerEntries())
        if batch.resync:
            w.epoch, w.seq, w.hashes = batch.epoch, batch.seq, set(batch.hashes)
            w.resyncs += 1
            reason = batch.reason or "resync"
        else:
            if batch.epoch != w.epoch or (batch.events and batch.events[0][0] != w.seq + 1):
                w.epoch, w.seq = None, 0  # the next ask resyncs
                return "gap"
            for seq, kind, hashes in batch.events:
                if kind == STORED:
                    w.hashes.update(hashes)
                    for h in hashes:
                        w.predicted.pop(h, None)
                elif kind == REMOVED:
                    w.hashes.difference_update(hashes)
                    for h in hashes:
                        w.predicted.pop(h, None)
                elif kind == CLEARED:
                    w.hashes.clear()
                    w.predicted.clear()
                w.seq = seq
            w.seq = max(w.seq, batch.seq)
            reason = None
        w.last_update, w.stale = now, False
        return reason

    def predict(self, worker_id: str, hashes: Sequence[bytes], now: float | None = None) -> None:
        """Remember that ``worker_id`` is about to cache ``hashes`` (a prompt just routed there)."""
        now = time.monotonic() if now is None else now
        w = self._workers.setdefault(worker_id, _WorkerEntries())
        expiry = now + self.predict_ttl_s
        for h in hashes:
            if h not in w.hashes:
                w.predicted[h] = expiry

    def remove(self, worker_id: str) -> None:
        """Forget a worker (it died or left the pool)."""
        self._workers.pop(worker_id, None)

    def expire(self, now: float | None = None) -> list[str]:
        """Mark workers without events for ``ttl_s`` stale and drop their entries; returns them."""
        now = time.monotonic() if now is None else now
        newly = []
        for wid, w in self._workers.items():
            if w.last_update is not None and not w.stale and now - w.last_update > self.ttl_s:
                w.stale, w.hashes, w.epoch, w.seq = True, set(), None, 0
                w.predicted.clear()
                newly.append(wid)
            if w.predicted and len(w.predicted) > 256:
                w.predicted = {h: t for h, t in w.predicted.items() if t > now}
        return newly

    # ------------------------------------------------------------------ queries
    def match(self, worker_ids: Iterable[str], hashes: Sequence[bytes],
              now: float | None = None) -> dict[str, int]:
        """Leading blocks of the chain ``hashes`` each worker holds (0 for stale or unknown ones)."""
        now = time.monotonic() if now is None else now
        out: dict[str, int] = {}
        for wid in worker_ids:
            w = self._workers.get(wid)
            n = 0
            if w is not None:
                for h in hashes:
                    if h in w.hashes or w.predicted.get(h, 0.0) > now:
                        n += 1
                    else:
                        break
            out[wid] = n
        return out

    def is_stale(self, worker_id: str) -> bool:
        w = self._workers.get(worker_id)
        return w is None or w.stale

    def size(self, worker_id: str) -> int:
        """Blocks the index holds for ``worker_id`` as reported (predictions not counted)."""
        w = self._workers.get(worker_id)
        return len(w.hashes) if w is not None else 0

    def held(self, worker_id: str, now: float | None = None) -> int:
        """Blocks ``worker_id`` holds or is about to: as reported, plus unexpired predictions (a
        prompt routed there a moment ago fills its cache before its events say so)."""
        w = self._workers.get(worker_id)
        if w is None:
            return 0
        now = time.monotonic() if now is None else now
        return len(w.hashes) + sum(1 for expiry in w.predicted.values() if expiry > now)

    def lag_s(self, worker_id: str, now: float | None = None) -> float | None:
        """Seconds since ``worker_id``'s events last arrived (None: never)."""
        w = self._workers.get(worker_id)
        if w is None or w.last_update is None:
            return None
        return (time.monotonic() if now is None else now) - w.last_update

    def resyncs(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)
        return w.resyncs if w is not None else 0
