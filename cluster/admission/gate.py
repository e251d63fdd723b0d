"""Stage 1 of admission, the ingress gate: cheap checks before any tokenizer time is spent.

In order: draining (503), the API key (401), the body size (413), the global queue cap, whether
the tenant's token bucket is in debt, its request-rate bucket (429 with ``Retry-After`` from the
bucket). The tenant's concurrency and KV budgets are stage 2's: over them a request queues. A request
that passes holds a ``Ticket`` until it ends; the ticket carries the tenant to stage 2 (the KV
reservation in ``cluster.admission.kv``) and ends in exactly one usage record, whichever exit path
(finish, cancel, disconnect, error, drain) gets there first.

Limits are per front: with ``num_fronts`` replicas sharing a port, each gets ``1/num_fronts`` of
a tenant's rates and concurrency (the kernel spreads connections evenly enough for that).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from baton_serve.cluster.admission.buckets import TokenBucket
from baton_serve.cluster.admission.tenants import AuthenticationError, Identity, Tenant, TenantDirectory
from baton_serve.cluster.usage import UsageRecord
from baton_serve.router.errors import APIError

log = logging.getLogger("baton.admission")

_RATE_WINDOW_S = 30.0
_FINISH_LOCK = threading.Lock()  # makes Ticket.finish's check-and-set atomic; held for nanoseconds


class AdmissionError(APIError):
    """A request refused by admission: its HTTP status, why (``reason``, also the error ``code`` and
    a metric label), and when to retry (``Retry-After``)."""

    def __init__(self, status: int, message: str, reason: str, retry_after_s: float | None = None,
                 tenant: str | None = None) -> None:
        headers = {}
        if retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
        if status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        super().__init__(status, message, code=reason, headers=headers or None)
        self.status, self.reason = status, reason
        self.retry_after_s, self.tenant = retry_after_s, tenant


class _TenantState:
    """One tenant's buckets and in-flight count at this front."""

    def __init__(self, tenant: Tenant, share: float, clock: Callable[[], float]) -> None:
        self.tenant = tenant
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        if tenant.requests_per_second:
            rate = tenant.requests_per_second * share
            self.requests = TokenBucket(rate, max(tenant.request_burst or rate, 1.0), clock)
        if tenant.tokens_per_second:
            rate = tenant.tokens_per_second * share
            self.tokens = TokenBucket(rate, max(tenant.token_burst or rate * 10, 1.0), clock)
        self.in_flight = 0


@dataclass
class Ticket:
    """A request past the gate: who sent it, what stage 2 held for it, and how it ended.

    ``finish`` is idempotent: the first exit path to call it writes the usage record and releases
    the request's place; later calls change nothing.
    """

    identity: Identity
    arrival: float  # time.monotonic() at the gate
    created: float  # time.time() at the gate
    gate: IngressGate | None = None
    request_id: str = ""
    endpoint: str = ""
    idempotency_key: str | None = None
    charged_tokens: int = 0  # what the token bucket was charged at stage 2 (refunded at finish)
    queue_time_s: float = 0.0
    first_token_at: float | None = None
    degraded: dict[str, int] = field(default_factory=dict)  # field -> the value it was capped to
    granted_n: dict[str, int] = field(default_factory=dict)  # engine request id -> samples run, where fewer than n
    finished: bool = False
    detached: bool = False  # closed by a recorded (idempotent) run, not by the request's handler

    @property
    def tenant(self) -> Tenant:
        return self.identity.tenant

    @property
    def tenant_name(self) -> str:
        return self.identity.tenant.name

    def priority(self, request_priority: int) -> int:
        """The engine priority: the tenant's class plus the request's own (lower first)."""
        return self.tenant.priority + request_priority

    def cache_salt(self, client_salt: str | None) -> str | None:
        """The request's prefix-cache salt within its tenant's namespace."""
        return self.tenant.cache_salt(client_salt)

    def charge_tokens(self, tokens: int) -> None:
        """Stage 2: charge the tenant's token bucket for the prompt plus its output budget."""
        if self.gate is not None:
            self.gate.charge_tokens(self, tokens)

    def mark_first_token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()

    def finish(self, status: int, finish_reason: str, prompt_tokens: int = 0, cached_tokens: int = 0,
               completion_tokens: int = 0) -> bool:
        """End the request once: True for the call that did."""
        with _FINISH_LOCK:  # exit paths may race from threads (a drain, a store callback)
            if self.finished:
                return False
            self.finished = True
        if self.gate is not None:
            self.gate.finish(self, status, finish_reason, prompt_tokens, cached_tokens, completion_tokens)
        return True


