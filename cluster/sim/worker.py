"""A worker on the virtual clock: the real ``EngineCore`` (scheduler, block manager with prefix
caching, request bookkeeping, stop checks, KV-migration bookkeeping) whose forward pass takes the
time a latency profile gives the step it scheduled, looped as ``workers.engine.async_engine``
loops it and shipping parked KV as ``workers.actor.worker`` does.

What is modelled, and how:
- The engine loop: commands (add, KV reservations, releases) run between steps, never inside one;
  a worker with nothing to run sleeps until a command comes.
- Turns at shared cores (``CoreBoard``, as ``workers.actor.core_share``): a step waits until its
  threads fit; a shared-memory KV copy runs inside the receiving worker's turn, before its step.
- KV shipping after a prefill parks a sample: ``shared_memory`` reserves, copies and admits on the
  decode worker in one turn; ``collective`` reserves there between steps, moves the blocks beside
  both workers' steps, then admits. A full decode cache is retried with the connectors' backoff
  until ``kv_timeout_s``. The prefill worker frees the parked blocks once the copy is done.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from baton_serve.cluster.sim.board import CoreBoard
from baton_serve.cluster.sim.events import EventLoop
from baton_serve.workers.blocks.prefix_hash import CacheNamespace
from baton_serve.workers.engine.config import EngineConfig
from baton_serve.workers.engine.core import EngineCore
from baton_serve.workers.engine.outputs import TokenDelta
from baton_serve.workers.engine.scheduler import SchedulerOutput
from baton_serve.workers.engine.stats import engine_stats
from baton_serve.workers.errors import BatonError, OutOfBlocksError
from baton_serve.workers.sampling.params import SamplingParams

log = logging.getLogger("baton.sim")

Emit = Callable[[str, list[TokenDelta]], None]
_EOS = 2
_TOKEN = 17  # what every simulated step samples: never EOS (requests end at max_tokens, ignore_eos)


class SimWorker:
    """One worker of a simulated pool (``role``: prefill, decode or colocated). ``emit(worker_id,
    deltas)`` takes each step's deltas, at the virtual time the step ends."""

    def __init__(self, worker_id: str, role: str, loop: EventLoop, profile: Any, config: EngineConfig,
                 num_blocks: int, max_model_len: int, namespace: CacheNamespace, emit: Emit,
                 board: CoreBoard | None = None, threads: int = 1, node: str = "node-0",
                 transport: str = "auto", kv_timeout_s: float = 30.0, hardware: str = "sim") -> None:
        self.worker_id, self.role, self.node = worker_id, role, node
        self.loop, self.profile, self.emit = loop, profile, emit
        self.board, self.threads = board, threads
        self.transport, self.kv_timeout_s, self.hardware = transport, kv_timeout_s, hardware
        self._timer_s = 0.0  # what the core's step timer reads: a step's forward adds its profiled time
        self.core = EngineCore.for_simulation(config, num_blocks, [_EOS], 49152, max_model_len, self._forward,
                                              token_id=_TOKEN, namespace=namespace, clock=loop.clock,
                                              timer=lambda: self._timer_s)
        self.peers: dict[str, SimWorker] = {}
        self._inbox: list[Callable[[], None]] = []
        self._turn_inbox: list[Callable[[], None]] = []  # runs in this worker's turn at the cores
        self._active = False  # an iteration of the loop is scheduled, waiting for cores or stepping
        self._waiting_cores = False
        self._asked_at = 0.0
        self._turn_extra_s = 0.0  # in-turn work (a KV copy) before this turn's step
        self._decode_target: dict[str, str] = {}
        self.shipments, self.ship_seconds, self.ship_bytes = 0, 0.0, 0
        self.core_wait_seconds = 0.0
        self.kv_block_bytes = int(profile.model["kv_block_bytes"])

    def info(self) -> dict[str, Any]:
        """What a worker reports at start (``workers.actor.worker.Worker.info``), as far as routing reads it."""
        c = self.core
        return {"worker_id": self.worker_id, "role": self.role, "num_blocks": c.block_manager.num_blocks,
                "block_size": c.config.block_size, "max_model_len": c.max_model_len,
                "cache_namespace": asdict(c.block_manager.namespace), "kv_block_bytes": self.kv_block_bytes,
                "node_id": self.node}

    def stats(self) -> dict[str, Any]:
        """The stats dict a worker's ``stats`` call returns, from the same engine counters."""
        out = dict(engine_stats(self.core).__dict__)
        board = self.board
        out["extra"] = {"hardware": self.hardware,
                        "kv_transfer": {"bytes": self.ship_bytes, "recent_seconds": [], "shipments": self.shipments,
                                        "ship_seconds": self.ship_seconds},
                        "core_wait_seconds": self.core_wait_seconds,
                        "core_share": ({"board": board.name, "cores": board.cores, "threads": self.threads}
                                       if board is not None else None)}
        return out

    def idle(self) -> bool:
        """Nothing left on the engine: no request scheduled, paused, parked for shipping or arriving."""
        c = self.core
        return not (c.scheduler.requests or c.paused or c.parked or c.incoming or self._inbox or self._turn_inbox)

    def set_role(self, role: str) -> None:
        """Change role in place (an idle worker: the rebalancer drained it), the cache kept."""
        if not self.idle():
            raise RuntimeError(f"{self.worker_id} is not idle: a role changes only on a drained worker")
        self.role = role
        self._decode_target.clear()

    # ------------------------------------------------------------------ requests (the front's calls)
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival: float, decode_worker: str | None = None, priority: int = 0,
                    cache_salt: str | None = None) -> None:
        """Queue a request (``Worker.add_request``): a prefill worker parks it after its first
        token and ships its KV to ``decode_worker``."""
        prefill_only = self.role == "prefill"
        if prefill_only:
            if decode_worker not in self.peers:
                raise ValueError(f"unknown decode worker {decode_worker!r}")
            self._decode_target[request_id] = decode_worker

        def add() -> None:
            try:
                self.core.add_request(request_id, prompt_token_ids, params, priority=priority, cache_salt=cache_salt,
                                      arrival_time=arrival, prefill_only=prefill_only)
            except BatonError as exc:
                self.emit(self.worker_id, [TokenDelta(request_id, i, [], finish_reason="abort", stop_reason=str(exc))
                                           for i in range(params.n)])

        self.submit(add)

    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine loop before its next step (at once while it waits for cores, as
        the real loop answers its inbox then)."""
        if self._waiting_cores:
            fn()
            return
        self._inbox.append(fn)
        self._wake()

    def submit_in_turn(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` right before a step, while this worker holds its turn at the cores."""
        self._turn_inbox.append(fn)
        self._wake()

    # ------------------------------------------------------------------ the engine loop
    def _wake(self) -> None:
        if not self._active:
            self._active = True
            self.loop.at(self.loop.now, self._iterate)

    def _iterate(self) -> None:
        """One pass of the engine loop: commands, then (if there is work) a turn at the cores."""
        commands, self._inbox = self._inbox, []
        for cmd in commands:
            cmd()
        if not self.core.has_unfinished_requests() and not self._turn_inbox:
            self._active = False
            return
        self._asked_at = self.loop.now
        if self.board is None:
            self._turn()
            return
        self._waiting_cores = True
        self.board.ask(self.threads, self._turn)

    def _turn(self) -> None:
        """This worker holds the cores: its in-turn commands, then one step, over virtual time."""
        self._waiting_cores = False
        now = self.loop.now
        self.core_wait_seconds += now - self._asked_at
        self._turn_extra_s = 0.0
        commands, self._turn_inbox = self._turn_inbox, []
        for cmd in commands:
            cmd()
        self._timer_s = now + self._turn_extra_s
        ran = self.core.has_unfinished_requests()
        deltas = self.core.step() if ran else []
        duration = self._timer_s - now
        if duration <= 0:  # nothing ran (the scheduler found nothing it could fit): sleep till a command
            self._give_back()
            self._active = False
            if self._inbox or self._turn_inbox:
                self._wake()
            return
        self.loop.after(duration, lambda: self._end_turn(deltas))

    def _forward(self, out: SchedulerOutput) -> None:
        """The forward pass: as long as the profile says this step takes."""
        chunks = [(s.num_new_tokens, s.request.num_computed_tokens) for s in out.prefills]
        context = sum(s.request.num_computed_tokens + 1 for s in out.decodes)
        sampled = len(out.decodes) + sum(s.samples for s in out.prefills)
        self._timer_s += self.profile.step_s(chunks, len(out.decodes), context) + self.profile.host_s(sampled)

    def _end_turn(self, deltas: list[TokenDelta]) -> None:
        self._give_back()
        if deltas:
            self.emit(self.worker_id, deltas)
            for d in deltas:
                if d.kv_ready:
                    self._ship(d)
        self._iterate()

    def _give_back(self) -> None:
        if self.board is not None:
            self.board.give_back(self.threads)

    # ------------------------------------------------------------------ KV shipping (prefill side)
    def _ship(self, delta: TokenDelta) -> None:
        rid = delta.request_id
        member = rid if rid in self.core._members else f"{rid}#{delta.index}"
        meta, _ = self.core.migration_meta(member)
        target = self.peers[self._decode_target[rid]]
        connector = self.transport
        if connector == "auto":
            connector = "shared_memory" if target.node == self.node else "collective"
        started, deadline = self.loop.now, self.loop.now + self.kv_timeout_s
        target.receive(self, connector, member, meta, started, deadline, 0.01)

    def shipped(self, member_id: str, meta: Any, blocks: int, started: float) -> None:
        """The decode worker has the sample's KV: count the shipment and free the parked blocks."""
        self.shipments += 1
        self.ship_seconds += self.loop.now - started
        self.ship_bytes += blocks * self.kv_block_bytes
        self.submit(lambda: self.core.release_parked(member_id))

    def ship_failed(self, member_id: str, meta: Any, error: str) -> None:
        """No room on the decode worker within the KV timeout: the sample ends, recoverable."""
        log.warning("simulated KV shipping of %s failed: %s", member_id, error)
        self.emit(self.worker_id, [TokenDelta(meta.request_id, meta.index, [], finish_reason="abort",
                                              stop_reason=f"kv transfer failed: {error}", recoverable=True)])
        self.submit(lambda: self.core.release_parked(member_id))

    # ------------------------------------------------------------------ KV shipping (decode side)
    def receive(self, sender: SimWorker, connector: str, member_id: str, meta: Any, started: float,
                deadline: float, delay_s: float) -> None:
        """Take a parked sample's KV from ``sender`` over ``connector``, retrying a full cache."""
        def retry() -> None:
            if self.loop.now > deadline:
                sender.ship_failed(member_id, meta, f"decode worker had no room within {self.kv_timeout_s}s")
                return
            self.loop.after(delay_s, lambda: self.receive(sender, connector, member_id, meta, started, deadline,
                                                          min(delay_s * 2, 0.5)))

        if connector == "shared_memory":
            def copy_in() -> None:
                try:
                    needed = self.core.reserve_remote(meta)
                except OutOfBlocksError:
                    retry()
                    return
                self._turn_extra_s += self.profile.transfer_s(connector, len(needed))
                self.core.admit_remote(member_id)
                done = self.loop.now + self._turn_extra_s
                self.loop.at(done, lambda: sender.shipped(member_id, meta, len(needed), started))

            self.submit_in_turn(copy_in)
            return

        def reserve() -> None:
            try:
                needed = self.core.reserve_remote(meta)
            except OutOfBlocksError:
                retry()
                return
            seconds = self.profile.transfer_s(connector, len(needed))

            def arrived() -> None:
                self.submit(lambda: self.core.admit_remote(member_id))
                sender.shipped(member_id, meta, len(needed), started)

            self.loop.after(seconds, arrived)

        self.submit(reserve)
