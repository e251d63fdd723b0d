"""``PoolClient``: the ``EngineClient`` over prefill/decode (or colocated) Ray worker actors.

It carries out what the decision modules say: ``routing`` picks the workers, ``admission`` sizes
the KV demand and reads the reservation, ``placement`` keeps each worker's load, ``streams`` orders
each request's deltas and says where a migrated sample resumes. The I/O is ``links`` (the
workers' output streams) and ``sync`` (stats and KV events); here are the Ray calls that add,
abort, pause and finish requests on the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from baton_serve.cluster.front import admission as stage2
from baton_serve.cluster.front.links import WorkerLinks
from baton_serve.cluster.front.placement import Placement
from baton_serve.cluster.front.routing import FrontRouter, output_budget
from baton_serve.cluster.front.streams import Migrate, Stream
from baton_serve.cluster.front.sync import PoolSync
from baton_serve.cluster.front.workers import CacheLayout, WorkerRef, is_colocated
from baton_serve.cluster.front.workers import ready as pool_ready
from baton_serve.router.prefix_index import PrefixIndex
from baton_serve.router.routing import Decision, RoutingPolicy, WorkerLoad, make_policy
from baton_serve.router.routing.decision_log import DecisionLog
from baton_serve.workers.actor.messages import params_to_dict
from baton_serve.workers.engine.outputs import TokenDelta
from baton_serve.workers.engine.validation import RequestLimits
from baton_serve.workers.errors import InvalidRequestError, OverloadedError, WorkerLostError
from baton_serve.workers.sampling.params import SamplingParams

log = logging.getLogger("baton.pool")


class PoolClient:
    """Routes requests over prefill/decode (or colocated) workers and streams their deltas back.

    Routing: a policy chosen by name (``router.routing``) sees each live worker's load and how much
    of the prompt it holds according to the prefix index, which this front keeps in step with every
    worker's KV events (pulled every ``events_interval_s``). ``metrics`` (optional) records each
    decision, the cost model's TTFT estimate against the measured one, and the index's state.

    Backpressure: when a reader falls ``high_water`` deltas behind, its request is paused on the
    workers (descheduled, KV kept) and resumed once the backlog drains below ``low_water``, so a
    slow client costs memory for at most ``high_water`` deltas and no compute.

    Migration: when a worker holding a request dies, its unfinished samples are placed again
    (up to ``max_migrations`` times, waiting up to ``migration_wait_s`` for a live worker) and
    resume from the tokens the caller already has, so the stream neither repeats nor skips one.
    """

    high_water = 64
    low_water = 8

    def __init__(self, workers: list[WorkerRef], limits: RequestLimits, max_queued: int = 512,
                 policy: RoutingPolicy | str = "cost", on_stats: Any = None, controller: Any = None,
                 metrics: Any = None, events_interval_s: float = 0.25, index_ttl_s: float = 10.0,
                 sole_front: bool = True, admission: Any = None, max_migrations: int = 3,
                 migration_wait_s: float = 30.0, probe_timeout_s: float = 5.0,
                 decision_log: str | None = None) -> None:
        self.workers = {w.worker_id: w for w in workers}
        for w in workers:
            w.load.sole_front = sole_front
        self.limits = limits
        self.max_queued = max_queued
        self.metrics = metrics
        self.front_id = f"front-{uuid.uuid4().hex[:8]}"  # workers keep one stream or outbox per front
        self.colocated = is_colocated(workers)
        self.router = FrontRouter(make_policy(policy) if isinstance(policy, str) else policy, limits,
                                  CacheLayout.of(workers), PrefixIndex(ttl_s=index_ttl_s), self.colocated,
                                  metrics, DecisionLog(decision_log, self.front_id) if decision_log else None)
        self.controller = controller  # GlobalController handle, or None to ask workers directly
        self.sync = PoolSync(self.workers, self.router, controller, self._mark_dead, self._adopt, on_stats,
                             events_interval_s, on_role=self._role_changed)
        self.links = WorkerLinks(self.front_id, self._deliver, self._mark_dead)
        self.admission = admission  # cluster.admission.kv.KVAdmission: stage 2, or None to admit all
        self.max_migrations, self.migration_wait_s = max_migrations, migration_wait_s
        self.probe_timeout_s = probe_timeout_s
        self.migrations_total = 0
        self._streams: dict[str, Stream] = {}  # by the caller's request id
        self._by_wire: dict[str, Stream] = {}  # the same streams, by wire id (deltas carry it)
        self._attempts = 0
        self._tasks: list[asyncio.Task] = []

    @property
    def policy(self) -> RoutingPolicy:
        return self.router.policy

    async def start(self, stats_interval_s: float = 1.0) -> None:
        """Connect to every worker's output stream (or poll it) and start the stats loop (call
        from the serving event loop)."""
        for w in self.workers.values():
            self._tasks.append(await self.links.listen(w))
        self._tasks.append(asyncio.create_task(self.sync.stats_loop(stats_interval_s)))
        if self.router.layout.namespace is not None:
            self._tasks.append(asyncio.create_task(self.sync.events_loop()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            # Python 3.11's wait_for can swallow a cancel that lands as its inner call completes (a
            # loop's call to a worker): the loop then sleeps on, so cancel again until it ends.
            while not t.done():
                await asyncio.wait({t}, timeout=0.1)
                t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        self.links.close()
        if self.router.decision_log is not None:
            self.router.decision_log.close()

    # ------------------------------------------------------------------ EngineClient
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str | None = None,
                       arrival_time: float | None = None, ticket: Any = None) -> AsyncIterator[TokenDelta]:
        self.limits.validate(prompt_token_ids, params)
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        if len(self._streams) >= self.max_queued:
            raise OverloadedError(f"{len(self._streams)} requests in flight; the limit is {self.max_queued}")
        if self.sync.overloaded:
            raise OverloadedError("the cluster's queues are full", retry_after_s=2.0)
        arrival = arrival_time or time.monotonic()
        # Workers remember aborted ids for a while (a late add or KV must not run), and an abort
        # may land after a later request that reuses the id: so each attempt gets its own id.
        self._attempts += 1
        wire_id = f"{request_id}~{self.front_id[6:]}.{self._attempts}"
        self._streams[request_id] = placeholder = Stream(asyncio.Queue(), params.n, set(), wire_id)
        try:
            decision, hashes = self._route(prompt_token_ids, cache_salt, params, log_as=wire_id)
            if self.admission is not None:
                decision, hashes, params = await self._admit(wire_id, prompt_token_ids, cache_salt, params,
                                                             priority, ticket, decision, hashes, request_id=request_id)
        except BaseException:
            self._streams.pop(request_id, None)
            if self.admission is not None:
                self.admission.release(wire_id)
            raise
        if self._streams.get(request_id) is not placeholder:  # aborted (drain) while it queued
            if self.admission is not None:
                self.admission.release(wire_id)
            for i in range(params.n):
                yield TokenDelta(request_id, i, [], finish_reason="abort", stop_reason="aborted while queued")
            return
        stream = Stream(asyncio.Queue(), params.n, set(), wire_id, n=params.n,
                        wires={i: wire_id for i in range(params.n)})
        self._streams[request_id] = stream
        self._by_wire[wire_id] = stream
        placed: Placement | None = None
        done = False
        try:
            placed = await self._place(stream, decision, hashes, prompt_token_ids, params, priority, cache_salt,
                                       arrival, ticket)
            while True:
                delta = await stream.queue.get()
                if isinstance(delta, Migrate):
                    placed.close()
                    placed = None
                    decision, hashes, params = await self._replace(stream, delta, prompt_token_ids, params,
                                                                    cache_salt, priority, ticket)
                    placed = await self._place(stream, decision, hashes, prompt_token_ids, params, priority,
                                               cache_salt, arrival, ticket)
                    continue
                if isinstance(delta, BaseException):
                    raise delta
                if delta.recoverable:
                    # A sample's KV did not reach (or did not verify on) the decode worker: the
                    # request is placed again, from the tokens its caller has. Never a final delta:
                    # with n > 1 a second sample's failure can sit queued behind the first's, after
                    # the placement was already given up (no workers left); it ends nothing either.
                    if stream.workers:
                        self._lose(stream, stream.prefill_id or next(iter(stream.workers)),
                                   RuntimeError(delta.stop_reason), dead=False,
                                   suspects=tuple(sorted(stream.workers)))
                    continue
                if stream.paused and stream.queue.qsize() <= self.low_water:
                    self._set_paused(stream, False)
                if placed.prefilling and (delta.token_ids or delta.finish_reason is not None):
                    self.router.prefilled(placed, bool(delta.token_ids))
                    if delta.token_ids and stream.migrations == 0:
                        self.router.observe_ttft(stream.wire_id, placed, time.monotonic() - arrival)
                delta.request_id = request_id
                if not stream.take(delta):
                    continue
                placed.produced(delta, stream.emitted[delta.index])
                yield delta
                if delta.finish_reason is not None:
                    stream.remaining -= 1
                    if stream.remaining == 0:
                        done = True
                        return
        finally:
            self._streams.pop(request_id, None)
            for wire in set(stream.wires.values()):
                self._by_wire.pop(wire, None)
            if placed is not None:
                placed.close()
            if self.admission is not None:
                self.admission.release(wire_id)
            if not done:
                self._abort_on_workers(stream)

    def abort(self, request_id: str) -> None:
        """Abort a request in flight from this front (no-op when unknown or finished): the workers
        stop it, and its stream ends now with ``finish_reason`` "abort" (the workers, which forget
        the request at once, send nothing more for it)."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        self._abort_on_workers(stream)
        self._end_here(stream, "aborted")

    def abort_all(self, reason: str) -> int:
        """End every request in flight with ``finish_reason`` "abort" (drain): the workers stop
        them, and each unfinished sample's stream gets its final delta now. Returns how many."""
        for stream in list(self._streams.values()):
            self._abort_on_workers(stream)
            self._end_here(stream, reason)
        count = len(self._streams)
        self._streams.clear()  # requests still queued at stage 2 see this and end too
        return count

    def finish_sample(self, request_id: str, index: int, stop: str) -> None:
        """The caller matched stop string ``stop`` in sample ``index``: the workers stop it, and
        its stream gets its final delta now (what the workers ran on with is dropped)."""
        stream = self._streams.get(request_id)
        if stream is None or index in stream.finished:
            return
        for wid in stream.workers:
            self.workers[wid].handle.finish_sample.remote(stream.wires.get(index, stream.wire_id), index, stop)
        stream.queue.put_nowait(TokenDelta(stream.wire_id, index, [], finish_reason="stop", stop_reason=stop))

    def stats(self) -> dict[str, Any]:
        return {wid: w.load for wid, w in self.workers.items()}

    def ready(self) -> bool:
        return pool_ready(self.workers.values())

    def status(self) -> dict[str, Any]:
        """This front's view of the deployment for ``GET /status`` and ``baton status``: each
        worker (alive, incarnation, restarts, quarantined, load) and the front's migrations."""
        workers = []
        for wid, w in sorted(self.workers.items()):
            member = self.sync.members.get(wid, {})
            workers.append({
                "worker_id": wid, "role": w.role, "alive": w.alive, "incarnation": w.incarnation,
                "tensor_parallel_size": int(w.info.get("tensor_parallel_size", 1)),
                "restarts": int(member.get("restarts", 0)), "restarting": bool(member.get("restarting", False)),
                "quarantined": bool(member.get("quarantined", False)), "draining": w.draining,
                "to_role": member.get("to_role"), "num_running": w.load.num_running,
                "num_waiting": w.load.num_waiting, "kv_cache_usage": round(w.load.kv_cache_usage, 4)})
        at = self.sync.members_at
        age = None if at is None else round(time.monotonic() - at, 3)
        return {"ready": self.ready(), "front_id": self.front_id, "workers": workers,
                "migrations_total": self.migrations_total, "open_streams": len(self._streams),
                "controller": None if self.controller is None else {"view_age_s": age, "flips": self.sync.flips,
                                                                "rebalance": self.sync.rebalance}}

    # ------------------------------------------------------------------ decisions carried out
    def _route(self, prompt_token_ids: list[int], salt: str | None, params: SamplingParams,
               keeper: str | None = None, log_as: str = "") -> tuple[Decision, list[bytes]]:
        return self.router.route(self.workers.values(), prompt_token_ids, salt, params, keeper, log_as)

    async def _admit(self, wire_id: str, prompt_token_ids: list[int], salt: str | None, params: SamplingParams,
                     priority: int, ticket: Any, decision: Decision, hashes: list[bytes], charge: bool = True,
                     request_id: str | None = None) -> tuple[Decision, list[bytes], SamplingParams]:
        """Stage 2: reserve the request's KV on the worker that keeps it; re-route when the
        reservation landed elsewhere or waited (``admission.stale_route``)."""
        role = "colocated" if self.colocated else "decode"
        keeper = stage2.keeper(decision)
        budget = output_budget(self.limits, len(prompt_token_ids), params)
        demand = stage2.kv_demand(wire_id, ticket, len(prompt_token_ids), budget, params, priority, hashes)
        held = await self.admission.reserve(
            demand, lambda: [w.worker_id for w in self.workers.values()
                             if w.alive and not w.draining and w.role == role],
            lambda: keeper.worker_id if keeper.alive else None)
        params = stage2.grant(held, params, ticket, len(prompt_token_ids), charge, request_id or wire_id)
        if stage2.stale_route(held, decision):
            decision, hashes = self._route(prompt_token_ids, salt, params, keeper=held.worker_id, log_as=wire_id)
        return decision, hashes, params

    async def _place(self, stream: Stream, decision: Decision, hashes: list[bytes], prompt_token_ids: list[int],
                     params: SamplingParams, priority: int, salt: str | None, arrival: float,
                     ticket: Any) -> Placement:
        """Send the stream's unfinished samples to the decision's workers: the whole request the
        first time, each sample on its own, resuming from its emitted tokens, after a migration."""
        first, decode = decision.first, decision.decode
        stream.workers = {first.worker_id} | ({decode.worker_id} if decode else set())
        stream.prefill_id = first.worker_id if decode else None
        stream.decode_id = decode.worker_id if decode else None
        stream.handed = set()
        stream.restart_order()
        budget = output_budget(self.limits, len(prompt_token_ids), params)
        unfinished = stream.unfinished()
        left = sum(max(budget - len(stream.emitted.get(i, [])), 0) for i in unfinished)
        placed = Placement.open(decision, hashes, len(prompt_token_ids), len(stream.resume_tokens()), left, budget,
                                self.router.block_size)
        common = (priority, salt, time.monotonic() - arrival, decode.worker_id if decode else None,
                  self.front_id, getattr(ticket, "tenant_name", ""))
        stream.placed_n = len(unfinished)
        if stream.migrations == 0:
            calls = [first.handle.add_request.remote(stream.wire_id, prompt_token_ids, params_to_dict(params),
                                                     *common)]
        else:
            one = params_to_dict(dataclasses.replace(params, n=1))
            calls = []
            for i in unfinished:
                wire = stream.wires[i] = f"{stream.wire_id}.m{stream.migrations}.{i}"
                self._by_wire[wire] = stream
                calls.append(first.handle.add_request.remote(
                    wire, prompt_token_ids, one, *common,
                    resume={"index": i, "output_token_ids": stream.emitted.get(i, [])}))
        try:
            await asyncio.gather(*calls)
        except Exception as exc:  # the worker died since routing: as if its stream had ended
            if stream.workers:  # (not already seen dead by its reader)
                self._lose(stream, first.worker_id, exc)
        return placed

    async def _replace(self, stream: Stream, why: Migrate, prompt_token_ids: list[int], params: SamplingParams,
                       salt: str | None, priority: int, ticket: Any) -> tuple[Decision, list[bytes], SamplingParams]:
        """A new decision for a stream whose worker died, waiting (bounded) for a live one; raises
        WorkerLostError when none comes."""
        stream.migrations += 1
        self.migrations_total += 1
        longest = stream.resume_tokens()
        log.warning("request %s lost on worker %s (%r): placing %d sample(s) again after %d token(s) "
                    "(migration %d of %d)", stream.wire_id, why.worker_id, why.error, len(stream.unfinished()),
                    len(longest), stream.migrations, self.max_migrations)
        if self.metrics is not None:
            self.metrics.observe_migration(self.workers[why.worker_id].role)
        if why.suspects:
            await self._probe(why.suspects, why.error)
        deadline = time.monotonic() + self.migration_wait_s
        resumed = [*prompt_token_ids, *longest]
        while True:
            try:
                decision, hashes = self._route(resumed, salt, params, log_as=stream.wire_id)
                break
            except OverloadedError:
                if time.monotonic() >= deadline:
                    raise WorkerLostError(f"worker {why.worker_id} failed ({why.error!r}) and no healthy worker "
                                          f"took the request over within {self.migration_wait_s:g}s") from None
                await asyncio.sleep(0.1)
        if self.admission is not None:
            self.admission.release(stream.wire_id)
            decision, hashes, params = await self._admit(stream.wire_id, resumed, salt, params, priority, ticket,
                                                         decision, hashes, charge=False)
        return decision, hashes, params

    async def _probe(self, worker_ids: tuple[str, ...], error: BaseException) -> None:
        """A transfer between these workers failed without either dying (a peer that stopped
        answering, a paused process): one that does not answer a stats call within
        ``probe_timeout_s`` is dead here and to the controller, so the request neither goes back
        to it nor spends its migrations there while the health checks catch up."""
        live = [self.workers[wid] for wid in worker_ids if wid in self.workers and self.workers[wid].alive]

        async def answers(w: WorkerRef) -> bool:
            try:
                await asyncio.wait_for(w.handle.stats.remote(), timeout=self.probe_timeout_s)
                return True
            except asyncio.CancelledError:
                raise
            except Exception:
                return False

        for w, ok in zip(live, await asyncio.gather(*(answers(w) for w in live))):
            if not ok and w.alive:
                log.error("worker %s did not answer within %gs after a failed KV transfer (%r): dead",
                          w.worker_id, self.probe_timeout_s, error)
                self._mark_dead(w, RuntimeError(f"did not answer after a failed KV transfer: {error!r}"))

    # ------------------------------------------------------------------ deltas and workers
    def _deliver(self, deltas: list[TokenDelta], source: str | None = None) -> None:
        """Hand ``deltas`` (from worker ``source``) to their streams."""
        for delta in deltas:
            stream = self._by_wire.get(delta.request_id)
            if stream is None:
                continue
            for d, src in stream.in_order(delta, source):
                if stream.hands_over(d, src):
                    stream.handed_over(d.index)
                stream.queue.put_nowait(d)
            if not stream.paused and stream.queue.qsize() >= self.high_water:
                self._set_paused(stream, True)

    def _set_paused(self, stream: Stream, paused: bool) -> None:
        stream.paused = paused
        stream.flow_seq += 1
        for wid in stream.workers:
            w = self.workers.get(wid)
            if w is not None and w.alive:
                for wire in set(stream.wires.values()):
                    w.handle.set_paused.remote(wire, paused, stream.flow_seq)

    def _role_changed(self, w: WorkerRef, old: str) -> None:
        """A flipped worker that now keeps KV needs a ledger for stage 2."""
        log.info("front %s: %s is now a %s worker (was %s)", self.front_id, w.worker_id, w.role, old)
        if self.admission is not None and w.role == "decode":
            self.admission.ensure_ledger(w.worker_id, int(w.info.get("num_blocks", 0)))
        if self.metrics is not None:
            done = [f for f in self.sync.flips if f["worker_id"] == w.worker_id and not f.get("given_up")]
            self.metrics.observe_rebalance("flip", done[-1].get("reason", "manual") if done else "manual")

    async def _adopt(self, w: WorkerRef) -> None:
        """The controller restarted ``w``: route to the new actor and take its deltas."""
        incarnation, handle, info = await self.controller.worker.remote(w.worker_id)
        if incarnation <= w.incarnation:
            return
        if w.alive:  # its death went unnoticed here (no stream to close): its requests move first
            self._mark_dead(w, RuntimeError("restarted by the controller"))
        w.handle, w.info, w.incarnation = handle, info, incarnation
        w.load = WorkerLoad(sole_front=w.load.sole_front)
        self.router.index.remove(w.worker_id)
        self._tasks.append(await self.links.listen(w))
        w.alive = True
        log.warning("worker %s is back (incarnation %d)", w.worker_id, incarnation)
        if self.metrics is not None:
            self.metrics.observe_restart(w.role)

    def _mark_dead(self, w: WorkerRef, exc: BaseException) -> None:
        w.alive = False
        self.router.index.remove(w.worker_id)
        if self.controller is not None:
            self.controller.mark_dead.remote(w.worker_id, w.incarnation)
        for stream in list(self._streams.values()):
            if w.worker_id in stream.workers:
                self._lose(stream, w.worker_id, exc)

    def _detach(self, stream: Stream) -> None:
        """Nothing more of the stream's current placement reaches its caller."""
        for wire in set(stream.wires.values()):
            self._by_wire.pop(wire, None)
        stream.workers = set()

    def _lose(self, stream: Stream, worker_id: str, exc: BaseException, dead: bool = True,
              suspects: tuple[str, ...] = ()) -> None:
        """A worker of the stream's placement is gone (or, ``dead`` False, failed the request):
        end the placement and queue a migration (or, when they ran out, the error) behind every
        delta the caller is still to get. ``suspects`` are probed before the migration routes."""
        self._abort_on_workers(stream, stream.workers - {worker_id} if dead else None)
        self._detach(stream)  # what the caller has is where samples resume
        if stream.migrations < self.max_migrations:
            stream.queue.put_nowait(Migrate(worker_id, exc, suspects))
        else:
            used = f" ({stream.migrations} migration(s) used)" if self.max_migrations else ""
            stream.queue.put_nowait(WorkerLostError(f"worker {worker_id} failed: {exc!r}{used}"))

    def _end_here(self, stream: Stream, reason: str) -> None:
        """Give each unfinished sample its final delta from this front; the placement's later
        deltas are dropped."""
        self._detach(stream)
        for i in stream.unfinished():
            stream.queue.put_nowait(TokenDelta(stream.wire_id, i, [], finish_reason="abort", stop_reason=reason))

    def _abort_on_workers(self, stream: Stream, workers: set[str] | None = None) -> None:
        """Abort every wire id of the stream on ``workers`` (default: its placement's) that live."""
        wires = set(stream.wires.values())
        for wid in stream.workers if workers is None else workers:
            w = self.workers.get(wid)
            if w is not None and w.alive:
                for wire in wires:
                    w.handle.abort.remote(wire)
