"""The HTTP front as a Ray actor: one or more replicas share a port (SO_REUSEPORT) and route to the
same worker pools, each with its own outbox on every worker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from baton_serve.cluster.admission.front import FrontAdmission, drain
from baton_serve.cluster.config import RouterSection
from baton_serve.cluster.front import PoolClient, WorkerRef
from baton_serve.cluster.metered_client import MeteredClient
from baton_serve.cluster.metrics import Metrics
from baton_serve.cluster.metrics_merge import merge_expositions
from baton_serve.workers.engine.validation import RequestLimits
from prometheus_client import generate_latest

PEER_SCRAPE_S = 2.0  # a front that does not answer a scrape in time is left out of it (and counted)

log = logging.getLogger("baton.http")


@dataclass
class Front:
    """What one HTTP front is made of: the app and the parts a drain or a test reaches into."""

    app: Any
    pool: PoolClient
    metrics: Metrics
    admission: FrontAdmission
    gateway: Any = None  # router.gateway.Gateway
    loop: asyncio.AbstractEventLoop | None = None  # the serving event loop, once it runs


def build_front(config: Any, workers: list[WorkerRef], limits: RequestLimits, model_path: str, model_name: str | Sequence[str],
                controller: Any = None, sole_front: bool = True, num_fronts: int = 1,
                run_owners: Any = None) -> Front:
    """Pool client, metrics, admission and the OpenAI app of one front, from a ``ClusterConfig``.

    ``run_owners`` (``cluster.admission.idempotency_owners.RayRunOwners``) shares idempotent runs
    with the other fronts on the port."""
    from baton_serve.router.api import build_app
    from baton_serve.router.gateway import Gateway
    from baton_serve.router.idempotency import IdempotencyStore
    from baton_serve.router.serving import served_names
    from baton_serve.workers.text.tokenizer import Tokenizer

    primary = served_names(model_name)[0]
    metrics = Metrics(primary)
    block_size = int(workers[0].info.get("block_size", 16)) if workers else 16
    admission = FrontAdmission.build(config, workers, block_size, primary, num_fronts, metrics)
    router = config.router
    pool = PoolClient(workers, limits, max_queued=config.server.max_queued_requests,
                      on_stats=metrics.on_worker_stats, controller=controller, metrics=metrics,
                      policy=router.make_policy(), events_interval_s=router.events_interval_s,
                      index_ttl_s=router.index_ttl_s, decision_log=router.decision_log,
                      sole_front=sole_front, admission=admission.kv,
                      max_migrations=config.recovery.max_migrations,
                      migration_wait_s=config.recovery.migration_wait_s,
                      probe_timeout_s=config.kv_transfer.timeout_s)
    server = config.server
    gateway = Gateway(admission.gate, IdempotencyStore(ttl_s=server.idempotency_ttl_s,
                                                       grace_s=server.idempotency_grace_s), owners=run_owners)
    tokenizer = Tokenizer.from_folder(model_path)
    front = Front(None, pool, metrics, admission, gateway)

    def remember_loop() -> None:
        front.loop = asyncio.get_running_loop()

    async def deployment_metrics() -> bytes:
        """This front's metrics with the other fronts' per-front share added (one scrape target)."""
        own = generate_latest(metrics.registry)
        owners = run_owners  # the other fronts' handles live there (several fronts only)
        peers = [h for k, h in owners.fronts.items() if k != owners.front_id] if owners is not None else []
        if not peers:
            return own
        replies = await asyncio.gather(*(asyncio.wait_for(h.metrics_text.remote(), PEER_SCRAPE_S) for h in peers),
                                       return_exceptions=True)
        texts = [r for r in replies if isinstance(r, bytes)]
        metrics.peer_scrape_failures.inc(len(replies) - len(texts))
        return merge_expositions(own, texts, metrics.per_front)

    front.app = build_app(MeteredClient(pool, metrics), tokenizer, model_name, limits.max_model_len,
                          ready=pool.ready, metrics_registry=metrics.registry,
                          on_startup=[remember_loop, pool.start], on_shutdown=[pool.stop], gateway=gateway,
                          admin=admission.directory.is_admin if server.protect_metrics else None,
                          protect_probes=server.protect_probes, status=pool.status,
                          metrics_text=deployment_metrics)
    return front


class HTTPFront:
    """Builds a pool client, metrics, admission and the OpenAI app, and serves it on ``host:port``."""

    def __init__(self, workers: list[dict[str, Any]], limits: dict[str, int], model_path: str,
                 model_name: str | Sequence[str], host: str, port: int, max_queued: int, controller: Any = None,
                 reuse_port: bool = False, routing: dict[str, Any] | None = None,
                 config: dict[str, Any] | None = None, num_fronts: int = 1, front_index: int = 0,
                 owners_directory: Any = None) -> None:
        from baton_serve.cluster.admission.idempotency_owners import RayRunOwners
        from baton_serve.cluster.config import ClusterConfig
        from baton_serve.router.server import ServerThread

        refs = [WorkerRef(w["worker_id"], w["role"], w["handle"], w["info"]) for w in workers]
        cfg = ClusterConfig.model_validate(config or {})
        cfg = cfg.with_overrides(**{"server.max_queued_requests": max_queued})
        if routing is not None:
            cfg = cfg.model_copy(update={"router": RouterSection.model_validate(routing)})
        if cfg.server.log_format != "text":
            from baton_serve.router.request_id import configure_logging

            configure_logging(cfg.server.log_format)  # this actor's process: its lines carry request ids
        self.front_id = f"front-{front_index}"
        owners = RayRunOwners(owners_directory, self.front_id) if owners_directory is not None else None
        self.front = build_front(cfg, refs, RequestLimits(**limits), model_path, model_name, controller,
                                 sole_front=not reuse_port, num_fronts=num_fronts, run_owners=owners)
        self.metrics, self.pool = self.front.metrics, self.front.pool
        self.drain_timeout_s = cfg.server.drain_timeout_s
        self.server = ServerThread(self.front.app, host=host, port=port, log_level="warning", reuse_port=reuse_port,
                                   graceful_timeout_s=5.0)
        self.server.start()

    def url(self) -> str:
        return self.server.url

    def set_fronts(self, fronts: dict[str, Any]) -> None:
        """The other fronts' handles, by front id (to replay idempotent runs they record)."""
        if self.front.gateway.owners is not None:
            self.front.gateway.owners.fronts = dict(fronts)

    def idempotent_snapshot(self, scope: str, key: str, after: int, wait_s: float) -> dict[str, Any] | None:
        """This front's record of an idempotent run, for a retry another front took (long poll)."""
        if self.front.loop is None:
            return None
        future = asyncio.run_coroutine_threadsafe(self.front.gateway.snapshot(scope, key, after, wait_s),
                                                  self.front.loop)
        return future.result(wait_s + 30)

    def metrics_text(self) -> bytes:
        """This front's own exposition, for the front a scrape landed on to add in."""
        return generate_latest(self.metrics.registry)

    def stats(self) -> dict[str, Any]:
        """What this front has seen: authenticated arrivals per tenant, requests in flight."""
        gate = self.front.admission.gate
        return {"front_id": self.front_id, "in_flight": gate.in_flight,
                "arrivals": {name: gate.arrivals(name) for name in gate.directory.tenants}}

    def drain(self, timeout_s: float | None = None) -> int:
        """SIGTERM: ``/ready`` 503 and new requests 503 at once; open streams get ``timeout_s``
        (``[server] drain_timeout_s``) to finish, then end with finish_reason "abort". Returns how
        many were aborted; every usage record is on disk when it returns."""
        timeout = self.drain_timeout_s if timeout_s is None else timeout_s
        self.front.admission.drain_begin()
        aborted = 0
        if self.front.loop is not None:
            future = asyncio.run_coroutine_threadsafe(drain(self.front.admission, self.pool, timeout), self.front.loop)
            aborted = future.result(timeout + 30)
        self.front.admission.close()
        return aborted

    def stop(self) -> None:
        """Stop accepting, give open streams the graceful timeout, then stop polling workers."""
        self.server.stop()
        self.front.admission.close()


