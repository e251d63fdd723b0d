"""The HTTP front as a Ray actor: one or more replicas share a port (SO_REUSEPORT) and route to the
same worker pools, each with its own outbox on every worker.
"""

from __future__ import annotations

import logging
from typing import Any

from cluster.metered_client import MeteredClient
from cluster.metrics import Metrics
from cluster.pool_client import PoolClient, WorkerRef
from workers.engine.validation import RequestLimits

log = logging.getLogger("baton.http")


class HTTPFront:
    """Builds a pool client, metrics and the OpenAI app, and serves it on ``host:port``."""

    def __init__(self, workers: list[dict[str, Any]], limits: dict[str, int], model_path: str,
                 model_name: str, host: str, port: int, max_queued: int, controller: Any = None,
                 reuse_port: bool = False, routing: dict[str, Any] | None = None) -> None:
        from cluster.config import RouterSection
        from router.api import build_app
        from router.server import ServerThread
        from workers.text.tokenizer import Tokenizer

        refs = [WorkerRef(w["worker_id"], w["role"], w["handle"], w["info"]) for w in workers]
        self.metrics = Metrics(model_name)
        metrics = self.metrics
        router = RouterSection.model_validate(routing or {})
        self.pool = PoolClient(refs, RequestLimits(**limits), max_queued=max_queued,
                               on_stats=metrics.on_worker_stats, controller=controller, metrics=metrics,
                               policy=router.make_policy(), events_interval_s=router.events_interval_s,
                               index_ttl_s=router.index_ttl_s, sole_front=not reuse_port)
        tokenizer = Tokenizer.from_folder(model_path)
        app = build_app(MeteredClient(self.pool, metrics), tokenizer, model_name, limits["max_model_len"],
                        ready=self.pool.ready, metrics_registry=metrics.registry,
                        on_startup=[self.pool.start], on_shutdown=[self.pool.stop])
        self.server = ServerThread(app, host=host, port=port, log_level="warning", reuse_port=reuse_port)
        self.server.start()

    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        """Stop accepting, give open streams the graceful timeout, then stop polling workers."""
        self.server.stop()


def start_fronts(cluster: Any, count: int, host: str, port: int, model_name: str, max_queued: int,
                 routing: dict[str, Any] | None = None) -> list[Any]:
    """Start ``count`` HTTPFront actors on ``host:port`` and wait until each accepts connections."""
    import ray

    workers = [{"worker_id": w.worker_id, "role": w.role, "handle": w.handle, "info": w.info}
               for w in cluster.workers]
    limits = cluster.limits.__dict__.copy()
    # On this (the driver's) node, whose address ``host`` is: on a multi-node cluster a front placed
    # elsewhere could not bind it, and the URL printed here would point at the wrong machine.
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(HTTPFront).options(num_cpus=0, max_concurrency=4, scheduling_strategy=here)
    fronts = [actor.remote(workers, limits, str(cluster.model_path), model_name, host, port, max_queued,
                           cluster.controller, count > 1, routing) for _ in range(count)]
    ray.get([f.url.remote() for f in fronts])
    return fronts


def stop_fronts(fronts: list[Any], timeout_s: float = 30.0) -> None:
    import ray

    try:
        ray.get([f.stop.remote() for f in fronts], timeout=timeout_s)
    except Exception as exc:  # a front that died or hangs is killed below anyway
        log.warning("front did not stop cleanly: %r", exc)
    for f in fronts:
        ray.kill(f)

