"""``round_robin``: cycle through each pool in worker-id order (a baseline for benchmarks)."""

from __future__ import annotations

from typing import Any

from baton_serve.router.routing.base import Candidates, Decision, RouteRequest, RoutingPolicy, register_policy


@register_policy
class RoundRobin(RoutingPolicy):
    """Each pool has its own turn counter, so prefill and decode both spread evenly."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turn = {"first": 0, "decode": 0}

    def _next(self, pool: list[Any], which: str) -> Any:
        ordered = sorted(pool, key=lambda w: w.worker_id)
        self._turn[which] += 1
        return ordered[(self._turn[which] - 1) % len(ordered)]

    def route(self, request: RouteRequest, candidates: Candidates) -> Decision:
        first = self._next(candidates.first, "first")
        decode = self._next(candidates.decode, "decode") if candidates.decode else None
        return Decision(first, decode, "round_robin", candidates.matched(first))
