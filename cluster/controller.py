"""The GlobalController actor: pool membership, health checks, worker restarts, and the overload signal.

It polls every worker's ``stats`` on its own thread; a worker that misses ``failure_threshold``
checks in a row (or whose actor is gone, or that a front saw die) is marked dead, and, where
the controller was given its ``WorkerSpec``, started again after a backoff
(``cluster.restarts``) under the same id and name, with every worker told its new handle.
Each restart gives the member a new, larger ``incarnation`` (a millisecond stamp, so it grows
across controller restarts too): fronts adopt the new actor when they see it. The controller is
itself restartable (Ray restarts it); started with its ``members``, it rebuilds its view from the
workers themselves (by name where the deployment names them), while fronts route on their last view.
Fronts read one ``snapshot`` per interval instead of asking every worker themselves, and refuse
new work (429) while the cluster's waiting queues exceed ``max_waiting``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from baton_serve.cluster.restarts import RestartHistory, RestartPolicy, WorkerSpec

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
    incarnation: int = 0  # 0: the worker the deployment started; after a restart, its millisecond stamp
    restarts: int = 0
    restarting: bool = False
    restart_at: float | None = None  # when the next restart is due (monotonic), if one is
    quarantined: bool = False
    draining: bool = False  # a role flip is under way: fronts send it no new request
    to_role: str | None = None  # the role it flips to once drained
    drain_since: float | None = None  # when the flip began (monotonic)
    role_since: float = 0.0  # when it took its role (monotonic): start, or its last flip


class GlobalController:
    """Membership and health of the pools (plain class; ``cluster.launcher`` makes it an actor)."""

    def __init__(self, max_waiting: int, interval_s: float = 1.0, timeout_s: float = 5.0,
                 failure_threshold: int = 2, restart: RestartPolicy | None = None,
                 start_timeout_s: float = 300.0, members: list[tuple[WorkerSpec, Any]] | None = None,
                 drain_grace_s: float | None = None, drain_timeout_s: float = 600.0,
                 rebalance: dict[str, Any] | None = None) -> None:
        self.max_waiting = max_waiting
        # A front routes on the last snapshot it read (one a stats interval): a drained worker
        # changes role only once every front has seen it draining and what they sent has arrived.
        self.drain_grace_s = drain_grace_s if drain_grace_s is not None else max(3 * interval_s, 2.0)
        self.drain_timeout_s = drain_timeout_s
        self.flips: list[dict[str, Any]] = []  # the role flips carried out (or given up), oldest first
        self._rebalance = None  # cluster.rebalance.live.LiveRebalance, with [rebalance] enabled
        if rebalance and rebalance.get("enabled"):
            from baton_serve.cluster.config import RebalanceSection
            from baton_serve.cluster.rebalance.live import LiveRebalance

            self._rebalance = LiveRebalance(RebalanceSection.model_validate(rebalance))
        self.interval_s, self.timeout_s, self.failure_threshold = interval_s, timeout_s, failure_threshold
        self.restart_policy = restart or RestartPolicy()
        self.start_timeout_s = start_timeout_s  # a restarted worker loads its model within this
        self._handles: dict[str, Any] = {}
        self._specs: dict[str, WorkerSpec] = {}
        self._infos: dict[str, dict[str, Any]] = {}
        self._history: dict[str, RestartHistory] = {}
        self._members: dict[str, Member] = {}
        self._flip_reasons: dict[str, str] = {}  # worker -> why its flip under way began
        self._lock = threading.Lock()
        self._stop = threading.Event()
        for spec, handle in members or ():
            self.register(spec.worker_id, spec.role, handle, spec)
        self._rebuild_pending = bool(members)
        self._thread = threading.Thread(target=self._run, name="health", daemon=True)
        self._thread.start()

    def register(self, worker_id: str, role: str, handle: Any, spec: WorkerSpec | None = None,
                 info: dict[str, Any] | None = None) -> None:
        """Watch a worker; with ``spec`` it is restarted when it dies."""
        with self._lock:
            self._handles[worker_id] = handle
            now = time.monotonic()
            self._members[worker_id] = Member(worker_id, role, last_seen=now, role_since=now)
            self._history[worker_id] = RestartHistory(self.restart_policy)
            if spec is not None:
                self._specs[worker_id] = spec
            if info is not None:
                self._infos[worker_id] = info

    def snapshot(self) -> dict[str, Any]:
        """Members with their last stats, plus whether the cluster should refuse new work now."""
        with self._lock:
            members = {wid: asdict(m) for wid, m in self._members.items()}
            flips = list(self.flips[-16:])
        waiting = sum(int(m["stats"].get("num_waiting", 0)) for m in members.values() if m["alive"])
        rebalance = self._rebalance.status() if self._rebalance is not None else {"enabled": False}
        return {"members": members, "num_waiting": waiting, "overloaded": waiting >= self.max_waiting,
                "flips": flips, "rebalance": rebalance}

    def worker(self, worker_id: str) -> tuple[int, Any, dict[str, Any]]:
        """The worker's current incarnation, actor handle and ``info`` (fronts adopt restarts)."""
        with self._lock:
            return self._members[worker_id].incarnation, self._handles[worker_id], self._infos.get(worker_id, {})

    def handles(self) -> dict[str, Any]:
        """Every worker's current actor handle (restarts replace them): for shutting down."""
        with self._lock:
            return dict(self._handles)

    def flip(self, worker_id: str, role: str, reason: str = "manual") -> None:
        """Begin moving a worker to ``role`` (prefill <-> decode): fronts stop sending it new
        requests; once its own finish (or move) and the grace has passed, it changes role in
        place. Raises ValueError for a flip that cannot be made (naming why)."""
        with self._lock:
            m = self._members.get(worker_id)
            if m is None:
                raise ValueError(f"unknown worker {worker_id!r}")
            if {m.role, role} != {"prefill", "decode"}:
                raise ValueError(f"a role flip is between prefill and decode; {worker_id} is {m.role}, "
                                 f"asked for {role!r}")
            if not m.alive or m.restarting or m.draining:
                raise ValueError(f"{worker_id} cannot flip now (alive={m.alive}, restarting={m.restarting}, "
                                 f"draining={m.draining})")
            left = [o for o in self._members.values() if o.role == m.role and o.alive and not o.draining
                    and o is not m]
            if not left:
                raise ValueError(f"{worker_id} is the last live {m.role} worker")
            m.draining, m.to_role, m.drain_since = True, role, time.monotonic()
            self._flip_reasons[worker_id] = reason
        log.info("worker %s: draining to become a %s worker (%s)", worker_id, role, reason)

    def mark_dead(self, worker_id: str, incarnation: int | None = None) -> None:
        """A front saw the worker fail: stop routing to it without waiting for the next check.
        A report about an earlier ``incarnation`` than the current one is stale and ignored."""
        with self._lock:
            m = self._members.get(worker_id)
            if m is not None and m.alive and (incarnation is None or incarnation >= m.incarnation):
                self._died(m, "a front saw it fail")

    def shutdown(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------ internals
    def _died(self, m: Member, why: str) -> None:
        """The member is dead (lock held): schedule its restart, or quarantine it."""
        m.alive = False
        if m.draining:  # its requests move as any dead worker's do; it comes back in its old role
            self.flips.append({"worker_id": m.worker_id, "from_role": m.role, "to_role": m.to_role,
                               "reason": self._flip_reasons.pop(m.worker_id, "manual"), "given_up": "died",
                               "at": time.time()})
            m.draining, m.to_role, m.drain_since = False, None, None
        now = time.monotonic()
        delay = self._history[m.worker_id].died(now) if m.worker_id in self._specs else None
        if delay is not None:
            m.restart_at = now + delay
            log.error("worker %s died (%s): restarting it in %.1fs", m.worker_id, why, delay)
        elif self._history[m.worker_id].quarantined:
            m.quarantined, m.restart_at = True, None
            p = self.restart_policy
            log.error("worker %s died (%s) %d times within %.0fs: quarantined, it will not be restarted",
                      m.worker_id, why, len(self._history[m.worker_id].deaths), p.window_s)
        else:
            log.error("worker %s died (%s); it is not restarted", m.worker_id, why)

    def _rebuild(self) -> None:
        """Learn each member's current actor, incarnation and info from the workers (at start,
        which after a crash is a restart): one that does not answer is dead, and restarted."""
        import ray

        for wid in list(self._members):
            spec = self._specs.get(wid)
            with self._lock:
                handle = self._handles[wid]
            if spec is not None and "name" in spec.options:
                try:  # a worker restarted by the controller that died is found by its name
                    handle = ray.get_actor(spec.options["name"], namespace=spec.options.get("namespace"))
                except ValueError:
                    pass
            try:
                info = ray.get(handle.info.remote(), timeout=self.timeout_s)
            except Exception as exc:
                with self._lock:
                    self._died(self._members[wid], f"no answer when the controller started: {exc!r}")
                continue
            with self._lock:
                m = self._members[wid]
                self._handles[wid], self._infos[wid] = handle, info
                m.incarnation = int(info.get("incarnation", 0))
                m.alive, m.last_seen = True, time.monotonic()
        log.info("controller: %d worker(s), %d alive", len(self._members),
                 sum(m.alive for m in self._members.values()))

    def _run(self) -> None:
        if self._rebuild_pending:
            self._rebuild()
        while not self._stop.wait(self.interval_s):
            self._check()
            self._restart_due()
            self._flips_due()
            self._rebalance_due()

    def _rebalance_due(self) -> None:
        """A rebalancing decision every ``[rebalance] interval_s`` (when enabled)."""
        import ray

        rb = self._rebalance
        if rb is None or not rb.due(time.monotonic()):
            return
        with self._lock:
            members = {wid: replace(m, stats=dict(m.stats)) for wid, m in self._members.items()}
            handles = dict(self._handles)
        try:
            rb.tick(time.monotonic(), members, handles, lambda ref: ray.get(ref, timeout=self.timeout_s), self.flip)
        except Exception:  # a bad decision must not stop health checks and restarts
            log.exception("rebalance decision failed")

    def _flips_due(self) -> None:
        """Carry out the flips whose workers have drained: the worker refuses while it holds any
        request, so an answer of False means wait; a dead worker or a drain past its timeout
        gives the flip up."""
        import ray

        now = time.monotonic()
        with self._lock:
            due = [(m.worker_id, m.to_role, self._handles[m.worker_id]) for m in self._members.values()
                   if m.draining and now - (m.drain_since or now) >= self.drain_grace_s]
        for wid, role, handle in due:
            try:
                changed = bool(ray.get(handle.set_role.remote(role), timeout=self.timeout_s))
            except Exception as exc:  # dead or unreachable: the health checks deal with it
                log.warning("worker %s: role flip to %s failed: %r", wid, role, exc)
                changed = False
            with self._lock:
                m = self._members[wid]
                if not m.draining:
                    continue
                waited = time.monotonic() - (m.drain_since or now)
                if changed:
                    old, m.role, m.role_since = m.role, role, time.monotonic()
                    spec = self._specs.get(wid)
                    if spec is not None:  # a restart brings it back in its new role
                        self._specs[wid] = replace(spec, role=role, args=(spec.args[0], role, *spec.args[2:]))
                    self.flips.append({"worker_id": wid, "from_role": old, "to_role": role,
                                       "reason": self._flip_reasons.pop(wid, "manual"),
                                       "drained_s": round(waited, 3), "at": time.time()})
                    log.info("worker %s is now a %s worker (drained in %.1fs)", wid, role, waited)
                elif m.alive and waited < self.drain_timeout_s:
                    continue
                else:
                    self.flips.append({"worker_id": wid, "from_role": m.role, "to_role": role,
                                       "reason": self._flip_reasons.pop(wid, "manual"),
                                       "given_up": "died" if not m.alive else "drain timed out",
                                       "at": time.time()})
                    log.warning("worker %s: role flip to %s given up", wid, role)
                m.draining, m.to_role, m.drain_since = False, None, None

    def _check(self) -> None:
        import ray

        with self._lock:
            handles = {wid: h for wid, h in self._handles.items()
                       if self._members[wid].alive and not self._members[wid].restarting}
        refs = {wid: h.stats.remote() for wid, h in handles.items()}
        for wid, ref in refs.items():
            try:
                stats, ok = ray.get(ref, timeout=self.timeout_s), True
            except Exception:  # timeout or dead actor
                stats, ok = None, False
            with self._lock:
                m = self._members[wid]
                if self._handles[wid] is not handles[wid]:
                    continue  # restarted meanwhile: this answer is about the old actor
                if ok and stats.get("alive", True):
                    m.misses, m.last_seen, m.stats = 0, time.monotonic(), stats
                else:
                    m.misses += 1
                    if m.alive and m.misses >= self.failure_threshold:
                        self._died(m, f"{m.misses} failed health checks")

    def _restart_due(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [m for m in self._members.values()
                   if m.restart_at is not None and m.restart_at <= now and not m.restarting]
            for m in due:
                m.restarting, m.restart_at = True, None
        for m in due:  # each on its own thread: a model load must not stall health checks
            threading.Thread(target=self._restart, args=(m.worker_id,), name=f"restart-{m.worker_id}",
                             daemon=True).start()

    def _restart(self, worker_id: str) -> None:
        import ray

        spec = self._specs[worker_id]
        with self._lock:
            old = self._handles[worker_id]
        try:
            try:
                ray.kill(old, no_restart=True)  # a hung (not dead) actor would hold the name and its KV
            except Exception:
                pass
            with self._lock:
                incarnation = max(self._members[worker_id].incarnation + 1, time.time_ns() // 1_000_000)
            handle = self._start(spec, incarnation)
            info = ray.get(handle.info.remote(), timeout=self.start_timeout_s)
            with self._lock:
                peers = {wid: h for wid, h in self._handles.items() if wid != worker_id}
            peers[worker_id] = handle
            ray.get([h.set_peers.remote(peers) for h in peers.values()], timeout=self.timeout_s * 4)
        except Exception as exc:
            with self._lock:
                m = self._members[worker_id]
                m.restarting = False
                self._died(m, f"restart failed: {exc!r}")
            return
        with self._lock:
            m = self._members[worker_id]
            self._handles[worker_id], self._infos[worker_id] = handle, info
            m.alive, m.misses, m.restarting, m.stats = True, 0, False, {}
            m.incarnation = incarnation
            m.restarts += 1
            m.last_seen = time.monotonic()
        log.warning("worker %s restarted (incarnation %d, pid %s)", worker_id, m.incarnation, info.get("pid"))

    def _start(self, spec: WorkerSpec, incarnation: int) -> Any:
        """A new actor from ``spec``, under the dead one's name once Ray has released it."""
        import ray

        options = dict(spec.options)
        if "name" in options:
            # Outlives this controller: serving must go on while a restarted controller takes over.
            options["lifetime"] = "detached"
        deadline = time.monotonic() + 30
        while True:
            try:
                return ray.remote(spec.cls).options(**options).remote(*spec.args, **spec.kwargs,
                                                                      incarnation=incarnation)
            except ValueError:  # the name is still held by the dead actor
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)
