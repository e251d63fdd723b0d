"""The GlobalController actor: pool membership, health checks, and the overload signal.

It polls every worker's ``stats`` on its own thread; a worker that misses ``failure_threshold``
checks in a row (or whose actor is gone) is marked dead. Fronts read one ``snapshot`` per
interval instead of asking every worker themselves, and refuse new work (429) while the
cluster's waiting queues exceed ``max_waiting``. Admission with KV reservation and failure
recovery (re-running a dead worker's requests) build on this.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger("baton.controller")


@dataclass
class Member:
    """What the controller knows about one worker."""

    worker_id: str
    role: str
    alive: bool = True
    misses: int = 0
    last_seen: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)


class GlobalController:
    """Membership and health of the pools (plain class; ``cluster.launcher`` makes it an actor)."""

    def __init__(self, max_waiting: int, interval_s: float = 1.0, timeout_s: float = 5.0,
                 failure_threshold: int = 2) -> None:
        self.max_waiting = max_waiting
        self.interval_s, self.timeout_s, self.failure_threshold = interval_s, timeout_s, failure_threshold
        self._handles: dict[str, Any] = {}
        self._members: dict[str, Member] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health", daemon=True)
        self._thread.start()

    def register(self, worker_id: str, role: str, handle: Any) -> None:
        with self._lock:
            self._handles[worker_id] = handle
            self._members[worker_id] = Member(worker_id, role, last_seen=time.monotonic())

    def snapshot(self) -> dict[str, Any]:
        """Members with their last stats, plus whether the cluster should refuse new work now."""
        with self._lock:
            members = {wid: asdict(m) for wid, m in self._members.items()}
        waiting = sum(int(m["stats"].get("num_waiting", 0)) for m in members.values() if m["alive"])
        return {"members": members, "num_waiting": waiting, "overloaded": waiting >= self.max_waiting}

    def mark_dead(self, worker_id: str) -> None:
        """A front saw the worker fail: stop routing to it without waiting for the next check."""
        with self._lock:
            if worker_id in self._members:
                self._members[worker_id].alive = False

    def shutdown(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        import ray

        while not self._stop.wait(self.interval_s):
            with self._lock:
                handles = dict(self._handles)
            refs = {wid: h.stats.remote() for wid, h in handles.items()}
            for wid, ref in refs.items():
                try:
                    stats, ok = ray.get(ref, timeout=self.timeout_s), True
                except Exception:  # timeout or dead actor
                    stats, ok = None, False
                with self._lock:
                    m = self._members[wid]
                    if ok and stats.get("alive", True):
                        m.misses, m.last_seen, m.stats = 0, time.monotonic(), stats
                    else:
                        m.misses += 1
                        if m.alive and m.misses >= self.failure_threshold:
                            log.error("worker %s failed %d health checks: marked dead", wid, m.misses)
                            m.alive = False
