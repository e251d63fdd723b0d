"""Stage 2 of admission: a KV reservation on the worker that will hold the request's cache.

After tokenization and routing the exact prompt length is known. The request's worst case (prompt
plus ``max_tokens`` per sample, or ``reserve_fraction`` of the output part, preemption being the
safety net) is reserved in the ledger of the decode (or colocated) worker it was routed to, within
its tenant's KV-block budget and concurrency limit. The prompt's full blocks, named by their
chain hashes, are charged once per ledger however many live reservations share them (the worker's
prefix cache holds them once); tenant budgets still count each request's whole demand.
Reservation is not allocation: the worker's scheduler still allocates blocks tick by tick; the
ledger only keeps admitted work from oversubscribing the cache. The outcome comes from an admission policy chosen by name
(``admission_policies``): admit, queue (bounded per priority class, with a deadline), degrade
(``max_tokens`` capped to what fits, when the tenant allows it), or reject (429 with a
``Retry-After`` from the measured drain rate).

A front reserves from its share of each worker's blocks (``1/num_fronts`` of them), so fronts
need no round trip to agree, and a request alone in an empty ledger is always admitted: one that
fits no share still runs, as it would without admission.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from baton_serve.cluster.admission.gate import AdmissionError
from baton_serve.cluster.admission.tenants import Tenant
from baton_serve.workers.engine.reservation import ReservationLedger
from baton_serve.workers.registry import Registry

_RATE_WINDOW_S = 30.0


@dataclass
class KVDemand:
    """What one engine request asks of stage 2."""

    request_id: str
    tenant: Tenant
    prompt_tokens: int
    max_tokens: int
    n: int
    priority: int
    # Chain hashes of the prompt's full blocks in the worker's cache namespace: reservations naming
    # the same ones share those blocks in a ledger, as they share them in the worker's cache.
    prefix_hashes: tuple[bytes, ...] = ()


@dataclass
class Reservation:
    """A held reservation: where, how many blocks, and the output budget it was sized for."""

    worker_id: str
    blocks: int
    max_tokens: int
    degraded: bool = False
    queued_s: float = 0.0
    n: int | None = None  # set when degraded to fewer samples than asked


@dataclass
class Fit:
    """One worker's room for a demand, as a policy sees it."""

    worker_id: str
    free_blocks: int
    empty: bool


@dataclass
class Outcome:
    """A policy's answer: admit on ``worker_id`` (maybe with ``max_tokens`` or ``n`` capped), queue,
    or reject."""

    action: str  # admit | queue | reject
    worker_id: str | None = None
    max_tokens: int | None = None  # set when degraded
    n: int | None = None  # set when degraded


class AdmissionPolicy:
    """Decides one demand given each candidate worker's room; ``name`` registers it."""

    name = ""

    def decide(self, demand: KVDemand, fits: list[Fit], need: Callable[..., int], preferred: str | None,
               tenant_ok: bool) -> Outcome:
        raise NotImplementedError


_REGISTRY: Registry[type[AdmissionPolicy]] = Registry("admission policy")  # built-ins: defined below
register_admission_policy = _REGISTRY.register


def admission_policies() -> list[str]:
    """The registered admission policy names."""
    return _REGISTRY.names()


def make_admission_policy(name: str) -> AdmissionPolicy:
    return _REGISTRY.get(name)()


@register_admission_policy
class ReservePolicy(AdmissionPolicy):
    """Admit where the worst case fits (the routed worker first), else degrade if allowed (fewer
    samples of ``n``, else a smaller ``max_tokens``), else queue."""

    name = "reserve"
    min_degraded_tokens = 16  # capping below this helps nobody: queue instead

    def decide(self, demand: KVDemand, fits: list[Fit], need: Callable[..., int], preferred: str | None,
               tenant_ok: bool) -> Outcome:
        if not tenant_ok:
            return Outcome("queue")
        blocks = need(demand.max_tokens)
        ordered = sorted(fits, key=lambda f: (f.worker_id != preferred, -f.free_blocks))
        for f in ordered:
            if f.empty or f.free_blocks >= blocks:
                return Outcome("admit", f.worker_id)
        if demand.tenant.allow_degrade and ordered:
            best = max(ordered, key=lambda f: f.free_blocks)
            # Fewer whole answers before shorter ones: each sample that runs gets its full budget.
            samples = next((k for k in range(demand.n - 1, 0, -1)
                            if need(demand.max_tokens, k) <= best.free_blocks), None)
            if samples is not None:
                return Outcome("admit", best.worker_id, n=samples)
            tokens = _tokens_fitting(best.free_blocks, demand.max_tokens, need)
            if tokens >= min(self.min_degraded_tokens, demand.max_tokens):
                return Outcome("admit", best.worker_id, max_tokens=tokens)
        return Outcome("queue")


