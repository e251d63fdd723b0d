"""The front's view of the worker pools: an ``EngineClient`` over Ray actors.

Each worker pushes its per-step msgpack batches of token deltas to this front over a socket
(``workers.actor.output_stream``); one reader task per worker hands each delta to its request's
stream. A worker the front cannot connect to is polled over Ray instead. A request goes to a
prefill worker (which emits the first token and ships the KV) and continues on a decode worker;
in colocated mode one worker does both.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from router.prefix_index import PrefixIndex
from router.routing import Candidates, Decision, RouteRequest, RoutingPolicy, WorkerLoad, make_policy
from router.routing.cost_model import CostModel
from router.routing.decision_log import DecisionLog
from workers.actor.messages import decode_deltas, params_to_dict
from workers.actor.output_stream import FRAME, frame, hello_payload
from workers.blocks.prefix_hash import CacheNamespace, block_hashes
from workers.engine.outputs import TokenDelta
from workers.engine.validation import RequestLimits
from workers.errors import InvalidRequestError, OverloadedError, WorkerLostError
from workers.sampling.params import SamplingParams

log = logging.getLogger("baton.pool")


@dataclass
class WorkerRef:
    """A worker actor as the front knows it."""

    worker_id: str
    role: str
    handle: Any
    info: dict[str, Any] = field(default_factory=dict)
    load: WorkerLoad = field(default_factory=WorkerLoad)
    alive: bool = True
    incarnation: int = 0  # how many times the controller has restarted it (a new actor each time)


@dataclass
class _Stream:
    queue: asyncio.Queue
    remaining: int
    workers: set[str]  # the workers of the current placement
    wire_id: str  # the id the workers know this attempt by (unique, unlike a client's id)
    paused: bool = False
    flow_seq: int = 0  # orders pause/resume calls, which a threaded actor may run out of order
    n: int = 1
    prefill_id: str | None = None  # the prefill worker, until every sample has reached the decode worker
    decode_id: str | None = None
    handed: set[int] = field(default_factory=set)  # samples the decode worker has sent deltas for
    finished: set[int] = field(default_factory=set)  # samples whose final delta went to the caller
    # Sample index -> the wire id it runs under now: the request's own at first; after a migration,
    # each unfinished sample is resubmitted alone under one of its own.
    wires: dict[int, str] = field(default_factory=dict)
    emitted: dict[int, list[int]] = field(default_factory=dict)  # tokens the caller has, per sample
    migrations: int = 0
    placed_n: int = 1  # samples the current placement runs
    # Per sample: the position the next delta to queue starts at, and deltas that came before their
    # turn (a decode worker's tokens can overtake the prefill worker's first one), by position.
    next_position: dict[int, int] = field(default_factory=dict)
    early: dict[int, dict[int, list[tuple[TokenDelta, str | None]]]] = field(default_factory=dict)

    def in_order(self, delta: TokenDelta, source: str | None) -> list[tuple[TokenDelta, str | None]]:
        """The deltas (with their sources) that may go to the caller now that ``delta`` came: none
        while one before it is missing; it and every held one it lets through otherwise."""
        if delta.position < 0:
            return [(delta, source)]
        i = delta.index
        expected = self.next_position.get(i, 0)
        if delta.position > expected:
            self.early.setdefault(i, {}).setdefault(delta.position, []).append((delta, source))
            return []
        if delta.position < expected:  # a repeat: the engine numbers every delta it makes
            return []
        ready = [(delta, source)]
        expected += len(delta.token_ids)
        held = self.early.get(i)
        while held and expected in held:
            for d, src in held.pop(expected):
                ready.append((d, src))
                expected += len(d.token_ids)
        self.next_position[i] = expected
        return ready

    def restart_order(self) -> None:
        """A new placement continues each sample from the tokens its caller has."""
        self.early.clear()
        self.next_position = {i: len(toks) for i, toks in self.emitted.items()}


@dataclass
class _Migrate:
    """Queued to a stream when a worker of its placement died: place it again and resume."""

    worker_id: str
    error: BaseException
    suspects: tuple[str, ...] = ()  # live workers of a failed transfer: probed before re-routing


@dataclass
class _Placement:
    """Where a request's unfinished samples run: the worker that computes their prompt (and
    first token) and, disaggregated, the decode worker that continues them."""

    first: WorkerRef
    decode: WorkerRef | None
    pending: int  # prompt positions ``first`` has left to compute, until its first token
    hashes: list[bytes]
    estimated_ttft_s: float | None
    prefilling: bool = True
    max_tokens: int = 0  # each sample's output budget
    decode_left: int = 0  # output tokens its samples may still produce, counted on the decoding worker

    @property
    def decoding(self) -> WorkerRef:
        return self.decode if self.decode is not None else self.first

    def produced(self, delta: TokenDelta, emitted: list[int]) -> None:
        """A sample's tokens (``emitted``: all it has produced) come off what the decoding worker has
        left to produce, and its whole rest when it ends sooner (a stop)."""
        done = len(delta.token_ids)
        if delta.finish_reason is not None:
            done += max(self.max_tokens - len(emitted), 0)
        done = min(done, self.decode_left)
        self.decode_left -= done
        self.decoding.load.local_decode_left -= done


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
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.on_stats = on_stats
        self.metrics = metrics
        self.index = PrefixIndex(ttl_s=index_ttl_s)
        self.events_interval_s = events_interval_s
        self._estimator = CostModel()  # TTFT estimates for policies that do not make their own
        self._namespace, self._block_size, self._kv_block_bytes = self._cache_layout()
        self._roots: dict[str | None, bytes] = {}
        self._streams: dict[str, _Stream] = {}  # by the caller's request id
        self._by_wire: dict[str, _Stream] = {}  # the same streams, by wire id (deltas carry it)
        self._attempts = 0
        self._tasks: list[asyncio.Task] = []
        self.front_id = f"front-{uuid.uuid4().hex[:8]}"  # workers keep one stream or outbox per front
        self.decision_log = DecisionLog(decision_log, self.front_id) if decision_log else None
        self.controller = controller  # GlobalController handle, or None to ask workers directly
        self._overloaded = False
        self._writers: list[asyncio.StreamWriter] = []
        self.admission = admission  # cluster.admission.kv.KVAdmission: stage 2, or None to admit all
        self.max_migrations, self.migration_wait_s = max_migrations, migration_wait_s
        self.probe_timeout_s = probe_timeout_s
        self.migrations_total = 0
        self._members: dict[str, dict[str, Any]] = {}  # the controller's last view, by worker id
        self._members_at: float | None = None  # when it came (monotonic)

    @property
    def colocated(self) -> bool:
        return any(w.role == "colocated" for w in self.workers.values())

    async def start(self, stats_interval_s: float = 1.0) -> None:
        """Connect to every worker's output stream (or poll it) and start the stats loop (call
        from the serving event loop)."""
        for w in self.workers.values():
            await self._listen(w)
        self._tasks.append(asyncio.create_task(self._stats_loop(stats_interval_s)))
        if self._namespace is not None:
            self._tasks.append(asyncio.create_task(self._events_loop()))

    async def _listen(self, w: WorkerRef) -> None:
        """Start taking ``w``'s deltas: from its output stream, or by polling it."""
        reader = await self._connect(w)
        loop = self._read_loop(w, reader, w.incarnation) if reader is not None else self._poll_loop(w, w.incarnation)
        self._tasks.append(asyncio.create_task(loop))

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
        for writer in self._writers:
            writer.close()
        self._writers.clear()
        if self.decision_log is not None:
            self.decision_log.close()

    # ------------------------------------------------------------------ EngineClient
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str | None = None,
                       arrival_time: float | None = None, ticket: Any = None) -> AsyncIterator[TokenDelta]:
        self.limits.validate(prompt_token_ids, params)
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        if len(self._streams) >= self.max_queued:
            raise OverloadedError(f"{len(self._streams)} requests in flight; the limit is {self.max_queued}")
        if self._overloaded:
            raise OverloadedError("the cluster's queues are full", retry_after_s=2.0)
        arrival = arrival_time or time.monotonic()
        # Workers remember aborted ids for a while (a late add or KV must not run), and an abort
        # may land after a later request that reuses the id: so each attempt gets its own id.
        self._attempts += 1
        wire_id = f"{request_id}~{self.front_id[6:]}.{self._attempts}"
        self._streams[request_id] = placeholder = _Stream(asyncio.Queue(), params.n, set(), wire_id)
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
        stream = _Stream(asyncio.Queue(), params.n, set(), wire_id, n=params.n,
                         wires={i: wire_id for i in range(params.n)})
        self._streams[request_id] = stream
        self._by_wire[wire_id] = stream
        placed: _Placement | None = None
        done = False
        try:
            placed = await self._place(stream, decision, hashes, prompt_token_ids, params, priority, cache_salt,
                                       arrival, ticket)
            while True:
                delta = await stream.queue.get()
                if isinstance(delta, _Migrate):
                    self._unplace(placed)
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
                    self._prefilled(placed, stream, delta, arrival)
                delta.request_id = request_id
                if delta.index in stream.finished:
                    continue  # already ended here (a stop string, an abort raced the worker's own end)
                if delta.finish_reason is not None:
                    stream.finished.add(delta.index)
                stream.emitted.setdefault(delta.index, []).extend(delta.token_ids)
                if placed is not None:
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
                self._unplace(placed)
            if self.admission is not None:
                self.admission.release(wire_id)
            if not done:
                self._abort_stream(stream)

    async def _place(self, stream: _Stream, decision: Decision, hashes: list[bytes], prompt_token_ids: list[int],
                     params: SamplingParams, priority: int, salt: str | None, arrival: float,
                     ticket: Any) -> _Placement:
        """Send the stream's unfinished samples to the decision's workers: the whole request the
        first time, each sample on its own, resuming from its emitted tokens, after a migration."""
        first, decode = decision.first, decision.decode
        stream.workers = {first.worker_id} | ({decode.worker_id} if decode else set())
        stream.prefill_id = first.worker_id if decode else None
        stream.decode_id = decode.worker_id if decode else None
        stream.handed = set()
        stream.restart_order()
        resumed = {i: toks for i, toks in stream.emitted.items() if i not in stream.finished}
        longest = max((len(t) for t in resumed.values()), default=0)
        pending = len(prompt_token_ids) + longest - decision.matched_blocks * (self._block_size or 0)
        budget = self._max_tokens(len(prompt_token_ids), params)
        left = sum(max(budget - len(stream.emitted.get(i, [])), 0) for i in range(stream.n) if i not in stream.finished)
        placed = _Placement(first, decode, pending, hashes, decision.estimated_ttft_s,
                            max_tokens=budget, decode_left=left)
        first.load.outstanding += 1
        first.load.local_pending_prefill += pending
        first.load.local_pending_requests += 1
        placed.decoding.load.local_decode_left += left
        if decode is not None:
            decode.load.outstanding += 1
        common = (priority, salt, time.monotonic() - arrival, decode.worker_id if decode else None,
                  self.front_id, getattr(ticket, "tenant_name", ""))
        stream.placed_n = stream.n - len(stream.finished)
        if stream.migrations == 0:
            calls = [first.handle.add_request.remote(stream.wire_id, prompt_token_ids, params_to_dict(params),
                                                     *common)]
        else:
            one = params_to_dict(dataclasses.replace(params, n=1))
            calls = []
            for i in range(stream.n):
                if i in stream.finished:
                    continue
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

    def _unplace(self, placed: _Placement) -> None:
        placed.first.load.outstanding -= 1
        placed.decoding.load.local_decode_left -= placed.decode_left
        if placed.prefilling:
            placed.first.load.local_pending_prefill -= placed.pending
            placed.first.load.local_pending_requests -= 1
        if placed.decode is not None:
            placed.decode.load.outstanding -= 1

    def _prefilled(self, placed: _Placement, stream: _Stream, delta: TokenDelta, arrival: float) -> None:
        """The placement's first worker is past the prompt: its pending work and the index's
        prediction follow."""
        placed.prefilling = False
        placed.first.load.local_pending_prefill -= placed.pending
        placed.first.load.local_pending_requests -= 1
        if delta.token_ids and placed.hashes:
            # The prefill is done, however long it queued: the prediction made at routing time must
            # outlive it until the workers' events confirm the blocks.
            for w in (placed.first, placed.decode):
                if w is not None:
                    self.index.predict(w.worker_id, placed.hashes)
        if delta.token_ids and stream.migrations == 0:
            ttft = time.monotonic() - arrival
            if self.metrics is not None:
                self.metrics.observe_route_ttft(self.policy.name, placed.estimated_ttft_s, ttft)
            if self.decision_log is not None:
                self.decision_log.ttft(stream.wire_id, ttft)

    async def _replace(self, stream: _Stream, why: _Migrate, prompt_token_ids: list[int], params: SamplingParams,
                       salt: str | None, priority: int, ticket: Any) -> tuple[Decision, list[bytes], SamplingParams]:
        """A new decision for a stream whose worker died, waiting (bounded) for a live one; raises
        WorkerLostError when none comes."""
        stream.migrations += 1
        self.migrations_total += 1
        unfinished = [i for i in range(stream.n) if i not in stream.finished]
        longest = max((stream.emitted.get(i, []) for i in unfinished), key=len, default=[])
        log.warning("request %s lost on worker %s (%r): placing %d sample(s) again after %d token(s) "
                    "(migration %d of %d)", stream.wire_id, why.worker_id, why.error, len(unfinished), len(longest),
                    stream.migrations, self.max_migrations)
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

    def abort(self, request_id: str) -> None:
        """Abort a request in flight from this front (no-op when unknown or finished): the workers
        stop it, and its stream ends now with ``finish_reason`` "abort" (the workers, which forget
        the request at once, send nothing more for it)."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        self._abort_stream(stream)
        self._end_here(stream, "aborted")

    def _end_here(self, stream: _Stream, reason: str) -> None:
        """Give each unfinished sample its final delta from this front; the placement's later
        deltas are dropped."""
        self._detach(stream)
        for i in range(stream.n):
            if i not in stream.finished:
                stream.queue.put_nowait(TokenDelta(stream.wire_id, i, [], finish_reason="abort", stop_reason=reason))

    def abort_all(self, reason: str) -> int:
        """End every request in flight with ``finish_reason`` "abort" (drain): the workers stop
        them, and each unfinished sample's stream gets its final delta now. Returns how many."""
        for stream in list(self._streams.values()):
            self._abort_stream(stream)
            self._end_here(stream, reason)
        count = len(self._streams)
        self._streams.clear()  # requests still queued at stage 2 see this and end too
        return count

    async def _admit(self, wire_id: str, prompt_token_ids: list[int], salt: str | None, params: SamplingParams,
                     priority: int, ticket: Any, decision: Decision, hashes: list[bytes], charge: bool = True,
                     request_id: str | None = None) -> tuple[Decision, list[bytes], SamplingParams]:
        """Stage 2: reserve the request's KV on the worker that keeps it; re-route when the
        reservation landed elsewhere or waited (the first choice is stale by then). A degraded
        reservation caps ``max_tokens``, or ``n`` (first admission only: a migration never drops
        samples a client already reads), and the ticket says so."""
        from cluster.admission.kv import KVDemand

        role = "colocated" if self.colocated else "decode"
        keeper = decision.decode or decision.first
        tenant = getattr(ticket, "tenant", None)
        if tenant is None:
            from cluster.admission.tenants import ANONYMOUS, Tenant

            tenant = Tenant(ANONYMOUS)
        max_tokens = self._max_tokens(len(prompt_token_ids), params)
        demand = KVDemand(wire_id, tenant, len(prompt_token_ids), max_tokens, params.n, priority, tuple(hashes))
        held = await self.admission.reserve(
            demand, lambda: [w.worker_id for w in self.workers.values() if w.alive and w.role == role],
            lambda: keeper.worker_id if keeper.alive else None)
        if held.degraded and held.n is not None:
            if charge:
                params = dataclasses.replace(params, n=held.n)
                if ticket is not None:
                    ticket.degraded["n"] = held.n
                    ticket.granted_n[request_id or wire_id] = held.n
        elif held.degraded:
            params = dataclasses.replace(params, max_tokens=held.max_tokens)
            if ticket is not None:
                ticket.degraded["max_tokens"] = held.max_tokens
        if ticket is not None:
            ticket.queue_time_s += held.queued_s
            if charge:  # a migration re-reserves what the tenant was charged for once
                ticket.charge_tokens(len(prompt_token_ids) + held.max_tokens * params.n)
        if held.worker_id != keeper.worker_id or held.queued_s > 0:
            decision, hashes = self._route(prompt_token_ids, salt, params, keeper=held.worker_id, log_as=wire_id)
        return decision, hashes, params

    def _max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        room = self.limits.max_model_len - prompt_len
        return max(min(params.max_tokens if params.max_tokens is not None else room, room), 1)

    def _abort_stream(self, stream: _Stream, workers: set[str] | None = None) -> None:
        """Abort every wire id of the stream on ``workers`` (default: its placement's) that live."""
        wires = set(stream.wires.values())
        for wid in stream.workers if workers is None else workers:
            w = self.workers.get(wid)
            if w is not None and w.alive:
                for wire in wires:
                    w.handle.abort.remote(wire)

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
        roles = {w.role for w in self.workers.values() if w.alive}
        return "colocated" in roles or {"prefill", "decode"} <= roles

    def status(self) -> dict[str, Any]:
        """This front's view of the deployment for ``GET /status`` and ``baton status``: each
        worker (alive, incarnation, restarts, quarantined, load) and the front's migrations."""
        workers = []
        for wid, w in sorted(self.workers.items()):
            member = self._members.get(wid, {})
            workers.append({
                "worker_id": wid, "role": w.role, "alive": w.alive, "incarnation": w.incarnation,
                "restarts": int(member.get("restarts", 0)), "restarting": bool(member.get("restarting", False)),
                "quarantined": bool(member.get("quarantined", False)), "num_running": w.load.num_running,
                "num_waiting": w.load.num_waiting, "kv_cache_usage": round(w.load.kv_cache_usage, 4)})
        age = None if self._members_at is None else round(time.monotonic() - self._members_at, 3)
        return {"ready": self.ready(), "front_id": self.front_id, "workers": workers,
                "migrations_total": self.migrations_total, "open_streams": len(self._streams),
                "controller": None if self.controller is None else {"view_age_s": age}}

    # ------------------------------------------------------------------ internals
    def _route(self, prompt_token_ids: list[int], salt: str | None, params: SamplingParams,
               keeper: str | None = None, log_as: str = "") -> tuple[Decision, list[bytes]]:
        """The policy's decision, and the prompt's block hashes (for renewing the index's prediction).

        ``keeper``: the worker that must hold the KV (where stage 2 reserved it). ``log_as``: the
        request's id in the decision log.
        """
        alive = [w for w in self.workers.values() if w.alive]
        if self.colocated:
            first, decode = [w for w in alive if w.role == "colocated" and keeper in (None, w.worker_id)], []
            if not first:
                raise OverloadedError("no colocated worker is alive", retry_after_s=5.0)
        else:
            first = [w for w in alive if w.role == "prefill"]
            decode = [w for w in alive if w.role == "decode" and keeper in (None, w.worker_id)]
            if not first or not decode:
                raise OverloadedError("a pool has no live worker", retry_after_s=5.0)
        hashes = self._prompt_hashes(prompt_token_ids, salt)
        now = time.monotonic()
        matched = self.index.match([w.worker_id for w in alive], hashes, now) if hashes else {}
        stale = {w.worker_id for w in alive if self.index.is_stale(w.worker_id)}
        max_tokens = params.max_tokens if params.max_tokens is not None else self.limits.max_model_len
        request = RouteRequest(len(prompt_token_ids), hashes, self._block_size or 16,
                               max(min(max_tokens, self.limits.max_model_len - len(prompt_token_ids)), 1) * params.n,
                               self._kv_block_bytes)
        held = {w.worker_id: self.index.held(w.worker_id, now) for w in alive}
        candidates = Candidates(first, decode, matched, stale, held)
        decision = self.policy.route(request, candidates)
        if decision.estimated_ttft_s is None:
            decision.estimated_ttft_s = self._estimator.ttft_s(decision.first, request, decision.matched_blocks,
                                                               alive)
        if self.decision_log is not None:
            self.decision_log.decision(log_as, self.policy.name, request, candidates, decision,
                                       rerouted=keeper is not None)
        # The chosen workers will hold these blocks in a moment: later requests sharing the prefix
        # follow this one instead of waiting for the events that say so.
        for w in (decision.first, decision.decode):
            if w is not None and hashes:
                self.index.predict(w.worker_id, hashes, now)
        if self.metrics is not None:
            self.metrics.observe_route(self.policy.name, decision.reason,
                                       decision.matched_blocks * (self._block_size or 0), len(prompt_token_ids))
        return decision, hashes

    def _cache_layout(self) -> tuple[CacheNamespace | None, int, int]:
        """The prefix-cache namespace, block size and block bytes the workers report (None: they do not)."""
        for w in self.workers.values():
            ns = w.info.get("cache_namespace")
            if ns:
                return CacheNamespace(**ns), int(ns["block_size"]), int(w.info.get("kv_block_bytes", 0))
        return None, int(next(iter(self.workers.values())).info.get("block_size", 16)) if self.workers else 16, 0

    def _prompt_hashes(self, prompt_token_ids: list[int], salt: str | None) -> list[bytes]:
        """The chain hashes of the prompt's blocks a worker's cache could cover (never the last token)."""
        if self._namespace is None:
            return []
        root = self._roots.get(salt)
        if root is None:
            if len(self._roots) > 1024:  # salts are per tenant or per client: keep the memo bounded
                self._roots.clear()
            root = self._roots[salt] = self._namespace.root_hash(salt)
        return block_hashes(root, prompt_token_ids, self._block_size, stop=len(prompt_token_ids) - 1)

    def _deliver(self, deltas: list[TokenDelta], source: str | None = None) -> None:
        """Hand ``deltas`` (from worker ``source``) to their streams."""
        for delta in deltas:
            stream = self._by_wire.get(delta.request_id)
            if stream is None:
                continue
            for d, src in stream.in_order(delta, source):
                # Handed over once the decode worker's deltas reach the queue, not when they come:
                # one held for the prefill worker's first token keeps the prefill worker's death
                # the stream's concern.
                if stream.prefill_id is not None and src is not None and (
                        src == stream.decode_id or (src == stream.prefill_id and d.finish_reason is not None)):
                    self._handed_over(stream, d.index)
                stream.queue.put_nowait(d)
            if not stream.paused and stream.queue.qsize() >= self.high_water:
                self._set_paused(stream, True)

    @staticmethod
    def _handed_over(stream: _Stream, index: int) -> None:
        # Once every sample decodes on the decode worker (or ended before it had to), the prefill
        # worker holds nothing of the request: its death, or an abort, no longer concerns the stream.
        stream.handed.add(index)
        if len(stream.handed) >= stream.placed_n:
            stream.workers.discard(stream.prefill_id)
            stream.prefill_id = None

    def _set_paused(self, stream: _Stream, paused: bool) -> None:
        stream.paused = paused
        stream.flow_seq += 1
        for wid in stream.workers:
            w = self.workers.get(wid)
            if w is not None and w.alive:
                for wire in set(stream.wires.values()):
                    w.handle.set_paused.remote(wire, paused, stream.flow_seq)

    async def _connect(self, w: WorkerRef, timeout_s: float = 10.0) -> asyncio.StreamReader | None:
        """Open ``w``'s output stream; None (poll it instead) where it has none or it fails."""
        address = w.info.get("output_address")
        if not address:
            return None

        async def hello() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            reader, writer = await asyncio.open_connection(address[0], int(address[1]))
            try:
                # The secret comes with the worker's info, over Ray: only members of the Ray cluster
                # can read it, and only its holders can read the worker's output socket.
                writer.write(frame(hello_payload(self.front_id, w.info.get("output_secret", ""))))
                # The worker answers once it has registered us: from then on nothing goes to an
                # outbox that nobody polls. The answer carries what that outbox held.
                self._deliver(decode_deltas(await self._read_frame(reader)), w.worker_id)
            except BaseException:
                writer.close()
                raise
            return reader, writer

        try:
            reader, writer = await asyncio.wait_for(hello(), timeout_s)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            log.warning("no output stream from worker %s at %s (%r): polling it over Ray", w.worker_id,
                        address, exc)
            return None
        self._writers.append(writer)
        return reader

    @staticmethod
    async def _read_frame(reader: asyncio.StreamReader) -> bytes:
        (size,) = FRAME.unpack(await reader.readexactly(FRAME.size))
        return await reader.readexactly(size)

    async def _read_loop(self, w: WorkerRef, reader: asyncio.StreamReader, incarnation: int) -> None:
        try:
            while True:
                self._deliver(decode_deltas(await self._read_frame(reader)), w.worker_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # EOF or reset: the worker process is gone
            if w.incarnation == incarnation:  # (not a restarted one's stream ending late)
                log.error("worker %s closed its output stream: %r", w.worker_id, exc)
                self._mark_dead(w, exc)

    async def _poll_loop(self, w: WorkerRef, incarnation: int) -> None:
        while w.incarnation == incarnation:
            try:
                data = await w.handle.poll.remote(self.front_id, 0.5)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the actor died: fail its requests, stop routing to it
                if w.incarnation == incarnation:
                    log.error("worker %s failed: %r", w.worker_id, exc)
                    self._mark_dead(w, exc)
                return
            if data:
                self._deliver(decode_deltas(data), w.worker_id)

    async def _adopt(self, w: WorkerRef) -> None:
        """The controller restarted ``w``: route to the new actor and take its deltas."""
        incarnation, handle, info = await self.controller.worker.remote(w.worker_id)
        if incarnation <= w.incarnation:
            return
        if w.alive:  # its death went unnoticed here (no stream to close): its requests move first
            self._mark_dead(w, RuntimeError("restarted by the controller"))
        w.handle, w.info, w.incarnation = handle, info, incarnation
        w.load = WorkerLoad(sole_front=w.load.sole_front)
        self.index.remove(w.worker_id)
        await self._listen(w)
        w.alive = True
        log.warning("worker %s is back (incarnation %d)", w.worker_id, incarnation)
        if self.metrics is not None:
            self.metrics.observe_restart(w.role)

    def _mark_dead(self, w: WorkerRef, exc: BaseException) -> None:
        w.alive = False
        self.index.remove(w.worker_id)
        if self.controller is not None:
            self.controller.mark_dead.remote(w.worker_id, w.incarnation)
        for stream in list(self._streams.values()):
            if w.worker_id in stream.workers:
                self._lose(stream, w.worker_id, exc)

    def _detach(self, stream: _Stream) -> None:
        """Nothing more of the stream's current placement reaches its caller."""
        for wire in set(stream.wires.values()):
            self._by_wire.pop(wire, None)
        stream.workers = set()

    def _lose(self, stream: _Stream, worker_id: str, exc: BaseException, dead: bool = True,
              suspects: tuple[str, ...] = ()) -> None:
        """A worker of the stream's placement is gone (or, ``dead`` False, failed the request):
        end the placement and queue a migration (or, when they ran out, the error) behind every
        delta the caller is still to get. ``suspects`` are probed before the migration routes."""
        self._abort_stream(stream, stream.workers - {worker_id} if dead else None)
        self._detach(stream)  # what the caller has is where samples resume
        if stream.migrations < self.max_migrations:
            stream.queue.put_nowait(_Migrate(worker_id, exc, suspects))
        else:
            used = f" ({stream.migrations} migration(s) used)" if self.max_migrations else ""
            stream.queue.put_nowait(WorkerLostError(f"worker {worker_id} failed: {exc!r}{used}"))

    async def _events_loop(self) -> None:
        """Keep the prefix index in step with every live worker's KV events."""
        while True:
            alive = [w for w in self.workers.values() if w.alive]
            replies = await asyncio.gather(*(self._pull_events(w) for w in alive), return_exceptions=True)
            now = time.monotonic()
            for w, reply in zip(alive, replies):
                if isinstance(reply, asyncio.CancelledError):
                    raise reply
                if isinstance(reply, BaseException) or reply is None:
                    continue  # no answer this time: the entries age towards expiry
                reason = self.index.apply(w.worker_id, reply, now)
                if reason is not None:
                    if reason != "epoch" or self.index.resyncs(w.worker_id) > 1:
                        log.info("prefix index: %s resync from worker %s", reason, w.worker_id)
                    if self.metrics is not None:
                        self.metrics.observe_index_resync(w.worker_id, reason)
            for wid in self.index.expire(now):
                log.warning("prefix index: no KV events from worker %s for %.0fs: its entries expired",
                            wid, self.index.ttl_s)
            if self.metrics is not None:
                for w in self.workers.values():
                    self.metrics.observe_index(w.role, w.worker_id, self.index.size(w.worker_id),
                                               self.index.lag_s(w.worker_id, now), self.index.is_stale(w.worker_id))
            await asyncio.sleep(self.events_interval_s)

    async def _pull_events(self, w: WorkerRef) -> Any:
        epoch, seq = self.index.cursor(w.worker_id)
        return await asyncio.wait_for(w.handle.kv_events.remote(epoch, seq), timeout=max(self.events_interval_s * 8, 2))

    async def _stats_loop(self, interval_s: float) -> None:
        while True:
            try:
                if self.controller is not None:
                    await self._sync_from_controller(interval_s)
                else:
                    await self._poll_stats(interval_s)
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad snapshot must not stop load tracking and metrics for good
                log.exception("worker stats update failed")
            await asyncio.sleep(interval_s)

    async def _sync_from_controller(self, interval_s: float) -> None:
        try:
            snap = await asyncio.wait_for(self.controller.snapshot.remote(), timeout=max(interval_s * 5, 5))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # controller unreachable: keep the last view, routing still works
            log.warning("controller snapshot failed: %r", exc)
            return
        self._overloaded = bool(snap["overloaded"])
        self._members, self._members_at = snap["members"], time.monotonic()
        for wid, member in snap["members"].items():
            w = self.workers.get(wid)
            if w is None or member.get("incarnation", 0) < w.incarnation:
                continue  # unknown, or a view older than the restart this front already adopted
            if member["alive"] and member.get("incarnation", 0) > w.incarnation:
                await self._adopt(w)
                continue
            if w.alive and not member["alive"]:
                self._mark_dead(w, RuntimeError("failed health checks"))
            if member["stats"]:
                w.load.update(member["stats"])
            elif w.alive:
                continue  # no check has answered yet: nothing to report
            if self.on_stats:
                self.on_stats(w, member["stats"] if w.alive else None)

    async def _poll_stats(self, interval_s: float) -> None:
        for w in list(self.workers.values()):
            if not w.alive:
                if self.on_stats:
                    self.on_stats(w, None)
                continue
            try:
                stats = await asyncio.wait_for(w.handle.stats.remote(), timeout=max(interval_s * 5, 5))
            except asyncio.CancelledError:
                raise
            except Exception:
                continue
            w.load.update(stats)
            if self.on_stats:
                self.on_stats(w, stats)
