"""``cost`` (the default): the (prefill, decode) pair with the earliest estimated completion.

For every pair: the prefill worker's time to first token (its queue plus the prompt's part it
does not hold) + the KV shipment (the blocks the decode worker does not hold) + the output at the
decode worker's step time with one more sequence + the uncached prefill once more, for the
requests that will queue behind it (``work_weight``) + the cached blocks it would evict on
either worker, at their prefill cost (``evict_weight``) + on workers that take turns at shared cores, the core
time it adds there, taken from the requests of the busy ones (``share_weight``). A prefix
match is worth the prefill it saves (twice, with the default weight), so a holder loses the
request only when its queue costs more than that: no hotspot, and no cold copy of a prefix for a
queue a step deep.

Conditional disaggregation: a decode worker may also prefill the prompt itself (nothing shipped)
when the part of the prompt it lacks takes no longer to compute there (in steps that also decode
its running sequences) than the prefill pool would add to it: the shipment, the wait in the
prefill worker's queue, and the part of the prompt that worker lacks beyond that tail (the
threshold in tokens follows from the same fits; Dynamo's rule is a fixed length and a maximum
prefill queue). A prefill worker busy with a long prompt then does not hold up the short tails of
prefixes a decode worker holds, and a prefix that only decode workers still hold is not computed
again in the prefill pool. It is one more candidate, paying for the stall its running sequences
suffer while it prefills.
Candidates within ``tie_tolerance`` of the best are tied, and a tie is broken at random.

Placing a new prefix (no worker holds any of the prompt): among candidates within
``placement_tolerance`` of the best, the worker whose cache can take the most more prompts like
it without evicting (SGLang's and Ray Serve's "smallest tree" rule, in whole prompts). Where a
prefix lands decides every later request's hits, while the estimates of identical idle workers
differ by their rate fits' noise (10-30%) or not at all: left to a coin toss, four of eight
system prompts landed on one worker while another got no request all run.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from baton_serve.router.routing.base import Candidates, Decision, RouteRequest, RoutingPolicy, register_policy
from baton_serve.router.routing.cost_model import CostModel

_Option = tuple[float, float, Any, Any | None, float]  # (cost, ttft, first, decode, room penalty in cost)


@register_policy
class CompletionCost(RoutingPolicy):
    """Joint choice of (prefill, decode), or a decode worker alone, by estimated completion time."""

    name = "cost"

    def __init__(self, stall_weight: float = 1.0, work_weight: float = 1.0, evict_weight: float = 1.0,
                 share_weight: float = 1.0, conditional_disaggregation: bool = True, tie_tolerance: float = 0.01,
                 placement_tolerance: float = 0.25, step_fit: bool = False, pool_fits: bool = True,
                 seed: int | None = None) -> None:
        self.model = CostModel(stall_weight, work_weight, evict_weight, share_weight, step_fit, pool_fits)
        self.conditional_disaggregation = conditional_disaggregation
        self.tie_tolerance = tie_tolerance
        self.placement_tolerance = placement_tolerance
        self._rng = random.Random(seed)

    def route(self, request: RouteRequest, candidates: Candidates) -> Decision:
        with self.model.deciding():
            return self._route(request, candidates)

    def _route(self, request: RouteRequest, candidates: Candidates) -> Decision:
        pool = candidates.first + candidates.decode
        m, out = self.model, request.max_tokens
        options: list[_Option] = []
        if not candidates.decode:  # colocated: prefill and decode in one place
            for w in candidates.first:
                hit = candidates.matched(w)
                ttft = m.ttft_s(w, request, hit, pool)
                decoding = m.decode_s(w, out, pool)
                penalty = m.room_penalty_s(w, request, hit)
                cost = (ttft + decoding + m.stall_s(w, request, hit, pool)
                        + m.board_s(w, m.stepping_s(w, request.uncached(hit), out, pool), pool)
                        + m.work_s(w, request, hit, pool) + penalty
                        + m.evict_s(w, request, hit, candidates.cached(w), pool))
                options.append((cost, ttft, w, None, penalty))
        else:
            decode_s = {d.worker_id: m.decode_s(d, out, pool) for d in candidates.decode}
            board_s = {d.worker_id: m.board_s(d, m.stepping_s(d, 0, out, pool), pool) for d in candidates.decode}
            # the prompt's blocks a decode worker lacks take room there: on a full cache they evict
            # prefixes it holds, which later requests then ship whole again or wait for room
            evict_d = {d.worker_id: m.evict_s(d, request, candidates.matched(d), candidates.cached(d), pool)
                       for d in candidates.decode}
            penalty_d = {d.worker_id: m.room_penalty_s(d, request, candidates.matched(d)) for d in candidates.decode}
            # per decode worker, what its side adds to a pair's price; the shipment depends on it
            # only through the blocks it holds, so each prefill worker prices one per hit length
            sides = [(d, candidates.matched(d), decode_s[d.worker_id], board_s[d.worker_id], evict_d[d.worker_id],
                      penalty_d[d.worker_id]) for d in candidates.decode]
            for p in candidates.first:
                hit_p = candidates.matched(p)
                ttft = m.ttft_s(p, request, hit_p, pool)
                # the prompt's KV stays cached where it was prefilled: its evictions count there
                work = (m.work_s(p, request, hit_p, pool)
                        + m.board_s(p, m.stepping_s(p, request.uncached(hit_p), 0, pool), pool)
                        + m.evict_s(p, dataclasses.replace(request, max_tokens=0), hit_p, candidates.cached(p), pool))
                head = ttft + work
                shipped: dict[int, float] = {}  # by the decode worker's hit: head + the shipment
                for d, hit_d, decoding, board, evict, penalty in sides:
                    base = shipped.get(hit_d)
                    if base is None:
                        base = shipped[hit_d] = head + m.ship_s(p, request, hit_d, pool)
                    options.append((base + decoding + board + evict + penalty, ttft, p, d, penalty))
            if self.conditional_disaggregation:
                # each prefill worker's side of the gate, but for the tail it would compute anyway
                lacks_p = [(p, m.queue_s(p, pool) + m.prefill_s(p, request.uncached(candidates.matched(p)), pool))
                           for p in candidates.first]
                gates: dict[int, float] = {}  # the prefill pool's side, by the decode worker's hit
                for d in candidates.decode:
                    hit_d = candidates.matched(d)
                    uncached = request.uncached(hit_d)
                    # a candidate where computing the tail here takes no longer than what the
                    # prefill pool adds to it: the shipment, the wait in a prefill worker's queue,
                    # and the part of the prompt it lacks beyond this tail (a prefix that decode
                    # workers still hold and no prefill worker does is not computed again there)
                    here = m.queue_s(d, pool) + m.prefill_s(d, uncached, pool) + m.decoding_s(d, uncached, pool)
                    gate = gates.get(hit_d)
                    if gate is None:
                        gate = gates[hit_d] = min(lacks + m.ship_s(p, request, hit_d, pool)
                                                  - m.prefill_s(p, uncached, pool) for p, lacks in lacks_p)
                    if here > gate:
                        continue
                    ttft = m.ttft_s(d, request, hit_d, pool)
                    penalty = penalty_d[d.worker_id]
                    cost = (ttft + decode_s[d.worker_id] + m.stall_s(d, request, hit_d, pool)
                            + m.board_s(d, m.stepping_s(d, uncached, out, pool), pool)
                            + m.work_s(d, request, hit_d, pool) + penalty + evict_d[d.worker_id])
                    options.append((cost, ttft, d, None, penalty))
        tied = self._within(options, self.tie_tolerance)
        roomy = self._roomiest(request, candidates, options, tied)
        _, ttft, first, decode, _ = self._rng.choice(roomy or tied)
        reason = "cache_room" if roomy else self._reason(first, decode, candidates)
        considered = [(f.worker_id, d.worker_id if d is not None else None, cost, est)
                      for cost, est, f, d, _ in options]
        return Decision(first, decode, reason, candidates.matched(first), ttft, considered)

    def _roomiest(self, request: RouteRequest, candidates: Candidates, options: list[_Option],
                  tied: list[_Option]) -> list[_Option] | None:
        """For a prompt no worker holds any of: the options near the best whose caches can take the
        most more prompts like it without evicting (the prefill side first, then the decode side),
        where some of the tied best ones can take fewer; None where room does not decide."""
        blocks = len(request.block_hashes)  # what the prompt leaves cached where it is prefilled
        workers = candidates.first + candidates.decode
        if self.placement_tolerance <= 0 or not blocks or any(candidates.matched(w) for w in workers):
            return None
        # in whole prompts: caches a few blocks apart are equals, and the estimates decide
        fits = {w.worker_id: self.model.empty_blocks(w, candidates.cached(w)) // blocks for w in workers}

        def room(o: _Option) -> tuple[int, int]:
            first = fits[o[2].worker_id]
            return first, fits[o[3].worker_id] if o[3] is not None else first

        near = self._within(options, self.placement_tolerance)
        most = max(room(o) for o in near)
        if most[0] < 1 or all(room(o) == most for o in tied):
            return None
        return self._within([o for o in near if room(o) == most], self.tie_tolerance)

    @staticmethod
    def _within(options: list[_Option], tolerance: float) -> list[_Option]:
        """The options within ``tolerance`` of the cheapest, relative to its cost without a room
        penalty: where every decode worker is full the penalty is in every price, and 1% of it
        would tie options seconds apart."""
        best = min(options, key=lambda o: o[0])
        margin = tolerance * (best[0] - best[4])
        return [o for o in options if o[0] <= best[0] + margin + 1e-6]

    @staticmethod
    def _reason(first: Any, decode: Any | None, candidates: Candidates) -> str:
        if decode is None and candidates.decode:
            return "local_prefill"
        longest = max(candidates.matched(w) for w in candidates.first)
        if longest == 0:
            return "load"  # nothing cached anywhere: the queues decided
        return "prefix" if candidates.matched(first) == longest else "hotspot_avoided"
