"""A JSON-lines record of routing decisions, for studying a policy after a run (``[router]
decision_log``): per decision, what every candidate looked like (its prefix match, queue, running
sequences, free blocks and rate fits) and, where the policy priced them, every option's cost; per
request, the TTFT it then had. The policies' metrics say how often each reason won; this says why.

Each front appends whole lines to one file (``O_APPEND``: lines from several fronts do not
interleave), so a run's log is read as one stream ordered by ``t`` within each front.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from baton_serve.router.routing.base import Candidates, Decision, RouteRequest


class DecisionLog:
    """Appends ``decision`` and ``ttft`` records to ``path``; ``close`` ends it (idempotent)."""

    def __init__(self, path: str, front_id: str) -> None:
        self.path, self.front_id = path, front_id
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def decision(self, request_id: str, policy: str, request: RouteRequest, candidates: Candidates,
                 decision: Decision, rerouted: bool = False) -> None:
        """One routing decision and the view it was made on."""
        workers = [_worker_view(w, candidates) for w in (*candidates.first, *candidates.decode)]
        self._write({"kind": "decision", "id": request_id, "policy": policy, "reason": decision.reason,
                     "first": decision.first.worker_id,
                     "decode": decision.decode.worker_id if decision.decode is not None else None,
                     "matched_blocks": decision.matched_blocks, "estimated_ttft_s": decision.estimated_ttft_s,
                     "prompt_len": request.prompt_len, "block_size": request.block_size,
                     "max_tokens": request.max_tokens, "rerouted": rerouted,
                     "options": [list(o) for o in decision.considered], "workers": workers})

    def ttft(self, request_id: str, seconds: float) -> None:
        """The measured time to first token of a request logged by ``decision``."""
        self._write({"kind": "ttft", "id": request_id, "ttft_s": round(seconds, 6)})

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def _write(self, record: dict[str, Any]) -> None:
        line = json.dumps({"t": round(time.monotonic(), 6), "front": self.front_id, **record}) + "\n"
        with self._lock:
            if self._fd is not None:
                os.write(self._fd, line.encode())


def _worker_view(worker: Any, candidates: Candidates) -> dict[str, Any]:
    load = worker.load
    return {"id": worker.worker_id, "role": worker.role, "matched": candidates.matched(worker),
            "cached": candidates.cached(worker), "stale": worker.worker_id in candidates.stale,
            "pending_prefill": load.pending_prefill, "pending_requests": load.pending_requests,
            "running": load.running, "decode_left": load.decode_tokens_left,
            "free_blocks": load.num_free_blocks, "demand": round(load.demand, 4),
            # the worker's own fits ([s a step, s a unit], None: unmeasured): the step fit's term where
            # it has one, else the interval fit; ``cost`` pools them over workers of one hardware (and role)
            "prefill_fit": load.fit("prefill"), "decode_fit": load.fit("decode"), "ship_fit": load.fit("ship"),
            "hardware": load.hardware,
            "step_fit": [load.step.overhead, load.step.per_prefill_token, load.step.per_decode_seq,
                         load.step.prefill_fitted, load.step.decode_fitted],
            "interval_fits": {k: [c.fixed, c.per_unit, c.fitted] for k, c in
                              (("prefill", load.prefill), ("decode", load.decode))}}
