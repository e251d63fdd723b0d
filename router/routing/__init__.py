"""Routing: which worker prefills a request and which decodes it, by a policy chosen by name."""

from baton_serve.router.routing.base import (  # noqa: F401
    Candidates,
    Decision,
    RouteRequest,
    RoutingPolicy,
    WorkerLoad,
    make_policy,
    policy_names,
    register_policy,
)