def start_fronts(cluster: Any, count: int, host: str, port: int, model_name: str | Sequence[str], max_queued: int,
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
    # Threads for the long polls of idempotent replays between fronts, beside drain and stats calls.
    actor = ray.remote(HTTPFront)
    options = {"num_cpus": 0, "max_concurrency": 64, "scheduling_strategy": here}
    config = cluster.config.model_dump()
    owners = None
    if count > 1:
        from baton_serve.cluster.admission.idempotency_owners import IdempotencyOwners

        owners = ray.remote(IdempotencyOwners).options(num_cpus=0, scheduling_strategy=here).remote(
            cluster.config.server.idempotency_ttl_s)
    fronts = [actor.options(**options, **cluster.actor_name(f"front-{i}")).remote(
        workers, limits, str(cluster.model_path), model_name, host, port, max_queued, cluster.controller,
        count > 1, routing, config, count, i, owners) for i in range(count)]
    ray.get([f.url.remote() for f in fronts])
    if owners is not None:
        by_id = {f"front-{i}": f for i, f in enumerate(fronts)}
        ray.get([f.set_fronts.remote(by_id) for f in fronts])
    return fronts


def drain_fronts(fronts: list[Any], timeout_s: float) -> int:
    """Drain every front at once (see ``HTTPFront.drain``); returns the requests aborted."""
    import ray

    try:
        return sum(ray.get([f.drain.remote(timeout_s) for f in fronts], timeout=timeout_s + 60))
    except Exception as exc:  # a front that died or hangs is stopped and killed anyway
        log.warning("front did not drain cleanly: %r", exc)
        return 0


def stop_fronts(fronts: list[Any], timeout_s: float = 30.0) -> None:
    """Stop and kill the fronts; none (start failed before them) touches no Ray."""
    import ray

    if not fronts:  # ray.get([]) would start a Ray instance where the deployment failed before it
        return
    try:
        ray.get([f.stop.remote() for f in fronts], timeout=timeout_s)
    except Exception as exc:  # a front that died or hangs is killed below anyway
        log.warning("front did not stop cleanly: %r", exc)
    for f in fronts:
        ray.kill(f)

