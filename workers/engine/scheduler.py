"""The scheduler tick: which requests run in the next forward and how many tokens each.

One rule covers prefill, chunked prefill, prefix hits and resumption after preemption: a
request computes ``num_tokens - num_computed_tokens`` positions, as many as the token budget
allows this tick. Running requests are served first; waiting ones are admitted while the
budget, ``max_num_seqs`` and the KV cache allow. When blocks run out, the lowest-priority
running request is preempted by recompute (its blocks freed, its counters reset).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from baton_serve.workers.blocks.manager import BlockManager
from baton_serve.workers.engine.config import SchedulerConfig
from baton_serve.workers.engine.request import Request, RequestStatus
from baton_serve.workers.engine.swap import HostBlockPool
from baton_serve.workers.engine.waiting_queue import WaitingQueue, make_waiting_queue


@dataclass
class ScheduledRequest:
    """A request and the number of positions it computes this tick."""

    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this tick reaches the end of the request's tokens, so a token is sampled."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    """What one tick decided: decodes (one new token each) listed before prefill chunks."""

    decodes: list[ScheduledRequest] = field(default_factory=list)
    prefills: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        return self.decodes + self.prefills

    @property
    def num_batched_tokens(self) -> int:
        return len(self.decodes) + sum(s.num_new_tokens for s in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    """Continuous batching with chunked prefill under a per-tick token budget.

    Mechanism (blocks) lives in ``BlockManager``; the choice of whom to admit next and whom to
    preempt is the waiting-queue policy and the running order (priority, then arrival).
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 host_pool: HostBlockPool | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock  # what arrival order, aging and finish times are read on
        self.block_manager = block_manager
        self.host_pool = host_pool  # swap space; None: every preemption recomputes
        self.waiting: WaitingQueue = make_waiting_queue(config.policy, config.aging_seconds,
                                                          quantum_tokens=config.fair_quantum_tokens)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # total since start, for metrics and tests

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def finish(self, request: Request, status: RequestStatus) -> bool:
        """Move a request to a terminal state and free what it holds. Idempotent: False if already done."""
        if request.request_id not in self.requests:
            return False
        del self.requests[request.request_id]
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        request.finished_time = self.clock()
        self.block_manager.free(request.request_id)
        if request.swapped_blocks and self.host_pool is not None:
            self.host_pool.free(request.swapped_blocks)
            request.swapped_blocks = []
        return True

    def detach(self, request: Request) -> None:
        """Remove a running request from scheduling but keep its KV blocks (to ship them, or paused)."""
        del self.requests[request.request_id]
        self.running.remove(request)

    def admit_running(self, request: Request) -> None:
        """Add a request whose KV is already in place (received from a prefill worker)."""
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.running.append(request)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ the tick
    def schedule(self) -> SchedulerOutput:
        """Decide the next forward. Allocates KV blocks for what it schedules."""
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        now = self.clock()
        bm = self.block_manager

        index = 0
        while index < len(self.running) and budget > 0:
            req = self.running[index]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget, cfg.max_prefill_chunk)
            while not bm.allocate(req.request_id, req.all_token_ids, req.num_computed_tokens, num_new):
                victim = self._pick_victim(index)
                self._preempt(victim, out)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled = ScheduledRequest(req, num_new)
                if num_new == 1 and req.num_computed_tokens == req.num_tokens - 1:
                    out.decodes.append(scheduled)
                else:
                    out.prefills.append(scheduled)
                budget -= num_new
                index += 1
                continue
            break  # the current request preempted itself: nothing more fits

        if not out.preempted:
            self._admit_waiting(out, budget, now)
        out.block_copies = bm.take_pending_copies()
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        cfg = self.config
        bm = self.block_manager
        while budget > 0 and len(self.running) < cfg.max_num_seqs and len(self.waiting):
            req = self.waiting.peek(now)
            if req.swapped_blocks:  # its computed KV waits in host memory: restore, don't recompute
                cached = req.num_computed_tokens
            else:
                cached = bm.find_cached_prefix(req.request_id, req.all_token_ids, req.cache_salt)
            remaining = req.num_tokens - cached
            if not cfg.enable_chunked_prefill and remaining > budget:
                break
            num_new = min(remaining, budget, cfg.max_prefill_chunk)
            if not bm.allocate(req.request_id, req.all_token_ids, cached, num_new,
                               num_cached_tokens=0 if req.swapped_blocks else cached, salt=req.cache_salt):
                break
            if req.swapped_blocks:
                table = bm.block_table(req.request_id)
                out.swap_in.extend(zip(req.swapped_blocks, table))
                self.host_pool.free(req.swapped_blocks)  # reused no earlier than the next tick
                req.swapped_blocks = []
            self.waiting.admitted(req)  # before the counters change: they are what it is charged
            self.waiting.remove(req)
            req.num_computed_tokens = cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = cached
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.prefills.append(ScheduledRequest(req, num_new))
            budget -= num_new

    def _pick_victim(self, first_unscheduled: int) -> Request:
        """Lowest-priority request not yet scheduled this tick (the current one included)."""
        candidates = self.running[first_unscheduled:]
        if self.config.policy == "fcfs":
            return candidates[-1]
        return max(candidates, key=lambda r: (r.priority, r.arrival_time))

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Free every device block and requeue at the front. With swap space, the computed KV is
        copied to host blocks first (``out.swap_out``, applied before this tick's forward) and the
        counter kept; otherwise (or when host space is short) it is recomputed later."""
        self.running.remove(req)
        bs = self.block_manager.block_size
        host = None
        if self.config.preemption_mode == "swap" and self.host_pool is not None and req.num_computed_tokens:
            table = self.block_manager.block_table(req.request_id)
            host = self.host_pool.allocate((req.num_computed_tokens + bs - 1) // bs)
            if host is not None:
                out.swap_out.extend(zip(table, host))
                req.swapped_blocks = host
        self.block_manager.free(req.request_id)
        if host is None:
            req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.push_front(req)

    # ------------------------------------------------------------------ after the forward
    def update_after_forward(self, out: SchedulerOutput) -> None:
        """Advance counters for what ran and publish newly full blocks to the prefix cache."""
        bm = self.block_manager
        for s in out.decodes:
            s.request.num_computed_tokens += s.num_new_tokens
            bm.commit_computed(s.request.request_id, s.request.all_token_ids, s.request.num_computed_tokens)
        for s in out.prefills:
            s.request.num_computed_tokens += s.num_new_tokens
            bm.commit_computed(s.request.request_id, s.request.all_token_ids, s.request.num_computed_tokens)

    def fork(self, parent: Request, child: Request) -> None:
        """Add ``child`` as a running sibling sharing all of ``parent``'s KV blocks (n > 1)."""
        self.block_manager.fork(parent.request_id, child.request_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.first_scheduled_time = parent.first_scheduled_time
        child.status = RequestStatus.RUNNING
        self.requests[child.request_id] = child
        self.running.append(child)
