"""The front's side of stage 2: the demand a routed request makes, and what a reservation grants."""

from __future__ import annotations

from dataclasses import dataclass, field

from baton_serve.cluster.admission.kv import Reservation
from baton_serve.cluster.admission.tenants import ANONYMOUS, Tenant
from baton_serve.cluster.front.admission import grant, keeper, kv_demand, stale_route
from baton_serve.cluster.front.workers import WorkerRef
from baton_serve.router.routing import Decision
from baton_serve.workers.sampling.params import SamplingParams


@dataclass
class _Ticket:
    tenant: Tenant = field(default_factory=lambda: Tenant("acme"))
    degraded: dict = field(default_factory=dict)
    granted_n: dict = field(default_factory=dict)
    queue_time_s: float = 0.0
    charged: int = 0

    def charge_tokens(self, tokens: int) -> None:
        self.charged += tokens


def test_the_demand_names_the_tickets_tenant_or_the_anonymous_one():
    params = SamplingParams(n=2, max_tokens=8)
    d = kv_demand("w1", _Ticket(), 30, 8, params, 1, [b"a", b"b"])
    assert (d.tenant.name, d.prompt_tokens, d.max_tokens, d.n, d.priority, d.prefix_hashes) == \
        ("acme", 30, 8, 2, 1, (b"a", b"b"))
    assert kv_demand("w1", None, 30, 8, params, 0, []).tenant.name == ANONYMOUS


def test_a_degraded_n_applies_to_a_first_admission_only_and_is_charged_once():
    params, ticket = SamplingParams(n=4, max_tokens=8), _Ticket()
    held = Reservation("decode-0", 6, 8, degraded=True, queued_s=0.5, n=2)
    got = grant(held, params, ticket, 30, charge=True, request_key="r")
    assert got.n == 2 and ticket.degraded == {"n": 2} and ticket.granted_n == {"r": 2}
    assert ticket.charged == 30 + 8 * 2 and ticket.queue_time_s == 0.5
    again = grant(held, params, ticket, 30, charge=False, request_key="r")  # a migration's re-reservation
    assert again.n == 4 and ticket.charged == 46 and ticket.queue_time_s == 1.0


def test_a_degraded_budget_caps_max_tokens():
    ticket = _Ticket()
    got = grant(Reservation("decode-0", 3, 5, degraded=True), SamplingParams(max_tokens=64), ticket, 10, True, "r")
    assert got.max_tokens == 5 and ticket.degraded == {"max_tokens": 5} and ticket.charged == 15


def test_the_route_is_stale_when_the_kv_landed_elsewhere_or_waited():
    p, d = WorkerRef("prefill-0", "prefill", None), WorkerRef("decode-0", "decode", None)
    decision = Decision(p, d, "load")
    assert keeper(decision) is d and keeper(Decision(p, None, "local")) is p
    assert not stale_route(Reservation("decode-0", 1, 1), decision)
    assert stale_route(Reservation("decode-1", 1, 1), decision)
    assert stale_route(Reservation("decode-0", 1, 1, queued_s=0.1), decision)