@register_admission_policy
class UnlimitedPolicy(AdmissionPolicy):
    """Admit everything on the routed worker (the engine's own scheduler and preemption decide);
    reservations are still kept, so the ledger metrics show the oversubscription."""

    name = "unlimited"

    def decide(self, demand: KVDemand, fits: list[Fit], need: Callable[..., int], preferred: str | None,
               tenant_ok: bool) -> Outcome:
        return Outcome("admit", preferred or (fits[0].worker_id if fits else None))


def _tokens_fitting(free_blocks: int, max_tokens: int, need: Callable[[int], int]) -> int:
    lo, hi = 0, max_tokens  # the largest output budget whose blocks fit: need() grows with it
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if need(mid) <= free_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(order=True)
class Waiter:
    """A demand queued for KV room, in priority then arrival order. ``admitted(outcome)`` or
    ``failed(error)`` is called once when it leaves the queue other than by ``dequeue``."""

    priority: int
    seq: int
    demand: KVDemand = field(compare=False)
    allowed: Callable[[], list[str]] = field(compare=False)
    preferred: Callable[[], str | None] = field(compare=False)
    admitted: Callable[[Outcome], None] = field(compare=False)
    failed: Callable[[BaseException], None] = field(compare=False)
    done: bool = field(default=False, compare=False)


