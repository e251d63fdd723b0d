"""The rebalancer's decision: given the window's signals and the workers, which worker changes
role, which pool grows or shrinks, or why nothing does.

Plain, synchronous code, like the front's decisions (``cluster.front``): the controller and the
simulator build a ``ClusterView`` and carry out the ``Action``s. It decides for both pools at
once; a decision is one kind of action (a flip may move several workers):

- **flip**: one pool is short (pressure above ``enter``) and the other would still have room
  without its least loaded workers (its pressure, projected on that many fewer, below ``slack``).
  How many move at once: as many as the short pool's load, shared by more workers, needs to come
  down to between ``slack`` and ``enter`` (one where only its latency is over), no more than the
  other can spare, and at most ``step_fraction`` of the two pools (at least one): a 64-worker
  cluster does not take an hour of cool-downs to follow a shift that one worker at a time would.
- **add** (with ``scale``): a pool is short, nothing can be flipped to it, it is below its ``max``
  and the cluster has room for one more worker of it.
- **remove** (with ``scale``): no pool is short and one would stay below ``slack`` with one worker
  fewer, above its ``min``.

Stability, the failure others ship (Dynamo's planner scaling 2 -> 1 -> 2, #9294): a pool gives up
a worker only where the projection on one fewer stays below ``slack`` (under ``enter`` by the
hysteresis band), so the move cannot make it short at the load that caused it; a ``cooldown_s``
after every action lets the window see its effect; a worker dwells ``min_dwell_s`` in a role
before it moves again; at most ``max_actions_per_window`` actions in any ``window_s``; and no
decision before the window holds ``min_requests`` requests.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from baton_serve.cluster.rebalance.signals import PoolSignals, Signals

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class RebalancePolicy:
    """Bounds, thresholds and the stability rules (``[rebalance]`` in the config file)."""

    window_s: float = 60.0
    cooldown_s: float = 60.0
    min_dwell_s: float = 120.0
    max_actions_per_window: int = 1
    min_requests: int = 20
    scale: bool = False  # add and remove workers within the bounds; False: only flip roles
    enter: float = 1.0  # a pool above this pressure is short
    slack: float = 0.7  # a pool gives up a worker only if it stays below this with one fewer
    step_fraction: float = 0.25  # the most workers one flip decision moves, as a share of both pools
    min_workers: dict[str, int] = field(default_factory=lambda: {"prefill": 1, "decode": 1, "colocated": 1})
    max_workers: dict[str, int | None] = field(default_factory=dict)  # None or absent: no bound

    def __post_init__(self) -> None:
        if not 0 < self.slack < self.enter:
            raise ValueError(f"need 0 < slack < enter, got slack={self.slack}, enter={self.enter}")
        if not 0 < self.step_fraction <= 1:
            raise ValueError(f"step_fraction must be in (0, 1], got {self.step_fraction}")
        if self.max_actions_per_window < 0 or self.min_requests < 0:
            raise ValueError("max_actions_per_window and min_requests must be >= 0")
        for name in ("window_s", "cooldown_s", "min_dwell_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for role, n in list(self.min_workers.items()) + list(self.max_workers.items()):
            if role not in ROLES:
                raise ValueError(f"unknown pool {role!r}; known: {', '.join(ROLES)}")
            if n is not None and n < 0:
                raise ValueError(f"bounds of {role} must be >= 0, got {n}")
        for role, hi in self.max_workers.items():
            if hi is not None and hi < self.min_workers.get(role, 0):
                raise ValueError(f"{role}: max {hi} is below min {self.min_workers.get(role, 0)}")

    def lower(self, role: str) -> int:
        return self.min_workers.get(role, 1)

    def upper(self, role: str) -> float:
        hi = self.max_workers.get(role)
        return float("inf") if hi is None else hi


@dataclass(frozen=True)
class WorkerView:
    """One worker as the rebalancer sees it."""

    worker_id: str
    role: str
    since: float  # when it took this role (started, or last flipped)
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    draining: bool = False  # an action on it is under way


@dataclass(frozen=True)
class ClusterView:
    """What one decision sees: the time, the workers, and which pools the cluster can grow now."""

    now: float
    workers: list[WorkerView]
    can_add: dict[str, bool] = field(default_factory=dict)  # free resources (or an autoscaler) per pool

    def pool(self, role: str) -> list[WorkerView]:
        return [w for w in self.workers if w.role == role]


@dataclass(frozen=True)
class Action:
    """``flip``: ``worker_id`` moves to ``role``; ``add``: a new worker of ``role``; ``remove``:
    ``worker_id`` (of ``role``) leaves. One decision may flip several workers, an action each."""

    kind: str
    role: str
    worker_id: str | None
    reason: str


@dataclass(frozen=True)
class RebalanceDecision:
    """One decision, with its reason and the inputs it read (logged whole)."""

    at: float
    actions: list[Action]
    reason: str  # the action's, or why there is none (cooldown, within_band, ...)
    pressures: dict[str, float]
    inputs: dict[str, Any]


class Rebalancer:
    """Decides from ``Signals`` and a ``ClusterView``; remembers its own past actions (cool-down,
    the per-window cap), nothing else."""

    def __init__(self, policy: RebalancePolicy = RebalancePolicy()) -> None:
        self.policy = policy
        self._acted: deque[float] = deque()  # when each past action was decided
        self.decisions: deque[RebalanceDecision] = deque(maxlen=64)  # the last ones, for status

    def decide(self, signals: Signals, view: ClusterView) -> RebalanceDecision:
        """One decision at ``view.now``; its actions are to be carried out (or, dry run, logged)."""
        decision = self._decide(signals, view)
        if decision.actions:
            self._acted.append(view.now)
        self.decisions.append(decision)
        return decision

    def _decide(self, signals: Signals, view: ClusterView) -> RebalanceDecision:
        p, now = self.policy, view.now
        pools = {role: signals.pools[role] for role in ROLES if role in signals.pools and view.pool(role)}
        pressures = {role: round(s.pressure, 4) for role, s in pools.items()}
        inputs = _inputs(signals, pools)

        def hold(reason: str) -> RebalanceDecision:
            return RebalanceDecision(now, [], reason, pressures, inputs)

        def act(*actions: Action) -> RebalanceDecision:
            return RebalanceDecision(now, list(actions), actions[0].reason, pressures, inputs)

        while self._acted and self._acted[0] < now - p.window_s:
            self._acted.popleft()
        if any(w.draining for w in view.workers):
            return hold("action_in_progress")
        if self._acted and now - self._acted[-1] < p.cooldown_s:
            return hold("cooldown")
        if len(self._acted) >= p.max_actions_per_window:
            return hold("action_cap")
        if signals.requests < p.min_requests:
            return hold("too_few_requests")
        short = sorted((r for r in pools if pools[r].pressure > p.enter), key=lambda r: -pools[r].pressure)
        for role in short:
            room = p.upper(role) - len(view.pool(role))
            if room <= 0:
                continue
            for donor in pools:
                if donor == role or "colocated" in (donor, role):
                    continue
                spare = self._spare(view, donor, pools[donor])
                if spare:
                    cap = max(1, int(p.step_fraction * (len(view.pool(role)) + len(view.pool(donor)))))
                    k = min(len(spare), room, cap, self._needed(pools[role], len(view.pool(role))))
                    return act(*(Action("flip", role, w.worker_id, f"{role}_pressure") for w in spare[:k]))
            if p.scale and view.can_add.get(role, False):
                return act(Action("add", role, None, f"{role}_pressure"))
        if short:
            return hold("short_at_bounds")
        if not p.scale:
            return hold("within_band")
        for role in sorted(pools, key=lambda r: pools[r].pressure):
            spare = self._spare(view, role, pools[role])
            if spare:
                return act(Action("remove", role, spare[0].worker_id, f"{role}_slack"))
        return hold("within_band")

    def _spare(self, view: ClusterView, role: str, pool: PoolSignals) -> list[WorkerView]:
        """The workers ``role``'s pool can give up with room to spare, least loaded first: the pool
        stays at or above its minimum and below ``slack`` on that many fewer, and each has dwelt."""
        p = self.policy
        members = view.pool(role)
        if (pool.latency_pressure or 0.0) >= p.slack:
            return []
        k = 0
        while len(members) - (k + 1) >= p.lower(role) and pool.projected(len(members) - (k + 1)) < p.slack:
            k += 1
        ready = [w for w in members if view.now - w.since >= p.min_dwell_s and not w.draining]
        # the least loaded leave: the fewest requests to finish or move, the least cache to lose
        return sorted(ready, key=lambda w: (w.running + w.waiting, w.kv_usage, w.worker_id))[:k]

    def _needed(self, pool: PoolSignals, workers: int) -> int:
        """Workers to add to a short pool: as many as bring its load part, shared by more, to the
        middle of the band; one where only its latency is over (latency does not project: a
        queue's wait falls much faster than the load once there is room, so scaling by it
        overshoots)."""
        aim = (self.policy.enter + self.policy.slack) / 2
        k = 1
        while pool.projected(workers + k) > aim and k < 1024:
            k += 1
        return k


def _inputs(signals: Signals, pools: dict[str, PoolSignals]) -> dict[str, Any]:
    """What a decision read, for its log line: the window's shape and each pool's signals."""
    out: dict[str, Any] = {"requests": signals.requests, "arrival_rate": round(signals.arrival_rate, 4),
                           "prompt_p50": signals.prompt_p50, "prompt_p90": signals.prompt_p90,
                           "uncached_p90": signals.uncached_p90, "output_p50": signals.output_p50,
                           "output_p90": signals.output_p90}
    for role, s in pools.items():
        out[role] = {"workers": s.workers, "latency_s": s.latency_s, "attainment": s.attainment,
                     "busy": round(s.busy_fraction, 4), "kv_usage": round(s.kv_usage, 4),
                     "waiting": round(s.waiting, 3), "latency_pressure": s.latency_pressure,
                     "load_pressure": round(s.load_pressure, 4)}
    return out
