"""``baton serve``: start the pools on Ray, put the OpenAI-compatible front on top, drain on exit."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from typing import Any

from baton_serve.cluster.config import ClusterConfig
from baton_serve.cluster.front import PoolClient
from baton_serve.cluster.http_actor import Front, build_front
from baton_serve.cluster.launcher import Cluster
from baton_serve.cluster.metrics import Metrics

log = logging.getLogger("baton.serve")


class Deployment:
    """A running cluster plus its front in this process: workers, pool client, metrics, admission,
    and the ASGI app (benchmarks and tests serve it on a thread)."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.cluster = Cluster(config)
        self.front: Front | None = None
        self.app: Any = None
        self.pool: PoolClient | None = None
        self.metrics: Metrics | None = None

    def start(self) -> Deployment:
        self.cluster.start()
        model_name = self.config.server.served_model_names(self.cluster.model_path)
        self.front = build_front(self.config, self.cluster.workers, self.cluster.limits,
                                 str(self.cluster.model_path), model_name, self.cluster.controller)
        self.app, self.pool, self.metrics = self.front.app, self.front.pool, self.front.metrics
        return self

    def stop(self) -> None:
        if self.front is not None:
            self.front.admission.close()
        self.cluster.stop()


def serve(config: ClusterConfig) -> int:
    """Blocking: serve until SIGINT/SIGTERM, then drain open streams and stop every actor.

    The HTTP fronts are Ray actors (``server.num_frontends`` of them share the port); this
    process only starts things, waits for a signal, and tears down.
    """
    from baton_serve.cluster.admission.front import tenant_directory
    from baton_serve.cluster.http_actor import drain_fronts, start_fronts, stop_fronts
    from baton_serve.router.request_id import configure_logging

    configure_logging(config.server.log_format)
    started = time.monotonic()
    stop = threading.Event()

    def on_signal() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())

    on_signal()
    tenants = tenant_directory(config.server)  # a bad tenants file fails before any actor starts
    cluster = Cluster(config)
    fronts: list[Any] = []
    try:
        cluster.start()
        on_signal()  # ray.init installs its own SIGTERM handler (which aborts the process): ours again
        host, port = config.server.host, config.server.port
        model_name = config.server.served_model_names(cluster.model_path)
        fronts = start_fronts(cluster, config.server.num_frontends, host, port, model_name,
                              config.server.max_queued_requests, routing=config.router.model_dump())
        mode = (f"{config.pools.colocated} colocated" if config.colocated
                else f"{config.pools.prefill} prefill + {config.pools.decode} decode")
        aliases = f" (also as {', '.join(model_name[1:])})" if len(model_name) > 1 else ""
        print(f"Baton serving {model_name[0]}{aliases} ({mode} workers, {len(fronts)} HTTP front"
              f"{'s' if len(fronts) > 1 else ''}) at http://{reachable_host(host)}:{port}/v1", flush=True)
        auth = ("open: no API key" if tenants.open else
                f"{len(tenants.tenants)} tenant{'s' if len(tenants.tenants) > 1 else ''}, API keys required")
        print(f"ready in {time.monotonic() - started:.1f}s ({auth}); Ctrl-C to stop", flush=True)
        while not stop.wait(1.0):
            pass
        print(f"draining: new requests get 503, open ones have {config.server.drain_timeout_s:g}s",
              file=sys.stderr, flush=True)
        aborted = drain_fronts(fronts, config.server.drain_timeout_s)
        if aborted:
            print(f"drain: {aborted} requests ended with finish_reason abort", file=sys.stderr, flush=True)
    finally:
        print("stopping HTTP fronts and shutting down workers", file=sys.stderr, flush=True)
        stop_fronts(fronts)
        cluster.stop()
    return 0


def reachable_host(host: str) -> str:
    """What a client puts in the URL for a front bound to ``host``: a wildcard bind is reached
    at this node's address."""
    if host in ("0.0.0.0", "::", ""):
        from baton_serve.workers.node import node_address

        return node_address()
    return host
