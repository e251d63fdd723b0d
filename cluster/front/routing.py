"""The front's routing decision as plain code: from the live workers, the prefix index and a
request, the policy's ``Decision`` (which prefill and decode worker, or a local prefill) and the
prompt's block hashes. No Ray, sockets or asyncio: the live client and the simulator call it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from baton_serve.cluster.front.placement import Placement
from baton_serve.cluster.front.workers import CacheLayout, WorkerRef
from baton_serve.router.prefix_index import PrefixIndex
from baton_serve.router.routing import Candidates, Decision, RouteRequest, RoutingPolicy
from baton_serve.router.routing.cost_model import CostModel
from baton_serve.router.routing.decision_log import DecisionLog
from baton_serve.workers.blocks.prefix_hash import block_hashes
from baton_serve.workers.engine.validation import RequestLimits
from baton_serve.workers.errors import OverloadedError
from baton_serve.workers.sampling.params import SamplingParams

log = logging.getLogger("baton.pool")


def output_budget(limits: RequestLimits, prompt_len: int, params: SamplingParams) -> int:
    """Each sample's output budget: ``max_tokens``, capped by the context left after the prompt."""
    room = limits.max_model_len - prompt_len
    return max(min(params.max_tokens if params.max_tokens is not None else room, room), 1)


class FrontRouter:
    """Routes requests by ``policy`` over the workers the front knows, with ``index`` (the prefix
    index it keeps in step with the workers' KV events) telling what each one holds.

    ``colocated``: the workers do both phases. ``metrics`` and ``decision_log`` (optional) record
    each decision; ``clock`` is the time the index's predictions age by (the simulator's virtual
    clock there).
    """

    def __init__(self, policy: RoutingPolicy, limits: RequestLimits, layout: CacheLayout, index: PrefixIndex,
                 colocated: bool = False, metrics: Any = None, decision_log: DecisionLog | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.limits = limits
        self.layout = layout
        self.index = index
        self.colocated = colocated  # the workers do both phases: no pair to choose
        self.metrics = metrics
        self.decision_log = decision_log
        self.clock = clock
        self._estimator = CostModel()  # TTFT estimates for policies that do not make their own
        self._roots: dict[str | None, bytes] = {}

    @property
    def block_size(self) -> int:
        return self.layout.block_size or 16

    def prompt_hashes(self, prompt_token_ids: list[int], salt: str | None) -> list[bytes]:
        """The chain hashes of the prompt's blocks a worker's cache could cover (never the last token)."""
        ns = self.layout.namespace
        if ns is None:
            return []
        root = self._roots.get(salt)
        if root is None:
            if len(self._roots) > 1024:  # salts are per tenant or per client: keep the memo bounded
                self._roots.clear()
            root = self._roots[salt] = ns.root_hash(salt)
        return block_hashes(root, prompt_token_ids, self.layout.block_size, stop=len(prompt_token_ids) - 1)

    def route(self, workers: Iterable[WorkerRef], prompt_token_ids: list[int], salt: str | None,
              params: SamplingParams, keeper: str | None = None, log_as: str = "") -> tuple[Decision, list[bytes]]:
        """The policy's decision among the live ``workers``, and the prompt's block hashes (for
        renewing the index's prediction). Raises OverloadedError when a pool has no live worker.

        ``keeper``: the worker that must hold the KV (where stage 2 reserved it). ``log_as``: the
        request's id in the decision log.
        """
        alive = [w for w in workers if w.alive]
        # a draining worker takes no new request (it still counts for its prefixes), but one whose
        # KV room stage 2 reserved before the drain began still goes to it
        open_ = [w for w in alive if not w.draining or w.worker_id == keeper]
        if self.colocated:
            first, decode = [w for w in open_ if w.role == "colocated" and keeper in (None, w.worker_id)], []
            if not first:
                raise OverloadedError("no colocated worker is alive", retry_after_s=5.0)
        else:
            first = [w for w in open_ if w.role == "prefill"]
            decode = [w for w in open_ if w.role == "decode" and keeper in (None, w.worker_id)]
            if not first or not decode:
                raise OverloadedError("a pool has no live worker", retry_after_s=5.0)
        hashes = self.prompt_hashes(prompt_token_ids, salt)
        now = self.clock()
        index = self.index
        matched = index.match([w.worker_id for w in alive], hashes, now) if hashes else {}
        stale = {w.worker_id for w in alive if index.is_stale(w.worker_id)}
        max_tokens = params.max_tokens if params.max_tokens is not None else self.limits.max_model_len
        request = RouteRequest(len(prompt_token_ids), hashes, self.block_size,
                               max(min(max_tokens, self.limits.max_model_len - len(prompt_token_ids)), 1) * params.n,
                               self.layout.kv_block_bytes)
        held = {w.worker_id: index.held(w.worker_id, now) for w in alive}
        candidates = Candidates(first, decode, matched, stale, held)
        decision = self.policy.route(request, candidates)
        if decision.estimated_ttft_s is None:
            decision.estimated_ttft_s = self._estimator.ttft_s(decision.first, request, decision.matched_blocks,
                                                               alive)
        if self.decision_log is not None:
            self.decision_log.decision(log_as, self.policy.name, request, candidates, decision,
                                       rerouted=keeper is not None)
        # The chosen workers will hold these blocks in a moment: later requests sharing the prefix
        # follow this one instead of waiting for the events that say so.
        for w in (decision.first, decision.decode):
            if w is not None and hashes:
                index.predict(w.worker_id, hashes, now)
        if self.metrics is not None:
            self.metrics.observe_route(self.policy.name, decision.reason,
                                       decision.matched_blocks * self.layout.block_size, len(prompt_token_ids))
        return decision, hashes

    def prefilled(self, placed: Placement, produced_token: bool) -> None:
        """``placed``'s first worker is past the prompt (with a token, or it ended there): its load
        follows, and the index's prediction outlives the prefill, however long it queued, until
        the workers' events confirm the blocks."""
        placed.first_token()
        if produced_token and placed.hashes:
            now = self.clock()
            for w in (placed.first, placed.decode):
                if w is not None:
                    self.index.predict(w.worker_id, placed.hashes, now)

    def observe_ttft(self, log_as: str, placed: Placement, ttft_s: float) -> None:
        """A first placement's measured time to first token, against the estimate it was routed by."""
        if self.metrics is not None:
            self.metrics.observe_route_ttft(self.policy.name, placed.estimated_ttft_s, ttft_s)
        if self.decision_log is not None:
            self.decision_log.ttft(log_as, ttft_s)

    def apply_events(self, worker_id: str, batch: Any) -> None:
        """A worker's KV events (a ``KVEventBatch``) into the index; a resync is logged and counted."""
        reason = self.index.apply(worker_id, batch, self.clock())
        if reason is None:
            return
        if reason != "epoch" or self.index.resyncs(worker_id) > 1:
            log.info("prefix index: %s resync from worker %s", reason, worker_id)
        if self.metrics is not None:
            self.metrics.observe_index_resync(worker_id, reason)

    def expire(self, workers: Iterable[WorkerRef]) -> None:
        """Drop what the index knows of workers silent for its ``ttl_s``, and report its state."""
        now = self.clock()
        for wid in self.index.expire(now):
            log.warning("prefix index: no KV events from worker %s for %.0fs: its entries expired",
                        wid, self.index.ttl_s)
        if self.metrics is not None:
            for w in workers:
                self.metrics.observe_index(w.role, w.worker_id, self.index.size(w.worker_id),
                                           self.index.lag_s(w.worker_id, now), self.index.is_stale(w.worker_id))
