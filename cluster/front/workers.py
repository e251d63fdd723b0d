"""A worker actor as the front knows it, and what the front reads from the pool as a whole."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from baton_serve.router.routing import WorkerLoad
from baton_serve.workers.blocks.prefix_hash import CacheNamespace


@dataclass
class WorkerRef:
    """A worker actor as the front knows it: its role, handle, the info it reported at start,
    and the load the front tracks (``handle`` is None in the simulator and in unit tests)."""

    worker_id: str
    role: str
    handle: Any
    info: dict[str, Any] = field(default_factory=dict)
    load: WorkerLoad = field(default_factory=WorkerLoad)
    alive: bool = True
    incarnation: int = 0  # how many times the controller has restarted it (a new actor each time)
    draining: bool = False  # the rebalancer is moving it: it finishes its requests, takes no new ones


@dataclass(frozen=True)
class CacheLayout:
    """The prefix-cache namespace (None: the workers report none, so nothing is hashed), block
    size and bytes of one KV block, as the workers report them."""

    namespace: CacheNamespace | None
    block_size: int
    kv_block_bytes: int

    @classmethod
    def of(cls, workers: Iterable[WorkerRef]) -> CacheLayout:
        workers = list(workers)
        for w in workers:
            ns = w.info.get("cache_namespace")
            if ns:
                return cls(CacheNamespace(**ns), int(ns["block_size"]), int(w.info.get("kv_block_bytes", 0)))
        return cls(None, int(workers[0].info.get("block_size", 16)) if workers else 16, 0)


def is_colocated(workers: Iterable[WorkerRef]) -> bool:
    """True when the pool's workers do both phases (no prefill/decode split)."""
    return any(w.role == "colocated" for w in workers)


def ready(workers: Iterable[WorkerRef]) -> bool:
    """True while some live worker can take a request from prompt to its last token."""
    roles = {w.role for w in workers if w.alive}
    return "colocated" in roles or {"prefill", "decode"} <= roles
