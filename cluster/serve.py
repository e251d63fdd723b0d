"""``baton serve``: start the pools on Ray, put the OpenAI-compatible front on top, drain on exit."""

from __future__ import annotations

import logging
import signal
import sys
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
        from workers.tokenizer import Tokenizer

        self.cluster.start()
        model_name = self.config.server.model_name or self.cluster.model_path.name
        self.metrics = Metrics(model_name)
        metrics = self.metrics

        def on_stats(worker: Any, stats: Any) -> None:
            from types import SimpleNamespace

            snapshot = SimpleNamespace(**stats) if stats is not None else None
            metrics.observe_worker(worker.role, worker.worker_id, snapshot, up=stats is not None)

        self.pool = PoolClient(self.cluster.workers, self.cluster.limits,
                               max_queued=self.config.server.max_queued_requests, on_stats=on_stats,
                               controller=self.cluster.controller)
        tokenizer = Tokenizer.from_folder(self.cluster.model_path)
        self.app = build_app(MeteredClient(self.pool, self.metrics), tokenizer, model_name,
                             self.cluster.limits.max_model_len, ready=self.pool.ready,
                             metrics_registry=self.metrics.registry,
                             on_startup=[self.pool.start], on_shutdown=[self.pool.stop])
        return self

    def stop(self) -> None:
        self.cluster.stop()


def serve(config: ClusterConfig) -> int:
    """Blocking: serve until SIGINT/SIGTERM, then drain open streams and stop every actor."""
    from router.server import run_server

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    dep = Deployment(config)
    # SIGTERM (Kubernetes, systemd) gets the same graceful path as Ctrl-C.
    signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))
    try:
        dep.start()
        host, port = config.server.host, config.server.port
        mode = (f"{config.pools.colocated} colocated" if config.colocated
                else f"{config.pools.prefill} prefill + {config.pools.decode} decode")
        print(f"Baton serving {dep.cluster.model_path.name} ({mode} workers) at http://{host}:{port}/v1",
              flush=True)
        print(f"ready in {time.monotonic() - started:.1f}s; Ctrl-C to stop", flush=True)
        try:
            run_server(dep.app, host=host, port=port)
        except KeyboardInterrupt:  # uvicorn re-raises the signal after its graceful shutdown
            pass
    finally:
        print("shutting down workers", file=sys.stderr, flush=True)
        dep.stop()
    return 0
