"""One simulated run: a layout's workers and front on a virtual clock, given the workload
``baton bench`` would send, summarised as ``baton bench`` summarises a live run."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from baton_serve.cluster.admission.front import kv_admission
from baton_serve.cluster.bench.metrics import RequestRecord, summarize
from baton_serve.cluster.bench.plan import Layout
from baton_serve.cluster.bench.runner import BenchConfig
from baton_serve.cluster.config import ClusterConfig
from baton_serve.cluster.sim.board import CoreBoard
from baton_serve.cluster.sim.events import EventLoop
from baton_serve.cluster.sim.front import SimFront
from baton_serve.cluster.sim.requests import SimRequest, SimWorkload, build_workload
from baton_serve.cluster.sim.worker import SimWorker
from baton_serve.workers.blocks.prefix_hash import CacheNamespace
from baton_serve.workers.engine.config import engine_config
from baton_serve.workers.engine.validation import RequestLimits


@dataclass(frozen=True)
class SimHardware:
    """Where the simulated workers run: ``shared_cores`` > 0 puts them all on one machine taking
    turns at that many cores (as local workers do), each step asking ``threads`` of them; 0 gives
    each worker hardware of its own. ``workers_per_node`` groups workers into nodes (KV between
    nodes goes over ``collective``, within one over ``shared_memory`` when the transport is auto)."""

    shared_cores: int = 0
    threads: int = 1
    workers_per_node: int = 8

    def __post_init__(self) -> None:
        if self.shared_cores < 0 or self.threads < 1 or self.workers_per_node < 1:
            raise ValueError(f"shared_cores >= 0, threads >= 1 and workers_per_node >= 1, got {self}")


@dataclass
class SimResult:
    """A simulated layout's summary (``baton bench``'s keys) and what the simulation itself cost."""

    summary: dict[str, Any]
    records: list[RequestRecord]
    wall_s: float
    events: int
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    admission_blocks_held: int = 0  # reservations not released at the end (zero after a full run)
    rebalance: dict[str, Any] | None = None  # the rebalancer's flips and decisions, where it ran


def _roles(layout: Layout) -> list[str]:
    if layout.colocated:
        return ["colocated"] * layout.colocated
    return ["prefill"] * layout.prefill + ["decode"] * layout.decode


def build_workers(loop: EventLoop, config: ClusterConfig, layout: Layout, profile: Any,
                  hardware: SimHardware) -> list[SimWorker]:
    """The layout's workers with the engine the config gives each one, sized as a worker sizes its
    KV cache (``kv_cache_memory_gib`` over the profile's block bytes, or ``num_kv_blocks``)."""
    from baton_serve.cluster.launcher import worker_engine_kwargs

    kwargs = worker_engine_kwargs(config)
    kwargs["dtype"] = profile.model["dtype"]
    eng = engine_config(**kwargs)
    block_bytes = int(profile.model["kv_block_bytes"])
    num_blocks = eng.num_kv_blocks or int(eng.kv_cache_memory_gib * (1 << 30)) // block_bytes
    max_len = eng.max_model_len or int(profile.model.get("max_position_embeddings", 8192))
    ns = CacheNamespace(model=str(profile.model.get("name", "sim")), weights_hash="simulated",
                        kv_dtype=eng.dtype, block_size=eng.block_size)
    board = CoreBoard("sim-board", hardware.shared_cores) if hardware.shared_cores else None
    counts: dict[str, int] = {}
    workers = []
    for i, role in enumerate(_roles(layout)):
        k = counts[role] = counts.get(role, -1) + 1
        workers.append(SimWorker(f"{role}-{k}", role, loop, profile, eng, num_blocks, max_len, ns,
                                 emit=lambda *a: None, board=board, threads=hardware.threads,
                                 node="node-0" if board else f"node-{i // hardware.workers_per_node}",
                                 transport=config.kv_transfer.transport, kv_timeout_s=config.kv_transfer.timeout_s,
                                 hardware=f"sim:{profile.machine.get('device', 'cpu')}"))
    for w in workers:
        w.peers = {o.worker_id: o for o in workers if o is not w}
    return workers


def _record(req: SimRequest, scheduled: float) -> RequestRecord:
    return RequestRecord(index=req.index, prompt_len=len(req.prompt_token_ids), expected_output_len=req.output_len,
                         t_scheduled=scheduled)


class _Client:
    """The bench client on the virtual clock: warm-ups one at a time, then open loop on the schedule
    (queued in the client beyond ``cap`` in flight) or ``users`` closed-loop users."""

    def __init__(self, loop: EventLoop, front: SimFront, workload: SimWorkload, cap: int | None) -> None:
        self.loop, self.front, self.workload, self.cap = loop, front, workload, cap
        self.records: list[RequestRecord] = []
        self.done = 0
        self._in_flight = 0
        self._queued: list[tuple[SimRequest, RequestRecord]] = []
        self._next = 0

    def start(self) -> None:
        self._warm(0)

    def finished(self) -> bool:
        return self.done >= len(self.workload.requests)

    def _warm(self, i: int) -> None:
        warm = self.workload.warmups
        if i >= len(warm):
            self._measure()
            return
        self.front.t0 = self.loop.now
        self.front.send(warm[i], _record(warm[i], 0.0), on_done=lambda: self._warm(i + 1))

    def _measure(self) -> None:
        t0 = self.front.t0 = self.loop.now
        reqs = self.workload.requests
        if self.workload.users is not None:
            for _ in range(min(self.workload.users, len(reqs))):
                self._user()
            return
        for req in reqs:
            rec = _record(req, req.arrival_s or 0.0)
            self.records.append(rec)
            self.loop.at(t0 + rec.t_scheduled, lambda r=req, c=rec: self._arrive(r, c))

    def _user(self) -> None:
        if self._next >= len(self.workload.requests):
            return
        req = self.workload.requests[self._next]
        self._next += 1
        rec = _record(req, self.loop.now - self.front.t0)
        rec.t_ready = rec.t_scheduled
        self.records.append(rec)
        self.front.send(req, rec, on_done=self._user_done)

    def _user_done(self) -> None:
        self.done += 1
        self._user()

    def _arrive(self, req: SimRequest, rec: RequestRecord) -> None:
        if self.cap is not None and self._in_flight >= self.cap:
            self._queued.append((req, rec))
            return
        rec.t_ready = self.loop.now - self.front.t0
        self._in_flight += 1
        self.front.send(req, rec, on_done=self._open_done)

    def _open_done(self) -> None:
        self.done += 1
        self._in_flight -= 1
        if self._queued:
            self._arrive(*self._queued.pop(0))


def simulate(config: ClusterConfig, layout: Layout, bench: BenchConfig, profile: Any,
             hardware: SimHardware = SimHardware(), seed: int = 0, max_sim_s: float = math.inf) -> SimResult:
    """Simulate ``bench`` against ``layout`` deployed as ``config`` says, on ``profile``'s timings."""
    started = time.perf_counter()
    loop = EventLoop()
    workers = build_workers(loop, config, layout, profile, hardware)
    eng = workers[0].core
    limits = RequestLimits(eng.vocab_size, eng.max_model_len, eng.block_manager.num_blocks, eng.config.block_size)
    rebalancing = config.rebalance.enabled and not layout.colocated
    keepers = [w for w in workers if w.role in ("decode", "colocated")]
    admission = kv_admission(config.admission, {w.worker_id: w.core.block_manager.num_blocks for w in keepers},
                             eng.config.block_size, clock=loop.clock)
    router = config.router
    front = SimFront(loop, workers, limits, router.make_policy(seed), admission,
                     max_queued=config.server.max_queued_requests, events_interval_s=router.events_interval_s,
                     index_ttl_s=router.index_ttl_s, request_delay_s=profile.host.per_request_s)
    rebalance = None
    if rebalancing:
        from baton_serve.cluster.rebalance.decide import Rebalancer
        from baton_serve.cluster.rebalance.signals import SignalWindow
        from baton_serve.cluster.sim.rebalance import SimRebalance

        rb = config.rebalance
        rebalance = SimRebalance(loop, front, Rebalancer(rb.policy()), SignalWindow(rb.window_s, rb.targets()),
                                 rb.interval_s, rb.dry_run)
    workload = build_workload(bench)
    client = _Client(loop, front, workload, bench.max_concurrency if workload.users is None else None)
    loop.at(0.0, client.start)
    loop.run(until=client.finished, max_time_s=max_sim_s)
    for rec in client.records:  # still running when the simulated time ran out
        if math.isnan(rec.t_end):
            rec.ok, rec.error = False, f"not finished within {max_sim_s:g} simulated seconds"
    records = sorted(client.records, key=lambda r: r.index)
    duration = max((r.t_end for r in records if not math.isnan(r.t_end)), default=0.0)
    summary = summarize(records, duration, bench.slo, bench.percentiles)
    per_worker = {w.worker_id: {"role": w.role, "started_as": role, "steps": w.core.num_steps, "busy_s": w.core.busy_seconds,
                                "preemptions": w.core.scheduler.num_preemptions,
                                "prefill_tokens": w.core.num_prefill_tokens_computed,
                                "decode_tokens": w.core.num_decode_tokens_computed,
                                "core_wait_s": w.core_wait_seconds, "shipments": w.shipments,
                                # what a finished run must have given back: all zero
                                "blocks_held": w.core.block_manager.num_blocks - w.core.block_manager.num_free_blocks,
                                "requests_left": len(w.core.scheduler.requests) + len(w.core.paused), "parked": len(w.core.parked),
                                "incoming": len(w.core.incoming)}
                  for w, role in zip(workers, _roles(layout))}
    held = sum(ledger.reserved_blocks for ledger in admission.ledgers.values()) if admission else 0
    return SimResult(summary, records, time.perf_counter() - started, loop.events_run, per_worker, held,
                     rebalance.report() if rebalance is not None else None)
