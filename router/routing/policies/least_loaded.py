"""``least_loaded``: fewest requests in flight (vLLM's and Ray Serve's power-of-load default)."""

from __future__ import annotations

import random
from typing import Any

from baton_serve.router.routing.base import Candidates, Decision, RouteRequest, RoutingPolicy, register_policy


@register_policy
class LeastLoaded(RoutingPolicy):
    """Prefill: fewest outstanding, then least pending prefill work; decode: emptiest KV cache, then
    fewest outstanding. Ties are broken at random, so equal workers share the traffic."""

    name = "least_loaded"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def _pick(self, pool: list[Any], key: Any) -> Any:
        best = min(key(w) for w in pool)
        return self._rng.choice([w for w in pool if key(w) == best])

    def route(self, request: RouteRequest, candidates: Candidates) -> Decision:
        first = self._pick(candidates.first, lambda w: (w.load.outstanding, w.load.pending_prefill))
        decode = (self._pick(candidates.decode, lambda w: (round(w.load.kv_cache_usage, 2), w.load.outstanding))
                  if candidates.decode else None)
        return Decision(first, decode, "least_loaded", candidates.matched(first))
