"""Routing policies, chosen by name: which prefill (or colocated) worker and which decode worker.

Policies see only ``WorkerLoad`` summaries, never a worker's scheduler. The cache-aware router
(expected TTFT from queue + uncached prefill work) will be another class behind this protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class WorkerLoad:
    """What the front knows about a worker's load: its own count plus the last stats snapshot."""

    outstanding: int = 0  # requests this front has in flight on the worker
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0

    def update(self, stats: dict[str, Any]) -> None:
        self.num_running = int(stats.get("num_running", 0))
        self.num_waiting = int(stats.get("num_waiting", 0))
        self.kv_cache_usage = float(stats.get("kv_cache_usage", 0.0))
        self.num_free_blocks = int(stats.get("num_free_blocks", 0))


class _HasLoad(Protocol):
    worker_id: str
    load: WorkerLoad


class RoutingPolicy(Protocol):
    def choose(self, pool: list[Any], prompt_token_ids: list[int]) -> Any:
        """Pick the worker that runs the prompt (prefill or colocated)."""
        ...

    def choose_decode(self, pool: list[Any]) -> Any:
        """Pick the decode worker that continues the request."""
        ...


class LeastLoaded:
    """Fewest outstanding requests; ties go to the emptier KV cache, then the lower id."""

    def choose(self, pool: list[Any], prompt_token_ids: list[int]) -> Any:
        return min(pool, key=lambda w: (w.load.outstanding, w.load.kv_cache_usage, w.worker_id))

    def choose_decode(self, pool: list[Any]) -> Any:
        return min(pool, key=lambda w: (w.load.kv_cache_usage, w.load.outstanding, w.worker_id))


class RoundRobin:
    """Cycle through the pool (a baseline for benchmarks)."""

    def __init__(self) -> None:
        self._next = 0

    def _pick(self, pool: list[Any]) -> Any:
        ordered = sorted(pool, key=lambda w: w.worker_id)
        self._next += 1
        return ordered[(self._next - 1) % len(ordered)]

    def choose(self, pool: list[Any], prompt_token_ids: list[int]) -> Any:
        return self._pick(pool)

    def choose_decode(self, pool: list[Any]) -> Any:
        return self._pick(pool)


_POLICIES = {"least_loaded": LeastLoaded, "round_robin": RoundRobin}


def make_policy(name: str) -> RoutingPolicy:
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(f"routing policy must be one of {sorted(_POLICIES)}, got {name!r}") from None
