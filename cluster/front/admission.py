"""The front's side of stage 2 of admission, as plain code: the KV demand a routed request makes,
and what a reservation grants it (fewer samples, a smaller output budget, the queue time and the
tokens its tenant is charged). The ledger and its queue are ``cluster.admission.kv.KVAdmission``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from baton_serve.cluster.admission.kv import KVDemand, Reservation
from baton_serve.cluster.admission.tenants import ANONYMOUS, Tenant
from baton_serve.router.routing import Decision
from baton_serve.workers.sampling.params import SamplingParams


def kv_demand(wire_id: str, ticket: Any, prompt_len: int, max_tokens: int, params: SamplingParams,
              priority: int, hashes: list[bytes]) -> KVDemand:
    """What a request routed with ``hashes`` asks of the ledger, for its ticket's tenant (anonymous without one)."""
    tenant = getattr(ticket, "tenant", None)
    if tenant is None:
        tenant = Tenant(ANONYMOUS)
    return KVDemand(wire_id, tenant, prompt_len, max_tokens, params.n, priority, tuple(hashes))


def keeper(decision: Decision) -> Any:
    """The worker that holds the request's KV while it decodes: where stage 2 reserves it."""
    return decision.decode or decision.first


def grant(held: Reservation, params: SamplingParams, ticket: Any, prompt_len: int, charge: bool,
          request_key: str) -> SamplingParams:
    """The request's parameters under ``held`` (a degraded reservation caps ``max_tokens``, or ``n``
    on a first admission only: a migration never drops samples a client already reads), with the
    ticket told what was capped, how long it queued and, when ``charge``, the tokens charged."""
    if held.degraded and held.n is not None:
        if charge:
            params = dataclasses.replace(params, n=held.n)
            if ticket is not None:
                ticket.degraded["n"] = held.n
                ticket.granted_n[request_key] = held.n
    elif held.degraded:
        params = dataclasses.replace(params, max_tokens=held.max_tokens)
        if ticket is not None:
            ticket.degraded["max_tokens"] = held.max_tokens
    if ticket is not None:
        ticket.queue_time_s += held.queued_s
        if charge:  # a migration re-reserves what the tenant was charged for once
            ticket.charge_tokens(prompt_len + held.max_tokens * params.n)
    return params


def stale_route(held: Reservation, decision: Decision) -> bool:
    """True when the request must be routed again: its KV was reserved on another worker than the
    one routed to, or it queued (the first choice is stale by then)."""
    return held.worker_id != keeper(decision).worker_id or held.queued_s > 0
