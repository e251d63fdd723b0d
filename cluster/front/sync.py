"""What the front keeps in step with: each worker's load (from the controller's snapshots, or by
asking every worker) and the prefix index (from every worker's KV events). Loops over Ray calls;
the decisions they feed are ``routing``'s and the client's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from baton_serve.cluster.front.routing import FrontRouter
from baton_serve.cluster.front.workers import WorkerRef

log = logging.getLogger("baton.pool")


class PoolSync:
    """The stats and KV-event loops of one front over ``workers``.

    ``on_dead(worker, error)`` and ``adopt(worker)`` carry out what the controller's snapshots say
    (a worker failed its health checks, or was restarted); ``on_stats(worker, stats or None)``
    (optional) feeds metrics.
    """

    def __init__(self, workers: dict[str, WorkerRef], router: FrontRouter, controller: Any,
                 on_dead: Callable[[WorkerRef, BaseException], None], adopt: Callable[[WorkerRef], Awaitable[None]],
                 on_stats: Callable[[WorkerRef, Any], None] | None = None, events_interval_s: float = 0.25,
                 on_role: Callable[[WorkerRef, str], None] | None = None) -> None:
        self.workers = workers
        self.router = router
        self.controller = controller
        self.on_dead = on_dead
        self.adopt = adopt
        self.on_stats = on_stats
        self.on_role = on_role  # (worker, its old role) after the controller flipped it
        self.events_interval_s = events_interval_s
        self.overloaded = False  # the controller says the cluster's queues are full
        self.members: dict[str, dict[str, Any]] = {}  # the controller's last view, by worker id
        self.members_at: float | None = None  # when it came (monotonic)
        self.flips: list[dict[str, Any]] = []  # the controller's last role flips
        self.rebalance: dict[str, Any] = {"enabled": False}  # its rebalancer's counts and last decision

    async def events_loop(self) -> None:
        """Keep the prefix index in step with every live worker's KV events."""
        while True:
            alive = [w for w in self.workers.values() if w.alive]
            replies = await asyncio.gather(*(self._pull_events(w) for w in alive), return_exceptions=True)
            for w, reply in zip(alive, replies):
                if isinstance(reply, asyncio.CancelledError):
                    raise reply
                if isinstance(reply, BaseException) or reply is None:
                    continue  # no answer this time: the entries age towards expiry
                self.router.apply_events(w.worker_id, reply)
            self.router.expire(self.workers.values())
            await asyncio.sleep(self.events_interval_s)

    async def _pull_events(self, w: WorkerRef) -> Any:
        epoch, seq = self.router.index.cursor(w.worker_id)
        return await asyncio.wait_for(w.handle.kv_events.remote(epoch, seq), timeout=max(self.events_interval_s * 8, 2))

    async def stats_loop(self, interval_s: float) -> None:
        while True:
            try:
                if self.controller is not None:
                    await self._sync_from_controller(interval_s)
                else:
                    await self._poll_stats(interval_s)
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad snapshot must not stop load tracking and metrics for good
                log.exception("worker stats update failed")
            await asyncio.sleep(interval_s)

    async def _sync_from_controller(self, interval_s: float) -> None:
        try:
            snap = await asyncio.wait_for(self.controller.snapshot.remote(), timeout=max(interval_s * 5, 5))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # controller unreachable: keep the last view, routing still works
            log.warning("controller snapshot failed: %r", exc)
            return
        self.overloaded = bool(snap["overloaded"])
        self.members, self.members_at = snap["members"], time.monotonic()
        self.flips = snap.get("flips", [])
        self.rebalance = snap.get("rebalance", {"enabled": False})
        for wid, member in snap["members"].items():
            w = self.workers.get(wid)
            if w is None or member.get("incarnation", 0) < w.incarnation:
                continue  # unknown, or a view older than the restart this front already adopted
            if member["alive"] and member.get("incarnation", 0) > w.incarnation:
                await self.adopt(w)
                continue
            if w.alive and not member["alive"]:
                self.on_dead(w, RuntimeError("failed health checks"))
            w.draining = bool(member.get("draining", False))
            role = member.get("role", w.role)
            if role != w.role:  # a role flip is done: the drained worker takes requests in its new role
                old, w.role = w.role, role
                if self.on_role is not None:
                    self.on_role(w, old)
            if member["stats"]:
                w.load.update(member["stats"])
            elif w.alive:
                continue  # no check has answered yet: nothing to report
            if self.on_stats:
                self.on_stats(w, member["stats"] if w.alive else None)

    async def _poll_stats(self, interval_s: float) -> None:
        for w in list(self.workers.values()):
            if not w.alive:
                if self.on_stats:
                    self.on_stats(w, None)
                continue
            try:
                stats = await asyncio.wait_for(w.handle.stats.remote(), timeout=max(interval_s * 5, 5))
            except asyncio.CancelledError:
                raise
            except Exception:
                continue
            w.load.update(stats)
            if self.on_stats:
                self.on_stats(w, stats)
