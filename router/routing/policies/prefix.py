"""``prefix``: longest prefix match unless the pool is out of balance (SGLang's cache-aware policy,
the one Ray Serve's prefix-affinity router also follows); the baseline ``cost`` is measured against.

Balanced pool: the worker holding the longest cached prefix, when it covers more than
``cache_threshold`` of the prompt; else the worker whose cache holds least (SGLang's "smallest
tree", Ray Serve's "lowest prefix cache utilization"), so new prefixes spread over the caches; the
least loaded among equals. Out of balance (the busiest worker has ``balance_abs_threshold`` more
requests in flight than the idlest *and* ``balance_rel_threshold`` times as many): the least
loaded, whatever it holds. Defaults are SGLang's.
"""

from __future__ import annotations

import random
from typing import Any

from baton_serve.router.routing.base import Candidates, Decision, RouteRequest, RoutingPolicy, register_policy


@register_policy
class PrefixAffinity(RoutingPolicy):
    """Cache affinity with a load threshold, for each pool in turn."""

    name = "prefix"

    def __init__(self, cache_threshold: float = 0.5, balance_abs_threshold: int = 32,
                 balance_rel_threshold: float = 1.5, seed: int | None = None) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._rng = random.Random(seed)

    def _imbalanced(self, pool: list[Any]) -> bool:
        loads = [w.load.outstanding for w in pool]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def _least_loaded(self, pool: list[Any]) -> Any:
        best = min(w.load.outstanding for w in pool)
        return self._rng.choice([w for w in pool if w.load.outstanding == best])

    def _pick(self, request: RouteRequest, pool: list[Any], candidates: Candidates) -> tuple[Any, str]:
        if len(pool) > 1 and self._imbalanced(pool):
            return self._least_loaded(pool), "imbalance"
        longest = max(candidates.matched(w) for w in pool)
        if longest * request.block_size > self.cache_threshold * request.prompt_len:
            holders = [w for w in pool if candidates.matched(w) == longest]
            return self._least_loaded(holders), "prefix"
        smallest = min(candidates.cached(w) for w in pool)
        return self._least_loaded([w for w in pool if candidates.cached(w) == smallest]), "cold"

    def route(self, request: RouteRequest, candidates: Candidates) -> Decision:
        first, reason = self._pick(request, candidates.first, candidates)
        decode = self._pick(request, candidates.decode, candidates)[0] if candidates.decode else None
        return Decision(first, decode, reason, candidates.matched(first))
