"""``baton serve``: start the pools on Ray, put the OpenAI-compatible front on top, drain on exit."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from typing import Any

from cluster.config import ClusterConfig
from cluster.launcher import Cluster
from cluster.metered_client import MeteredClient
from cluster.metrics import Metrics
from cluster.pool_client import PoolClient

log = logging.getLogger("baton.serve")


class Deployment:
    """A running cluster plus its front: workers, pool client, metrics, and the ASGI app."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.cluster = Cluster(config)
        self.app: Any = None
        self.pool: PoolClient | None = None
        self.metrics: Metrics | None = None

    def start(self) -> Deployment:
        from router.api import build_app
        from workers.text.tokenizer import Tokenizer

        self.cluster.start()
        model_name = self.config.server.model_name or self.cluster.model_path.name
        self.metrics = Metrics(model_name)
        self.pool = PoolClient(self.cluster.workers, self.cluster.limits,
                               max_queued=self.config.server.max_queued_requests,
                               on_stats=self.metrics.on_worker_stats,
                               controller=self.cluster.controller, metrics=self.metrics,
                               **pool_routing(self.config))
        tokenizer = Tokenizer.from_folder(self.cluster.model_path)
        self.app = build_app(MeteredClient(self.pool, self.metrics), tokenizer, model_name,
                             self.cluster.limits.max_model_len, ready=self.pool.ready,
                             metrics_registry=self.metrics.registry,
                             on_startup=[self.pool.start], on_shutdown=[self.pool.stop])
        return self

    def stop(self) -> None:
        self.cluster.stop()


def serve(config: ClusterConfig) -> int:
    """Blocking: serve until SIGINT/SIGTERM, then drain open streams and stop every actor.

    The HTTP fronts are Ray actors (``server.num_frontends`` of them share the port); this
    process only starts things, waits for a signal, and tears down.
    """
    from cluster.http_actor import start_fronts, stop_fronts

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cluster = Cluster(config)
    fronts: list[Any] = []
    try:
        cluster.start()
        host, port = config.server.host, config.server.port
        model_name = config.server.model_name or cluster.model_path.name
        fronts = start_fronts(cluster, config.server.num_frontends, host, port, model_name,
                              config.server.max_queued_requests, routing=config.router.model_dump())
        mode = (f"{config.pools.colocated} colocated" if config.colocated
                else f"{config.pools.prefill} prefill + {config.pools.decode} decode")
        print(f"Baton serving {model_name} ({mode} workers, {len(fronts)} HTTP front"
              f"{'s' if len(fronts) > 1 else ''}) at http://{reachable_host(host)}:{port}/v1", flush=True)
        print(f"ready in {time.monotonic() - started:.1f}s; Ctrl-C to stop", flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        print("draining HTTP fronts and shutting down workers", file=sys.stderr, flush=True)
        stop_fronts(fronts)
        cluster.stop()
    return 0


def pool_routing(config: ClusterConfig) -> dict[str, Any]:
    """``PoolClient`` keyword arguments from the ``[router]`` section."""
    r = config.router
    return {"policy": r.make_policy(), "events_interval_s": r.events_interval_s, "index_ttl_s": r.index_ttl_s}


def reachable_host(host: str) -> str:
    """What a client puts in the URL for a front bound to ``host``: a wildcard bind is reached
    at this node's address."""
    if host in ("0.0.0.0", "::", ""):
        from workers.node import node_address

        return node_address()
    return host