class IngressGate:
    """Stage 1 for one front: keys to tenants, rate buckets, the global queue cap, draining.

    ``usage`` (a ``cluster.usage`` store) receives one record per ticket. ``on_reject(reason,
    tenant)`` and ``on_finish(ticket, prompt, completion)`` feed metrics. Thread-safe: the front's
    event loop and a drain thread both use it.
    """

    def __init__(self, directory: TenantDirectory | None = None, max_queued: int = 512,
                 max_body_bytes: int = 4 << 20, num_fronts: int = 1, model: str = "",
                 weights_fingerprint: str = "", usage: Any = None,
                 on_reject: Callable[[str, str], None] | None = None,
                 on_finish: Callable[[Ticket, int, int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = directory or TenantDirectory.anonymous()
        self.max_queued = max(1, max_queued // max(num_fronts, 1))
        self.max_body_bytes = max_body_bytes
        self.share = 1.0 / max(num_fronts, 1)
        self.model, self.weights_fingerprint = model, weights_fingerprint
        self.usage = usage
        self.on_reject, self.on_finish = on_reject, on_finish
        self._clock = clock
        self._lock = threading.Lock()
        self._states: dict[str, _TenantState] = {}
        self._arrivals: dict[str, int] = {}  # authenticated requests per tenant: each owes one record
        self._finishes: deque[float] = deque()  # when tickets ended, for the queue cap's Retry-After
        self.in_flight = 0
        self.draining = False
        self._idle = threading.Condition(self._lock)

    # ------------------------------------------------------------------ stage 1
    def admit(self, authorization: str | None = None, x_api_key: str | None = None,
              content_length: int | None = None, endpoint: str = "chat") -> Ticket:
        """Let a request in, or raise ``AdmissionError`` (no tokenizer, no I/O: microseconds)."""
        if self.draining:
            raise self._reject(AdmissionError(503, "the server is shutting down", "draining", retry_after_s=5))
        try:
            identity = self.directory.authenticate(authorization, x_api_key)
        except AuthenticationError as exc:
            raise self._reject(AdmissionError(401, str(exc), "unauthenticated")) from None
        with self._lock:
            self._arrivals[identity.tenant.name] = self._arrivals.get(identity.tenant.name, 0) + 1
        if content_length is not None and content_length > self.max_body_bytes:
            raise self._refuse(identity, endpoint, self._too_large(content_length))
        with self._lock:
            state = self._state(identity.tenant)
            error = self._check(state)
            if error is None:
                self.in_flight += 1
                state.in_flight += 1
        if error is not None:
            raise self._refuse(identity, endpoint, error)
        return Ticket(identity, self._clock(), time.time(), gate=self, endpoint=endpoint)

    def check_body_size(self, ticket: Ticket, size: int) -> None:
        """The body read so far is ``size`` bytes: refuse past the limit (413)."""
        if size > self.max_body_bytes:
            error = self._too_large(size)
            self._reject(error)
            ticket.finish(error.status, "rejected")
            raise error

    def _too_large(self, size: int) -> AdmissionError:
        return AdmissionError(413, f"the request body is {size} bytes; the limit is {self.max_body_bytes}",
                              "body_too_large")

    def _check(self, state: _TenantState) -> AdmissionError | None:
        name = state.tenant.name
        if self.in_flight >= self.max_queued:
            return AdmissionError(429, f"{self.in_flight} requests in flight; the limit is {self.max_queued}",
                                  "queue_full", retry_after_s=self._queue_wait_s(), tenant=name)
        if state.tokens is not None and state.tokens.level < 0:
            return AdmissionError(429, f"tenant {name!r} is over its token rate", "tenant_token_rate",
                                  retry_after_s=state.tokens.seconds_until(0.0), tenant=name)
        if state.requests is not None and not state.requests.try_take():
            return AdmissionError(429, f"tenant {name!r} is over its request rate", "tenant_request_rate",
                                  retry_after_s=state.requests.seconds_until(), tenant=name)
        return None

    def _queue_wait_s(self) -> float:
        """How long until a place frees up, at the rate requests have been finishing (lock held)."""
        now = self._clock()
        while self._finishes and self._finishes[0] < now - _RATE_WINDOW_S:
            self._finishes.popleft()
        if not self._finishes:
            return _RATE_WINDOW_S  # nothing finished lately: come back much later
        rate = len(self._finishes) / max(now - self._finishes[0], 1.0)
        return min(max((self.in_flight - self.max_queued + 1) / rate, 1.0), 600.0)

    def _state(self, tenant: Tenant) -> _TenantState:
        state = self._states.get(tenant.name)
        if state is None:
            state = self._states[tenant.name] = _TenantState(tenant, self.share, self._clock)
        return state

    def _reject(self, error: AdmissionError) -> AdmissionError:
        if self.on_reject is not None:
            self.on_reject(error.reason, error.tenant or "")
        return error

    def _refuse(self, identity: Identity, endpoint: str, error: AdmissionError) -> AdmissionError:
        """A refusal after authentication: it is a request of the tenant's, so it gets its record."""
        error.tenant = identity.tenant.name
        self._reject(error)
        self._record(Ticket(identity, self._clock(), time.time(), endpoint=endpoint), error.status, "rejected",
                     0, 0, 0)
        return error

    # ------------------------------------------------------------------ stage 2 and the end
    def charge_tokens(self, ticket: Ticket, tokens: int) -> None:
        with self._lock:
            state = self._states.get(ticket.tenant.name)
            if state is not None and state.tokens is not None:
                state.tokens.charge(tokens)
                ticket.charged_tokens += tokens

    def finish(self, ticket: Ticket, status: int, finish_reason: str, prompt_tokens: int, cached_tokens: int,
               completion_tokens: int) -> None:
        """Called once per ticket (``Ticket.finish``): refund, release, record."""
        with self._lock:
            state = self._states.get(ticket.tenant.name)
            if state is not None:
                state.in_flight -= 1
                if state.tokens is not None and ticket.charged_tokens:
                    state.tokens.refund(max(0, ticket.charged_tokens - prompt_tokens - completion_tokens))
            self.in_flight -= 1
            self._finishes.append(self._clock())
            if self.in_flight == 0:
                self._idle.notify_all()
        self._record(ticket, status, finish_reason, prompt_tokens, cached_tokens, completion_tokens)
        if self.on_finish is not None:
            self.on_finish(ticket, prompt_tokens, completion_tokens)

    def _record(self, ticket: Ticket, status: int, finish_reason: str, prompt_tokens: int, cached_tokens: int,
                completion_tokens: int) -> None:
        if self.usage is None:
            return
        now = self._clock()
        ttft = None if ticket.first_token_at is None else ticket.first_token_at - ticket.arrival
        try:
            self.usage.record(UsageRecord(
                request_id=ticket.request_id or f"req-{uuid.uuid4().hex}", tenant=ticket.tenant.name,
                key_id=ticket.identity.key_id, model=self.model, weights_fingerprint=self.weights_fingerprint,
                endpoint=ticket.endpoint, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                completion_tokens=completion_tokens, finish_reason=finish_reason, status=status,
                created=ticket.created, queue_time_s=ticket.queue_time_s, ttft_s=ttft,
                e2e_s=now - ticket.arrival, idempotency_key=ticket.idempotency_key))
        except Exception:  # a closed store at shutdown must not turn a finished request into a 500
            log.exception("usage record for %s not written", ticket.request_id)

    # ------------------------------------------------------------------ drain
    def start_draining(self) -> None:
        """From now on every new request gets 503 (and ``/ready`` says so)."""
        self.draining = True

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until no ticket is open (True) or ``timeout_s`` passes (False)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self.in_flight > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def arrivals(self, tenant: str) -> int:
        """Authenticated requests of ``tenant`` so far (each ends in exactly one usage record)."""
        with self._lock:
            return self._arrivals.get(tenant, 0)

    def tenant_in_flight(self, name: str) -> int:
        with self._lock:
            state = self._states.get(name)
            return state.in_flight if state else 0