class KVAdmission:
    """The ledgers of one front: per worker, per tenant, and the queue of demands that did not fit.

    Single event loop (the front's). ``on_queue(depths)`` and ``on_ledger(worker_id, reserved,
    capacity)`` feed metrics.
    """

    def __init__(self, capacities: dict[str, int], block_size: int, share: float = 1.0,
                 policy: AdmissionPolicy | str = "reserve", reserve_fraction: float = 1.0,
                 queue_timeout_s: float = 30.0, max_queued_per_class: int = 256,
                 on_queue: Callable[[dict[int, int]], None] | None = None,
                 on_ledger: Callable[[str, int, int], None] | None = None,
                 on_reject: Callable[[str, str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < reserve_fraction <= 1:
            raise ValueError(f"reserve_fraction must be in (0, 1], got {reserve_fraction}")
        self.block_size = block_size
        self.reserve_fraction = reserve_fraction
        self.queue_timeout_s = queue_timeout_s
        self.max_queued_per_class = max_queued_per_class
        self.policy = make_admission_policy(policy) if isinstance(policy, str) else policy
        self.ledgers = {wid: ReservationLedger(max(1, int(blocks * share))) for wid, blocks in capacities.items()}
        self._tenant_blocks: dict[str, int] = {}
        self._tenant_admitted: dict[str, int] = {}
        self._held: dict[str, tuple[str, int, str]] = {}  # request id -> (worker, blocks, tenant)
        self._share = share
        self._waiters: list[Waiter] = []
        self._seq = itertools.count()
        self._clock = clock
        self.on_queue, self.on_ledger, self.on_reject = on_queue, on_ledger, on_reject
        self._releases: deque[tuple[float, int]] = deque()  # (when, blocks) for the drain rate
        self._released = 0

    def ensure_ledger(self, worker_id: str, blocks: int) -> None:
        """A ledger for a worker that now keeps KV (a prefill worker flipped to decode)."""
        if worker_id not in self.ledgers:
            self.ledgers[worker_id] = ReservationLedger(max(1, int(blocks * self._share)))
            self._report_ledger(worker_id)

    # ------------------------------------------------------------------ sizing
    def blocks_for(self, demand: KVDemand, max_tokens: int | None = None, n: int | None = None) -> int:
        """The worst-case blocks of ``demand`` with an output budget of ``max_tokens`` per sample
        (and ``n`` samples, default the demand's)."""
        out = max_tokens if max_tokens is not None else demand.max_tokens
        n = n if n is not None else demand.n
        out = math.ceil(out * self.reserve_fraction)
        bs = self.block_size
        first = math.ceil((demand.prompt_tokens + out) / bs)
        # Further samples share the prompt's full blocks; each needs its own tail and output.
        extra = (n - 1) * (math.ceil((demand.prompt_tokens % bs + out) / bs))
        return first + extra

    def _shared(self, demand: KVDemand) -> tuple[bytes, ...]:
        """The demand's prefix hashes, at most one per full prompt block (every sizing counts those)."""
        return demand.prefix_hashes[:demand.prompt_tokens // self.block_size]

    # ------------------------------------------------------------------ reserve / release
    def try_reserve(self, demand: KVDemand, allowed: list[str], preferred: str | None) -> Reservation | None:
        """Hold blocks for ``demand`` on one of ``allowed`` (``preferred`` first) now, or None when it
        must queue (``enqueue``); raises ``AdmissionError`` (429) when it is refused or the queue
        of its class is full. Synchronous: the simulator calls it as the live front does."""
        outcome = self._decide(demand, allowed, preferred)
        if outcome.action == "admit":
            return self._hold(demand, outcome, 0.0)
        depth = sum(1 for w in self._waiters if w.priority == demand.priority)
        if outcome.action == "reject" or depth >= self.max_queued_per_class:
            raise self._reject(AdmissionError(429, "no worker has KV room for this request and the queue is "
                                              "full", "kv_queue_full", retry_after_s=self.retry_after_s(demand),
                                              tenant=demand.tenant.name))
        return None

    def enqueue(self, demand: KVDemand, allowed: Callable[[], list[str]], preferred: Callable[[], str | None],
                admitted: Callable[[Outcome], None], failed: Callable[[BaseException], None]) -> Waiter:
        """Queue a demand ``try_reserve`` could not place: ``wake`` reserves its blocks once the head
        of the queue fits, then calls ``admitted`` (``collect`` turns that into a Reservation)."""
        waiter = Waiter(demand.priority, next(self._seq), demand, allowed, preferred, admitted, failed)
        heapq.heappush(self._waiters, waiter)
        self._report_queue()
        return waiter

    def dequeue(self, waiter: Waiter) -> None:
        """Take a waiter off the queue (its deadline passed, or its caller went away); no callback."""
        waiter.done = True
        if waiter in self._waiters:
            self._waiters.remove(waiter)
            heapq.heapify(self._waiters)
            self._report_queue()

    def timed_out(self, demand: KVDemand, allowed: list[str]) -> AdmissionError:
        """The error for a demand whose queue deadline passed: 503 when no worker is left, else 429."""
        if not allowed:
            return self._reject(AdmissionError(503, "no worker is alive", "no_workers", retry_after_s=5.0,
                                               tenant=demand.tenant.name))
        return self._reject(AdmissionError(
            429, f"queued {self.queue_timeout_s:.0f}s without KV room", "queue_deadline",
            retry_after_s=self.retry_after_s(demand), tenant=demand.tenant.name))

    def collect(self, demand: KVDemand, outcome: Outcome, waited_s: float) -> Reservation:
        """The reservation ``wake`` made for a queued demand (its ``admitted`` outcome)."""
        return self._hold(demand, outcome, waited_s)

    async def reserve(self, demand: KVDemand, allowed: Callable[[], list[str]],
                      preferred: Callable[[], str | None]) -> Reservation:
        """Hold blocks for ``demand`` on one of ``allowed()`` (``preferred()`` first), waiting in the
        queue when nothing fits; raises ``AdmissionError`` (429, or 503 when no worker is left)."""
        started = self._clock()
        held = self.try_reserve(demand, allowed(), preferred())
        if held is not None:
            return held
        future = asyncio.get_running_loop().create_future()
        waiter = self.enqueue(demand, allowed, preferred, future.set_result, future.set_exception)
        try:
            outcome = await asyncio.wait_for(asyncio.shield(future), self.queue_timeout_s)
        except asyncio.TimeoutError:
            if future.done() and not future.cancelled():  # admitted as the deadline fell
                return self.collect(demand, future.result(), self._clock() - started)
            raise self.timed_out(demand, allowed()) from None
        finally:
            self.dequeue(waiter)
        return self.collect(demand, outcome, self._clock() - started)

    def release(self, request_id: str) -> int:
        """Drop ``request_id``'s reservation (a repeat call frees nothing) and admit what now fits."""
        held = self._held.pop(request_id, None)
        if held is None:
            return 0
        worker_id, blocks, tenant = held
        self.ledgers[worker_id].release(request_id)
        self._tenant_blocks[tenant] -= blocks
        self._tenant_admitted[tenant] -= 1
        self._observe_release(blocks)
        self._report_ledger(worker_id)
        self.wake()
        return blocks

    def wake(self) -> None:
        """Admit queued demands in priority order while the head fits (also after membership changes)."""
        while self._waiters:
            head = self._waiters[0]
            if head.done:
                heapq.heappop(self._waiters)
                continue
            allowed = head.allowed()
            if not allowed:
                return  # nothing to wait for: the deadline ends it with 503
            outcome = self._decide(head.demand, allowed, head.preferred())
            if outcome.action != "admit":
                return  # strict order: a big head is not overtaken forever by small ones
            heapq.heappop(self._waiters)
            # Reserve now, before the waiter's task runs, so a second wake cannot give the blocks twice.
            self._hold(head.demand, outcome, 0.0)
            head.done = True
            head.admitted(Outcome("held", outcome.worker_id, outcome.max_tokens, outcome.n))
        self._report_queue()

    def fail_waiting(self, error: BaseException) -> int:
        """End every queued demand with ``error`` (drain); returns how many were waiting."""
        count = 0
        for w in self._waiters:
            if not w.done:
                w.done = True
                w.failed(error)
                count += 1
        self._waiters.clear()
        self._report_queue()
        return count

    def _decide(self, demand: KVDemand, allowed: list[str], preferred: str | None) -> Outcome:
        fits = []
        shared = self._shared(demand)
        for wid in allowed:
            ledger = self.ledgers.get(wid)
            if ledger is not None:
                # blocks a live reservation there already pins cost this demand nothing there
                room = ledger.available_blocks + ledger.shared_blocks(shared)
                fits.append(Fit(wid, room, len(ledger) == 0))
        t = demand.tenant
        blocks = self.blocks_for(demand)
        tenant_ok = (t.max_concurrent_requests is None
                     or self._tenant_admitted.get(t.name, 0) < max(1, int(t.max_concurrent_requests * self._share)))
        if t.kv_block_budget is not None and self._tenant_admitted.get(t.name, 0) > 0:
            tenant_ok = tenant_ok and self._tenant_blocks.get(t.name, 0) + blocks <= t.kv_block_budget * self._share
        return self.policy.decide(demand, fits, lambda out, n=None: self.blocks_for(demand, out, n), preferred,
                                  tenant_ok)

    def _hold(self, demand: KVDemand, outcome: Outcome, waited: float) -> Reservation:
        if outcome.action == "held":  # reserved by wake() already
            worker_id, blocks, _ = self._held[demand.request_id]
            max_tokens = outcome.max_tokens or demand.max_tokens
            degraded = outcome.max_tokens is not None or outcome.n is not None
            return Reservation(worker_id, blocks, max_tokens, degraded, waited, outcome.n)
        assert outcome.worker_id is not None
        max_tokens = outcome.max_tokens if outcome.max_tokens is not None else demand.max_tokens
        blocks = self.blocks_for(demand, max_tokens, outcome.n)
        ledger = self.ledgers[outcome.worker_id]
        # Over capacity only when admitted alone in an empty ledger, or by a policy that oversubscribes.
        ledger.reserve(demand.request_id, blocks, force=True, shared=self._shared(demand))
        self._held[demand.request_id] = (outcome.worker_id, blocks, demand.tenant.name)
        name = demand.tenant.name
        self._tenant_blocks[name] = self._tenant_blocks.get(name, 0) + blocks
        self._tenant_admitted[name] = self._tenant_admitted.get(name, 0) + 1
        self._report_ledger(outcome.worker_id)
        degraded = outcome.max_tokens is not None or outcome.n is not None
        return Reservation(outcome.worker_id, blocks, max_tokens, degraded, waited, outcome.n)

    # ------------------------------------------------------------------ drain rate and metrics
    def retry_after_s(self, demand: KVDemand) -> float:
        """When to come back: the blocks queued ahead plus this demand's, at the measured drain rate."""
        ahead = sum(self.blocks_for(w.demand) for w in self._waiters if w.priority <= demand.priority)
        short = ahead + self.blocks_for(demand) - max((lg.available_blocks for lg in self.ledgers.values()), default=0)
        rate = self.drain_rate
        if rate <= 0:
            return self.queue_timeout_s
        return min(max(short / rate, 1.0), 600.0)

    @property
    def drain_rate(self) -> float:
        """Blocks released per second over the last ``_RATE_WINDOW_S`` (0 before any release)."""
        now = self._clock()
        while self._releases and self._releases[0][0] < now - _RATE_WINDOW_S:
            self._released -= self._releases.popleft()[1]
        if not self._releases:
            return 0.0
        return self._released / max(now - self._releases[0][0], 1.0)

    def _observe_release(self, blocks: int) -> None:
        self._releases.append((self._clock(), blocks))
        self._released += blocks

    def _reject(self, error: AdmissionError) -> AdmissionError:
        if self.on_reject is not None:
            self.on_reject(error.reason, error.tenant or "")
        return error

    def queue_depths(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for w in self._waiters:
            if not w.done:
                out[w.priority] = out.get(w.priority, 0) + 1
        return out

    def _report_queue(self) -> None:
        if self.on_queue is not None:
            self.on_queue(self.queue_depths())

    def _report_ledger(self, worker_id: str) -> None:
        if self.on_ledger is not None:
            ledger = self.ledgers[worker_id]
            self.on_ledger(worker_id, ledger.reserved_blocks, ledger.capacity_blocks)

    def held(self, request_id: str) -> Any:
        return self._held.get(request_id)
