"""Wraps an ``EngineClient`` to record request metrics from the deltas that flow through it.

TTFT, ITL, TPOT and end-to-end latency are measured here, at the front, across prefill and
decode workers: the boundary a client sees.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from baton_serve.cluster.metrics import Metrics
from baton_serve.workers.engine.outputs import TokenDelta
from baton_serve.workers.sampling.params import SamplingParams


class MeteredClient:
    """Same protocol as the wrapped client; records one observation per finished request."""

    def __init__(self, inner: Any, metrics: Metrics) -> None:
        self.inner = inner
        self.metrics = metrics

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str | None = None,
                       arrival_time: float | None = None, ticket: Any = None) -> AsyncIterator[TokenDelta]:
        arrival = arrival_time or time.monotonic()
        token_times: list[float] = []
        output_tokens = 0
        finish: str | None = None
        try:
            async for d in self.inner.generate(request_id, prompt_token_ids, params, priority, cache_salt,
                                               arrival, ticket=ticket):
                if d.token_ids:
                    now = time.monotonic()
                    if d.index == 0:  # latency metrics follow the first sample, as clients see it
                        token_times.extend([now] * len(d.token_ids))
                    output_tokens += len(d.token_ids)
                if d.finish_reason is not None and d.index == 0:
                    finish = d.finish_reason
                yield d
        finally:
            self.metrics.observe_request(arrival, token_times[0] if token_times else None, token_times,
                                         len(prompt_token_ids), output_tokens, finish)

    def abort(self, request_id: str) -> None:
        self.inner.abort(request_id)

    def finish_sample(self, request_id: str, index: int, stop: str) -> None:
        self.inner.finish_sample(request_id, index, stop)

    def stats(self) -> Any:
        return self.inner.stats()
