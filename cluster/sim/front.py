"""The HTTP front on the virtual clock: the live front's decisions (``cluster.front``: routing over
the prefix index and each worker's load, stage-2 admission, placement accounting, delta order),
called as ``cluster.front.client.PoolClient`` calls them, with the client's records kept as
``baton bench`` keeps them (``cluster.bench.metrics.RequestRecord``).

Not modelled: tokenization and the HTTP/SSE hop (the simulated client sends token ids, as
``baton bench`` does), worker failures and migrations (a failed KV shipment fails its request).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from baton_serve.cluster.admission.gate import AdmissionError
from baton_serve.cluster.bench.metrics import RequestRecord
from baton_serve.cluster.front import admission as stage2
from baton_serve.cluster.front.placement import Placement
from baton_serve.cluster.front.routing import FrontRouter, output_budget
from baton_serve.cluster.front.streams import Stream
from baton_serve.cluster.front.workers import CacheLayout, WorkerRef, is_colocated
from baton_serve.cluster.sim.events import EventLoop
from baton_serve.cluster.sim.requests import SimRequest
from baton_serve.cluster.sim.worker import SimWorker
from baton_serve.router.prefix_index import PrefixIndex
from baton_serve.router.routing import Decision, RoutingPolicy
from baton_serve.workers.engine.outputs import TokenDelta
from baton_serve.workers.engine.validation import RequestLimits
from baton_serve.workers.errors import BatonError
from baton_serve.workers.sampling.params import SamplingParams


@dataclass
class _Flight:
    """One request from its arrival at the front to its last token."""

    req: SimRequest
    record: RequestRecord
    wire_id: str
    params: SamplingParams
    arrival: float  # virtual time it reached the front
    stream: Stream | None = None
    placed: Placement | None = None
    waiter: Any = None
    done: bool = False
    on_done: list[Callable[[], None]] = field(default_factory=list)


class SimFront:
    """One front over ``workers``: routes with ``policy``, admits with ``admission`` (a
    ``KVAdmission`` on the loop's clock, or None), refreshes loads every ``stats_interval_s`` and the
    prefix index every ``events_interval_s``. Record times are seconds
    from ``t0`` (the measured phase's start)."""

    def __init__(self, loop: EventLoop, workers: list[SimWorker], limits: RequestLimits, policy: RoutingPolicy,
                 admission: Any = None, max_queued: int = 512, stats_interval_s: float = 1.0,
                 events_interval_s: float = 0.25, index_ttl_s: float = 10.0, request_delay_s: float = 0.0) -> None:
        self.loop = loop
        self.request_delay_s = request_delay_s
        self.sims = {w.worker_id: w for w in workers}
        self.refs = {w.worker_id: WorkerRef(w.worker_id, w.role, None, w.info()) for w in workers}
        refs = list(self.refs.values())
        self.colocated = is_colocated(refs)
        self.router = FrontRouter(policy, limits, CacheLayout.of(refs), PrefixIndex(ttl_s=index_ttl_s),
                                  self.colocated, clock=loop.clock)
        self.limits = limits
        self.admission = admission
        self.max_queued = max_queued
        self.stats_interval_s, self.events_interval_s = stats_interval_s, events_interval_s
        self.t0 = 0.0
        self._by_wire: dict[str, _Flight] = {}
        self._in_flight = 0
        # each measured or warm-up record at its end, with the role of the worker that made its first token
        self.on_finished: list[Callable[[RequestRecord, str | None], None]] = []
        for w in workers:
            w.emit = self._deliver
        # Both loops run as long as the simulation does (the run stops once the client is done).
        loop.at(loop.now, self._stats)
        loop.at(loop.now, self._events)

    # ------------------------------------------------------------------ requests in
    def send(self, req: SimRequest, record: RequestRecord, on_done: Callable[[], None] | None = None) -> None:
        """``req`` reaches the front now (the client's send); ``record`` fills in as it runs."""
        now = self.loop.now
        record.t_sent = now - self.t0
        params = SamplingParams(max_tokens=req.output_len, ignore_eos=True, temperature=0.0)
        flight = _Flight(req, record, f"r{req.index}", params, now, on_done=[on_done] if on_done else [])
        if self.request_delay_s > 0:  # the HTTP hop and the front's own work before it routes
            self.loop.after(self.request_delay_s, lambda: self._enter(flight))
        else:
            self._enter(flight)

    def _enter(self, flight: _Flight) -> None:
        req, params = flight.req, flight.params
        flight.arrival = self.loop.now
        try:
            self.limits.validate(req.prompt_token_ids, params)
            if self._in_flight >= self.max_queued:
                raise AdmissionError(429, f"{self._in_flight} requests in flight", "queue_full")
            decision, hashes = self.router.route(self.refs.values(), req.prompt_token_ids, None, params,
                                                 log_as=flight.wire_id)
        except (BatonError, AdmissionError) as exc:
            self._fail(flight, exc)
            return
        self._in_flight += 1
        self._by_wire[flight.wire_id] = flight
        if self.admission is None:
            self._place(flight, decision, hashes)
            return
        self._admit(flight, decision, hashes)

    def _keepers(self) -> list[str]:
        role = "colocated" if self.colocated else "decode"
        return [w.worker_id for w in self.refs.values() if w.alive and not w.draining and w.role == role]

    def set_role(self, worker_id: str, role: str) -> None:
        """A drained worker takes ``role`` and is open to new requests again."""
        self.sims[worker_id].set_role(role)
        ref = self.refs[worker_id]
        ref.role, ref.draining = role, False
        ref.info = self.sims[worker_id].info()
        if self.admission is not None and role == "decode":  # as the live front does (PoolClient._role_changed)
            self.admission.ensure_ledger(worker_id, int(ref.info["num_blocks"]))

    def _admit(self, flight: _Flight, decision: Decision, hashes: list[bytes]) -> None:
        """Stage 2 as ``PoolClient._admit`` runs it, the queue on the virtual clock."""
        prompt = flight.req.prompt_token_ids
        keeper = stage2.keeper(decision)
        budget = output_budget(self.limits, len(prompt), flight.params)
        demand = stage2.kv_demand(flight.wire_id, None, len(prompt), budget, flight.params, 0, hashes)

        def admitted(held: Any) -> None:
            flight.params = stage2.grant(held, flight.params, None, len(prompt), True, flight.wire_id)
            d, h = decision, hashes
            if stage2.stale_route(held, decision):
                d, h = self.router.route(self.refs.values(), prompt, None, flight.params, keeper=held.worker_id,
                                         log_as=flight.wire_id)
            self._place(flight, d, h)

        try:
            held = self.admission.try_reserve(demand, self._keepers(), keeper.worker_id)
        except AdmissionError as exc:
            self._finish(flight, error=exc)
            return
        if held is not None:
            admitted(held)
            return

        def woken(outcome: Any) -> None:
            admitted(self.admission.collect(demand, outcome, self.loop.now - flight.arrival))

        flight.waiter = self.admission.enqueue(demand, self._keepers, lambda: keeper.worker_id, woken,
                                               lambda exc: self._finish(flight, error=exc))

        def deadline() -> None:
            if not flight.waiter.done:
                self.admission.dequeue(flight.waiter)
                self._finish(flight, error=self.admission.timed_out(demand, self._keepers()))

        self.loop.after(self.admission.queue_timeout_s, deadline)

    def _place(self, flight: _Flight, decision: Decision, hashes: list[bytes]) -> None:
        """``PoolClient._place`` for a first placement: charge the loads, add it to the first worker."""
        params, prompt = flight.params, flight.req.prompt_token_ids
        first, decode = decision.first, decision.decode
        stream = flight.stream = Stream(None, params.n, {first.worker_id} | ({decode.worker_id} if decode else set()),
                                        flight.wire_id, n=params.n, prefill_id=first.worker_id if decode else None,
                                        decode_id=decode.worker_id if decode else None,
                                        wires={i: flight.wire_id for i in range(params.n)})
        stream.placed_n = params.n
        budget = output_budget(self.limits, len(prompt), params)
        flight.placed = Placement.open(decision, hashes, len(prompt), 0, budget * params.n, budget,
                                       self.router.block_size)
        self.sims[first.worker_id].add_request(flight.wire_id, prompt, params, flight.arrival,
                                               decode.worker_id if decode else None)

    # ------------------------------------------------------------------ deltas out
    def _deliver(self, source: str, deltas: list[TokenDelta]) -> None:
        for delta in deltas:
            flight = self._by_wire.get(delta.request_id)
            if flight is None or flight.stream is None:
                continue
            for d, src in flight.stream.in_order(delta, source):
                self._take(flight, d, src)

    def _take(self, flight: _Flight, delta: TokenDelta, source: str | None) -> None:
        stream, placed, rec = flight.stream, flight.placed, flight.record
        if flight.done:
            return
        if delta.recoverable:  # the live front would place it again; here it fails
            self._finish(flight, error=RuntimeError(delta.stop_reason))
            return
        if stream.hands_over(delta, source):
            stream.handed_over(delta.index)
        if placed.prefilling and (delta.token_ids or delta.finish_reason is not None):
            self.router.prefilled(placed, bool(delta.token_ids))
        if not stream.take(delta):
            return
        placed.produced(delta, stream.emitted[delta.index])
        if delta.token_ids:
            rec.emit_times.append(self.loop.now - self.t0)
            rec.output_tokens += len(delta.token_ids)
            if rec.cached_tokens is None:
                rec.cached_tokens = delta.num_cached_tokens
        if delta.finish_reason is not None:
            stream.remaining -= 1
            if delta.finish_reason == "abort":
                self._finish(flight, error=RuntimeError(delta.stop_reason or "aborted"))
            elif stream.remaining == 0:
                self._finish(flight)

    def _finish(self, flight: _Flight, error: BaseException | None = None) -> None:
        if flight.done:
            return
        flight.done = True
        rec = flight.record
        rec.t_end = self.loop.now - self.t0
        rec.ok = error is None
        if error is not None:
            rec.status = getattr(error, "status", 500)
            rec.error = str(error)
        if flight.wire_id in self._by_wire:
            del self._by_wire[flight.wire_id]
            self._in_flight -= 1
            if flight.placed is not None:
                flight.placed.close()
                if error is not None:
                    for wid in flight.stream.workers:
                        self.sims[wid].submit(lambda w=self.sims[wid]: w.core.abort_request(flight.wire_id))
            if self.admission is not None:
                self.admission.release(flight.wire_id)
        first_role = flight.placed.first.role if flight.placed is not None else None
        for fn in self.on_finished:
            fn(rec, first_role)
        for fn in flight.on_done:
            fn()

    def _fail(self, flight: _Flight, error: BaseException) -> None:
        """Refused before routing: counted like a request the server answered with an error."""
        self._finish(flight, error)

    # ------------------------------------------------------------------ what the front keeps in step
    def _stats(self) -> None:
        """Every worker's load from its stats, as the front's stats loop takes them."""
        now = self.loop.now
        for wid, ref in self.refs.items():
            ref.load.update(self.sims[wid].stats(), now=now)
        self.loop.after(self.stats_interval_s, self._stats)

    def _events(self) -> None:
        """Every worker's KV events into the prefix index, as the front's events loop pulls them."""
        index = self.router.index
        for wid in self.refs:
            self.router.apply_events(wid, self.sims[wid].core.kv_events.since(*index.cursor(wid)))
        self.router.expire(self.refs.values())
        self.loop.after(self.events_interval_s, self._events)
