"""When the controller restarts a dead worker, and when it gives up on one (quarantine).

A worker that dies is restarted after a backoff that doubles with each death inside the window
(capped); one that dies more than ``max_restarts`` times inside the window is quarantined: it
keeps crashing (a bad node, a poisoned model folder), and restarting it forever would only
churn the cluster.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class WorkerSpec:
    """How to start one worker actor again: its Ray options and constructor arguments."""

    worker_id: str
    role: str
    cls: type  # the actor's class (``workers.actor.worker.Worker``)
    options: dict[str, Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RestartPolicy:
    """Backoff and cap for restarts of one worker (``[recovery]`` in the config)."""

    enabled: bool = True
    max_restarts: int = 5
    window_s: float = 600.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def delay_s(self, deaths_in_window: int) -> float:
        """Seconds to wait before restart number ``deaths_in_window`` (1 for the first death)."""
        return min(self.backoff_s * 2 ** max(deaths_in_window - 1, 0), self.max_backoff_s)


@dataclass
class RestartHistory:
    """The deaths of one worker, and what the policy decides about the latest."""

    policy: RestartPolicy
    deaths: deque[float] = field(default_factory=deque)
    quarantined: bool = False

    def died(self, now: float) -> float | None:
        """Record a death at ``now``; the restart delay, or None when the worker is quarantined
        (or restarts are off)."""
        self.deaths.append(now)
        while self.deaths and now - self.deaths[0] > self.policy.window_s:
            self.deaths.popleft()
        if not self.policy.enabled or self.quarantined:
            return None
        if len(self.deaths) > self.policy.max_restarts:
            self.quarantined = True
            return None
        return self.policy.delay_s(len(self.deaths))
