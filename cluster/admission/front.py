"""Admission as one HTTP front runs it: built from the config, wired to the front's metrics, drained
on shutdown.

Every front builds its own (rates and KV shares split ``1/num_fronts``); they share the tenants
file and the usage database (SQLite in WAL mode takes one writer at a time and the others retry).
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baton_serve.cluster.admission.gate import AdmissionError, IngressGate
from baton_serve.cluster.admission.kv import KVAdmission
from baton_serve.cluster.admission.tenants import TenantDirectory
from baton_serve.cluster.usage import UsageStore, make_usage_store

log = logging.getLogger("baton.admission")


def tenant_directory(server: Any) -> TenantDirectory:
    """The tenants the ``[server]`` section names: a tenants file, one ``api_key``, or nobody (open)."""
    api_key = server.api_key or os.environ.get("BATON_API_KEY") or None
    if server.tenants:
        return TenantDirectory.from_file(server.tenants, api_key=api_key)
    if api_key:
        return TenantDirectory.single_key(api_key)
    return TenantDirectory.anonymous()


def usage_path(usage: Any) -> Path:
    if usage.path:
        return Path(usage.path).expanduser()
    from baton_serve.workers.checkpoint.default_model import cache_root

    return cache_root() / "usage.sqlite3"


def kv_admission(adm: Any, capacities: dict[str, int], block_size: int, num_fronts: int = 1, metrics: Any = None,
                 clock: Any = None) -> KVAdmission:
    """Stage 2 as the ``[admission]`` section ``adm`` sets it, over the KV-keeping workers'
    ``capacities`` (blocks), one front's share of them; the simulator builds it the same way."""
    extra = {"clock": clock} if clock is not None else {}
    return KVAdmission(capacities, block_size, share=1.0 / max(num_fronts, 1), policy=adm.policy,
                       reserve_fraction=adm.reserve_fraction, queue_timeout_s=adm.queue_timeout_s,
                       max_queued_per_class=adm.max_queued_per_class,
                       on_queue=metrics.observe_admission_queue if metrics else None,
                       on_ledger=metrics.observe_ledger if metrics else None,
                       on_reject=metrics.observe_rejected if metrics else None, **extra)


@dataclass
class FrontAdmission:
    """Stage 1 (``gate``), stage 2 (``kv``), the usage store and the tenants of one front."""

    directory: TenantDirectory
    gate: IngressGate
    kv: KVAdmission
    usage: UsageStore | None

    @classmethod
    def build(cls, config: Any, workers: list[Any], block_size: int, model: str, num_fronts: int = 1,
              metrics: Any = None) -> FrontAdmission:
        """From a ``ClusterConfig``: ``workers`` are the front's ``WorkerRef``s (their ``info``
        gives each one's block count)."""
        server, adm = config.server, config.admission
        directory = tenant_directory(server)
        usage = make_usage_store(config.usage.store, path=usage_path(config.usage)) if config.usage.store else None
        fingerprint = _weights_fingerprint(workers)
        gate = IngressGate(directory, max_queued=server.max_queued_requests, max_body_bytes=server.max_body_bytes,
                           num_fronts=num_fronts, model=model, weights_fingerprint=fingerprint, usage=usage,
                           on_reject=metrics.observe_rejected if metrics else None,
                           on_finish=metrics.observe_tenant_finish if metrics else None)
        keepers = [w for w in workers if w.role in ("decode", "colocated")]
        kv = kv_admission(adm, {w.worker_id: int(w.info.get("num_blocks", 0)) for w in keepers}, block_size,
                          num_fronts, metrics)
        return cls(directory, gate, kv, usage)

    def drain_begin(self) -> None:
        """SIGTERM: refuse new work (503) and let ``/ready`` say so."""
        self.gate.start_draining()

    def abort_queued(self) -> int:
        """End the requests still queued for KV room (call on the front's event loop)."""
        return self.kv.fail_waiting(AdmissionError(503, "the server is shutting down", "draining", retry_after_s=5))

    def close(self) -> None:
        """Flush every usage record to disk and close the store."""
        if self.usage is not None:
            try:
                self.usage.close()
            except Exception:
                log.exception("usage store did not close cleanly")


async def drain(front: FrontAdmission, pool: Any, timeout_s: float, poll_s: float = 0.05) -> int:
    """Let open requests finish for up to ``timeout_s``, then end the rest with finish_reason
    "abort"; returns how many were aborted. Run on the front's event loop after ``drain_begin``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while front.gate.in_flight > 0 and loop.time() < deadline:
        await asyncio.sleep(poll_s)
    aborted = 0
    if front.gate.in_flight > 0:
        aborted = front.abort_queued() + pool.abort_all("the server is shutting down")
        log.warning("drain: %d requests still open after %.0fs: aborted", aborted, timeout_s)
        # The abort deltas reach each stream on this loop; give the writers a moment to send them.
        end = loop.time() + 5.0
        while front.gate.in_flight > 0 and loop.time() < end:
            await asyncio.sleep(poll_s)
    return aborted


def _weights_fingerprint(workers: list[Any]) -> str:
    for w in workers:
        ns = w.info.get("cache_namespace") or {}
        if ns.get("weights_hash"):
            return str(ns["weights_hash"])
    return ""
