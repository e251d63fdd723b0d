"""The Worker: one engine in one Ray actor, with a role (prefill, decode or colocated).

The front talks to it with small calls (``add_request``, ``abort``); peers call the ``kv_*``
methods. Outputs leave as one msgpack batch per step and front, never one message per token:
pushed down the front's socket (``workers.actor.output_stream``), or held for ``poll`` by a front
that has not connected one; a front whose socket closes has its requests aborted. A prefill
worker parks each request after its first token and ships its KV to the decode worker named in
the request through a KV connector (``workers.kv.connector``): transport ``auto`` takes shared
memory where the decode worker can map this worker's cache (same machine) and the
``torch.distributed`` pair group otherwise; ``collective`` and ``object_store`` force one. Any
failure frees both sides and ends the request with ``finish_reason="abort"``.

The class is plain Python; ``cluster.launcher`` wraps it with ``ray.remote``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from baton_serve.kernels import capabilities, openmp
from baton_serve.workers.actor.core_share import CoreShare
from baton_serve.workers.actor.faults import FaultPoints
from baton_serve.workers.actor.messages import encode_deltas, params_from_dict
from baton_serve.workers.actor.output_stream import FrontConnection, OutputServer
from baton_serve.workers.engine.async_engine import AsyncEngine
from baton_serve.workers.engine.config import engine_config
from baton_serve.workers.engine.model_runner import kv_cache_block_bytes
from baton_serve.workers.engine.outputs import TokenDelta
from baton_serve.workers.engine.request import SampleResume
from baton_serve.workers.errors import BatonError
from baton_serve.workers.kv.connector import (
    KVConnector,
    KVShipment,
    connector_class,
    connector_names,
    connector_order,
    make_connector,
)
from baton_serve.workers.kv.event_log import KVEventBatch
from baton_serve.workers.kv.integrity import block_crcs
from baton_serve.workers.kv.migration import MigrationMeta
from baton_serve.workers.kv.shared import can_share
from baton_serve.workers.kv.transfer import KVTransferEngine, KVTransferError
from baton_serve.workers.llm import build_engine
from baton_serve.workers.node import node_address, node_id
from baton_serve.workers.parallel.kv_agent import KVAgent, LocalAgent

log = logging.getLogger("baton.worker")
ROLES = ("prefill", "decode", "colocated")


class Worker:
    """An engine plus its outbox and KV shipping; every engine access goes through its loop thread."""

    def __init__(self, worker_id: str, role: str, engine: dict[str, Any], threads: int | None = 1,
                 kv_transport: str = "auto", kv_timeout_s: float = 30.0,
                 host: str | None = None, core_share: dict[str, Any] | None = None,
                 front_secret: str = "", verify_kv: bool = True, incarnation: int = 0) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        order = connector_order(kv_transport)  # ValueError naming the known ones
        self.tp_size = int(engine.get("tensor_parallel_size", 1))
        if self.tp_size > 1 and kv_transport == "object_store":
            raise ValueError("kv_transfer.transport = 'object_store' moves one cache per worker; tensor-parallel "
                             "pools ship rank to rank: use 'auto' or 'collective'")
        # None: the cores of the machine this worker landed on (threads_per_worker = "auto" on a
        # cluster without CPU reservations)
        threads = threads or capabilities.usable_cores()
        torch.set_num_threads(threads)
        self.worker_id, self.role = worker_id, role
        # Every listener (output stream, pair-group rendezvous) binds the address peers and fronts
        # on other nodes reach this one by: Ray's node address (loopback on a one-node deployment).
        self.kv_transport, self.kv_timeout_s, self.host = kv_transport, kv_timeout_s, host or node_address()
        self.verify_kv = verify_kv  # ship a checksum per KV block; the receiver checks it
        self.incarnation = incarnation  # which start of this worker id (the controller's restarts)
        self.faults = FaultPoints()
        engine = dict(engine)
        # A prefill worker's cache goes in shared memory when a connector it may use maps it.
        engine.setdefault("kv_cache_shared", role == "prefill" and self.tp_size == 1 and can_share()
                          and any(connector_class(n).needs_shared_cache for n in order))
        config = engine_config(**engine)

        def build() -> Any:
            core, self.tokenizer, self.model_path = build_engine(config)
            return core

        # A request's deltas go to the front (HTTP replica) that sent it: down that front's output
        # stream once it has connected (workers.actor.output_stream), else to its outbox for ``poll``.
        self._outboxes: dict[str, list[TokenDelta]] = {}
        self._fronts: dict[str, FrontConnection] = {}
        self._gone_fronts: set[str] = set()  # whose stream closed: their late requests are aborted
        # request id -> [front id, indices of its samples still to end or leave here]
        self._owner: dict[str, list[Any]] = {}
        self._out_cv = threading.Condition()
        # Built on the loop thread: every parallel region of the model runs on that one thread.
        # Workers whose threads outnumber this machine's cores take turns at them (workers.actor.core_share).
        # A tensor-parallel replica's ranks step while rank 0 does: its turn claims all their cores.
        share = (CoreShare(threads=threads * self.tp_size, release_team=openmp.release_team, **core_share)
                 if core_share else None)
        self.engine = AsyncEngine(build, on_step=self._on_step, core_share=share)
        self.core = core = self.engine.engine
        self.transfer = KVTransferEngine(core.runner.kv_caches, core.config.block_size, core.runner.device)
        self.num_kv_heads = core.model.cfg.num_key_value_heads
        # Each rank's part of a KV shipment: rank 0's here, the others' over their command channels.
        own = LocalAgent(KVAgent(core.runner.kv_caches, core.config.block_size, core.runner.device, self.host))
        self.tp_agents = [own, *(core.tensor_parallel.agents if core.tensor_parallel is not None else [])]
        self.hardware = _hardware(core.runner.device, threads, core.config.dtype, self.model_path.name)
        self.peers: dict[str, Any] = {}
        # Every connector, by name: the decode side answers whichever a sender uses; the prefill
        # side ships with the first of ``order`` that reaches the peer.
        self._connectors = {name: make_connector(name, self) for name in connector_names()}
        self._order = order
        self._decode_target: dict[str, str] = {}  # request id -> decode worker id (prefill role)
        self._cancelled: dict[str, float] = {}  # recently aborted ids, oldest first: late adds and KV are refused
        self._flow: dict[str, tuple[int, bool]] = {}  # backpressure state; engine thread only
        self._withdrawn: dict[str, float] = {}  # members whose sender gave up; engine thread only
        # Reservations made for a sender that has not sent yet: (sender, request id, index, when).
        # A sender that dies (or never sends) leaves them; set_peers and stats() free them.
        self._reserved_by: dict[str, tuple[str, str, int, float]] = {}
        self._receiving: set[str] = set()  # members whose data is being received now
        self._dropped: dict[str, None] = {}  # reservations freed that way (oldest first): a late receive is refused
        # KV copies on side threads run serially: a team of their own would throttle the loop
        # thread's OpenMP waits for good (kernels.openmp). A shared-memory shipment only waits for
        # the decode worker's turn: with 2 threads, a step parking 5 requests took 3 decode turns.
        self._shipper = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-ship",
                                           initializer=openmp.serial_here)
        self.transfer_log: list[float] = []  # shipment seconds since the last stats() (metrics)
        self.shipments, self.ship_seconds = 0, 0.0  # totals, for readers other than metrics
        # A front's hello must carry this (it reads it from ``info`` over Ray): anything else that
        # connects to the output socket gets nothing.
        self._output_secret = front_secret or secrets.token_hex(16)
        self._output = OutputServer(self.host, self._front_connected, secret=self._output_secret)

    # ------------------------------------------------------------------ front-facing
    def info(self) -> dict[str, Any]:
        c = self.core
        return {"worker_id": self.worker_id, "role": self.role, "incarnation": self.incarnation,
                "model": self.model_path.name,
                "model_path": str(self.model_path), "num_blocks": c.block_manager.num_blocks,
                "block_size": c.config.block_size, "max_model_len": c.max_model_len,
                "vocab_size": c.vocab_size, "pid": os.getpid(), "dtype": c.config.dtype, "device": c.config.device,
                "node_id": node_id(), "tensor_parallel_size": c.config.tensor_parallel_size,
                "output_address": list(self._output.address), "output_secret": self._output_secret,
                # Routers hash prompts with this to compare them against the cache events below.
                "cache_namespace": dataclasses.asdict(c.block_manager.namespace),
                "kv_block_bytes": kv_cache_block_bytes(c.model, c.config.block_size, c.model.dtype)}

    def kv_layout(self) -> dict[str, int]:
        """How this worker's KV is split: its tensor-parallel size and the model's KV heads."""
        return {"tp": self.tp_size, "num_kv_heads": self.num_kv_heads}

    def kv_events(self, epoch: str | None = None, seq: int = 0) -> KVEventBatch:
        """Prefix-cache events after ``seq`` of ``epoch`` (a full resync when that cannot be answered)."""
        return self.core.kv_events.since(epoch, seq)

    def set_peers(self, peers: dict[str, Any]) -> None:
        """Actor handles of the other workers, by worker id (for KV shipping)."""
        new = {k: v for k, v in peers.items() if k != self.worker_id}
        # A peer under a known id with a new actor was restarted: what the connectors keep for
        # it (a pair group, a mapped cache) belongs to the dead process, so they forget it first.
        replaced = {k for k, v in new.items() if k in self.peers and _actor_id(self.peers[k]) != _actor_id(v)}
        for connector in self._connectors.values():
            if replaced:
                connector.peers_changed({k: v for k, v in new.items() if k not in replaced})
            connector.peers_changed(new)
        gone = replaced | (set(self.peers) - set(new))
        self.peers = new
        if gone:  # a dead sender will not fill what was reserved for it
            self._free_reservations(gone=gone)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: dict[str, Any],
                    priority: int = 0, cache_salt: str | None = None, age_s: float = 0.0,
                    decode_worker: str | None = None, front_id: str = "default", tenant: str = "",
                    resume: dict[str, Any] | None = None) -> None:
        """Queue a request (validated by the front). A prefill worker needs ``decode_worker``;
        ``tenant`` is whom the scheduler's ``fair`` policy shares the worker between; ``resume``
        (``SampleResume`` fields) continues a sample a dead worker was running."""
        sampling = params_from_dict(params)
        sample = SampleResume(int(resume["index"]), [int(t) for t in resume["output_token_ids"]]) if resume else None
        indices = [sample.index] if sample is not None else list(range(sampling.n))
        self._register(request_id, front_id, indices)
        if self._cancelled.pop(request_id, None) is not None:
            # Its abort overtook it (threaded actors reorder calls), or the id was used moments ago:
            # either way it must not run, and whoever listens must hear so rather than wait.
            self._emit([TokenDelta(request_id, i, [], finish_reason="abort",
                                   stop_reason=f"request id {request_id!r} was aborted moments ago")
                        for i in indices])
            return
        prefill_only = self.role == "prefill"
        if prefill_only:
            if decode_worker not in self.peers:
                raise ValueError(f"unknown decode worker {decode_worker!r}")
            self._decode_target[request_id] = decode_worker
        arrival = time.monotonic() - age_s

        def add(engine: Any) -> None:
            try:
                engine.add_request(request_id, prompt_token_ids, sampling, priority=priority,
                                   cache_salt=cache_salt, arrival_time=arrival, prefill_only=prefill_only,
                                   tenant=tenant, resume=sample)
            except BatonError as exc:
                log.warning("request %s rejected by the engine: %s", request_id, exc)
                self._emit([TokenDelta(request_id, i, [], finish_reason="abort", stop_reason=str(exc))
                            for i in indices])

        self.engine.submit(add)

    def abort(self, request_id: str) -> None:
        with self._out_cv:
            self._owner.pop(request_id, None)
            self._decode_target.pop(request_id, None)
            self._flow.pop(request_id, None)
            now = time.monotonic()
            # Tombstones only matter while a late add or a transfer may still arrive; kept longer,
            # they would refuse a later request that reuses the id.
            horizon = 2 * self.kv_timeout_s
            if self._cancelled and now - next(iter(self._cancelled.values())) > horizon:
                self._cancelled = {k: t for k, t in self._cancelled.items() if now - t < horizon}
            self._cancelled.pop(request_id, None)  # re-inserted last: the dict stays oldest first
            self._cancelled[request_id] = now
        self.engine.submit(lambda e: e.abort_request(request_id))

    def set_paused(self, request_id: str, paused: bool, seq: int) -> None:
        """Backpressure from the front: pause (descheduled, KV kept) or resume a request.

        Calls may run out of order on this threaded actor, so each carries the front's sequence
        number and a stale one is ignored; a request whose KV is still in flight is paused on arrival.
        """
        def apply(engine: Any) -> None:
            if request_id not in self._owner:  # finished or shipped away: nothing to pace here
                return
            last = self._flow.get(request_id)
            if last is not None and last[0] >= seq:
                return
            self._flow[request_id] = (seq, paused)
            (engine.pause_request if paused else engine.resume_request)(request_id)

        self.engine.submit(apply)

    def finish_sample(self, request_id: str, index: int, stop: str) -> None:
        """The front matched a stop string: end the sample. Its final delta still goes out (the
        front has ended it already), so the sample is accounted for here like any other end."""
        def finish(engine: Any) -> None:
            delta = engine.finish_request(request_id, index, "stop", stop)
            if delta is not None:
                self._emit([delta])

        self.engine.submit(finish)

    def poll(self, front_id: str = "default", timeout_s: float = 0.5) -> bytes:
        """Wait up to ``timeout_s`` for this front's outputs; return them as one msgpack batch."""
        with self._out_cv:
            if not self._outboxes.get(front_id):
                self._out_cv.wait(timeout_s)
            batch = self._outboxes.pop(front_id, [])
        return encode_deltas(batch)

    def stats(self) -> dict[str, Any]:
        # Called every health-check interval: where a sender's death went unreported (no restart),
        # its reservations go once it could no longer be sending.
        self._free_reservations(older_than_s=3 * self.kv_timeout_s)
        s = self.engine.stats()
        recent, self.transfer_log = self.transfer_log, []
        out = dict(s.__dict__)
        share = self.engine.core_share
        out["extra"] = {"hardware": self.hardware,  # routers fit the steps of workers alike together
                        "kv_transfer": {"bytes": self.transfer.stats.bytes, "seconds": self.transfer.stats.seconds,
                                        "recent_seconds": recent,
                                        "shipments": self.shipments, "ship_seconds": self.ship_seconds},
                        "core_wait_seconds": share.wait_seconds if share is not None else 0.0,
                        # routers price the turns workers on one board take at its cores
                        "core_share": ({"board": f"{node_id()}:{share.path}", "cores": share.cores,
                                        "threads": share.threads} if share is not None else None)}
        out["alive"] = self.health()
        for connector in self._connectors.values():
            out.update(connector.stats())  # pair_groups, mapped_peer_caches
        out["tracked_requests"] = len(self._owner)
        with self._out_cv:
            out["output_fronts"] = sorted(self._fronts)  # fronts whose output stream is up
        return out

    def latency_samples(self, since: int = 0) -> tuple[int, list[dict[str, Any]]]:
        """The TTFT and TPOT samples after cursor ``since`` (``workers.engine.latency_log``), and the
        next cursor: the controller's rebalancer reads them."""
        seq, samples = self.engine.call(lambda engine: engine.latency.since(since))
        return seq, [dataclasses.asdict(s) for s in samples]

    def set_role(self, role: str) -> bool:
        """Change between prefill and decode in place (the rebalancer's flip), weights and cached
        prefixes kept. Only an idle worker changes: False (nothing changed) while any request runs,
        waits, is paused, parked for shipping, arriving, or has KV room reserved here."""
        if role not in ("prefill", "decode") or self.role not in ("prefill", "decode"):
            raise ValueError(f"a role flip is between prefill and decode; {self.worker_id} is {self.role}, "
                             f"asked for {role!r}")

        def apply(engine: Any) -> bool:
            busy = (engine.scheduler.requests or engine.paused or engine.parked or engine.incoming
                    or self._reserved_by or self._receiving or self._owner)
            if busy:
                return False
            self.role = role
            self._decode_target.clear()
            return True

        changed = bool(self.engine.call(apply))
        if changed:
            log.info("%s is now a %s worker", self.worker_id, role)
        return changed

    def arm_fault(self, name: str, count: int = 1) -> None:
        """Make fault point ``name`` (``workers.actor.faults.FAULT_POINTS``) fire ``count`` times."""
        self.faults.arm(name, count)

    def health(self) -> bool:
        """The engine loop runs and, in a tensor-parallel replica, every rank is there (an idle
        replica learns of a dead rank from its plan channel, before any step fails on it)."""
        tp = self.core.tensor_parallel
        return self.engine.is_alive and (tp is None or tp.failure() is None)

    def shutdown(self) -> None:
        self._output.close()
        self._shipper.shutdown(wait=False, cancel_futures=True)
        for connector in self._connectors.values():
            connector.close()
        self.tp_agents[0].agent.close()
        self.engine.shutdown()

    # ------------------------------------------------------------------ outputs
    def _register(self, request_id: str, front_id: str, indices: Any) -> None:
        with self._out_cv:
            self._owner.setdefault(request_id, [front_id, set()])[1].update(indices)

    def _emit(self, deltas: list[TokenDelta]) -> None:
        with self._out_cv:
            by_front: dict[str, list[TokenDelta]] = {}
            for d in deltas:
                owner = self._owner.get(d.request_id)
                if owner is None:
                    continue  # aborted by its front: nobody listens
                by_front.setdefault(owner[0], []).append(d)
                if d.finish_reason is not None:
                    self._sample_left(d.request_id, d.index)
            polled = False
            for front_id, batch in by_front.items():
                conn = self._fronts.get(front_id)
                if conn is not None and conn.send(encode_deltas(batch)):
                    continue
                if conn is not None or front_id in self._gone_fronts:
                    self._front_gone(front_id)
                    continue
                self._outboxes.setdefault(front_id, []).extend(batch)
                polled = True
            if polled:
                self._out_cv.notify_all()

    def _front_gone(self, front_id: str) -> None:
        """Its output stream closed (the front stopped or died): nobody will read its requests'
        outputs, so abort them here and free their blocks. Caller holds ``_out_cv``."""
        if self._fronts.pop(front_id, None) is not None:
            log.warning("front %s hung up: aborting its requests", front_id)
        self._gone_fronts.add(front_id)
        for rid in [rid for rid, owner in self._owner.items() if owner[0] == front_id]:
            self.abort(rid)

    def _front_connected(self, front_id: str, conn: FrontConnection) -> None:
        """A front's output stream is up: what its outbox holds goes first, then every batch."""
        with self._out_cv:
            old = self._fronts.pop(front_id, None)
            if old is not None:
                old.close()
            self._gone_fronts.discard(front_id)
            self._fronts[front_id] = conn  # first: once answered, the front may ask stats()
            conn.send(encode_deltas(self._outboxes.pop(front_id, [])))  # also the hello's answer

    def _sample_left(self, request_id: str, index: int) -> None:
        """Sample ``index`` finished here or moved to a decode worker; forget the request after its
        last. Counted by index, so a sample offered twice (a retried reservation) counts once and one
        that never arrives (it finished on the prefill worker) is never waited for. Caller holds
        ``_out_cv``."""
        owner = self._owner.get(request_id)
        if owner is not None:
            owner[1].discard(index)
            if not owner[1]:
                del self._owner[request_id]
                self._decode_target.pop(request_id, None)
                self._flow.pop(request_id, None)

    def _on_step(self, deltas: list[TokenDelta]) -> None:
        """Engine thread: queue outputs; start shipping the KV of requests that just parked."""
        self._emit(deltas)
        for d in deltas:
            if d.kv_ready:
                # Read the parked request here, on the engine thread, so the shipper need not wait
                # for a step boundary to get it.
                member = self._member_id(d.request_id, d.index)
                meta, table = self.core.migration_meta(member)
                self._shipper.submit(self._ship, d.request_id, member, meta, table)

    def _member_id(self, request_id: str, index: int) -> str:
        return request_id if request_id in self.core._members else f"{request_id}#{index}"

    # ------------------------------------------------------------------ prefill side
    def _ship(self, request_id: str, member_id: str, meta: MigrationMeta, table: list[int]) -> None:
        """A shipping thread: move one parked sample to its decode worker through the first
        connector that reaches it; any failure frees both sides and ends the sample as aborted."""
        target = self._decode_target.get(request_id)
        peer = self.peers.get(target) if target else None
        started = time.perf_counter()
        connector = None
        # The parked blocks do not change until released: safe off the loop thread. A
        # tensor-parallel replica's rank 0 holds only its heads: its ranks checksum their routes.
        if self.verify_kv and self.tp_size == 1:
            meta.kv_checksums = block_crcs(self.core.runner.kv_caches, table,
                                           len(meta.prompt_token_ids) + len(meta.output_token_ids) - 1,
                                           self.core.config.block_size)
        shipment = KVShipment(request_id, member_id, meta, table)
        try:
            if peer is None:
                raise KVTransferError(f"decode worker {target!r} is not known")
            connector = self._connector_for(target, peer)
            connector.send(target, peer, shipment)
            seconds = time.perf_counter() - started
            self.transfer_log.append(seconds)
            with self._out_cv:  # shipping threads run side by side
                self.shipments, self.ship_seconds = self.shipments + 1, self.ship_seconds + seconds
                self._sample_left(request_id, meta.index)
        except Exception as exc:
            log.warning("KV shipping of %s to %s failed: %r", member_id, target, exc)
            if peer is not None:
                if connector is not None:
                    connector.abandon(target, peer, shipment)
                else:
                    peer.kv_cancel.remote(member_id, meta.index)
            # Recoverable: the front places the sample again rather than end it.
            self._emit([TokenDelta(request_id, meta.index, [], finish_reason="abort",
                                   stop_reason=f"kv transfer failed: {exc}", recoverable=True)])
        finally:
            self.engine.submit(lambda e: e.release_parked(member_id))

    def _connector_for(self, peer_id: str, peer: Any) -> KVConnector:
        for name in self._order:
            connector = self._connectors[name]
            if connector.reaches(peer_id, peer):
                return connector
        raise KVTransferError(f"no KV connector of {list(self._order)} reaches {peer_id}")

    # ------------------------------------------------------------------ decode side (RPCs)
    def kv_accept(self, connector: str, peer_id: str, info: Any) -> bool:
        """A sender's set-up call for ``connector`` (join its pair group, map its cache)."""
        return self._connectors[connector].accept(peer_id, info)

    def kv_reserve(self, connector: str, meta: dict[str, Any], front_id: str = "default",
                   sender: str | None = None) -> tuple[list[int], list[int]] | None:
        """Allocate blocks for an arriving sample: (logical indices it needs, their physical ids),
        or None when full now (the sender retries). ``sender``: the worker that will send it."""
        got = self._connectors[connector].reserve(meta, front_id)
        if got is not None and sender is not None:
            with self._out_cv:
                self._reserved_by[meta["member_id"]] = (sender, meta["request_id"], int(meta["index"]),
                                                        time.monotonic())
        return got

    def kv_receive(self, connector: str, peer_id: str, member_id: str, blocks: list[int] | None,
                   payload: Any) -> int | None:
        """Take a sample's KV through ``connector`` and start decoding it; the bytes received."""
        with self._out_cv:
            if member_id in self._dropped:
                del self._dropped[member_id]
                raise KVTransferError(f"the reservation of {member_id} was freed: its data came too late")
            self._reserved_by.pop(member_id, None)
            self._receiving.add(member_id)
        try:
            return self._connectors[connector].receive(peer_id, member_id, blocks, payload)
        finally:
            with self._out_cv:
                self._receiving.discard(member_id)

    def _free_reservations(self, gone: set[str] | None = None, older_than_s: float | None = None) -> None:
        """Free reservations whose sender is in ``gone`` (dead, replaced) or that waited longer than
        ``older_than_s`` for their data: no transfer will fill them."""
        now = time.monotonic()
        with self._out_cv:
            stale = [(mid, rid, index) for mid, (sender, rid, index, at) in self._reserved_by.items()
                     if mid not in self._receiving
                     and ((gone is not None and sender in gone)
                          or (older_than_s is not None and now - at > older_than_s))]
            for mid, _, _ in stale:
                del self._reserved_by[mid]
                self._dropped[mid] = None
                if len(self._dropped) > 4096:  # only a late receive can match one: old ones go
                    del self._dropped[next(iter(self._dropped))]
        for mid, rid, index in stale:
            log.warning("freeing the KV reserved for %s: its sender is gone or never sent it", mid)
            self.engine.submit(lambda e, mid=mid: e.cancel_remote(mid))
            self.forget_sample(rid, index)

    def kv_cancel(self, member_id: str, index: int) -> None:
        """The sender gave up on ``member_id`` (sample ``index``): free its reservation; returns once no copy of it is running here, and none will start (the
        sender may then reuse its blocks)."""
        def withdraw(engine: Any) -> None:
            now = time.monotonic()
            if len(self._withdrawn) > 1024:  # only a copy still queued can match an old entry
                self._withdrawn = {k: t for k, t in self._withdrawn.items() if now - t < 4 * self.kv_timeout_s}
            self._withdrawn[member_id] = now
            if engine.cancel_remote(member_id):
                self._withdrawn.pop(member_id, None)  # the reservation was still here: nothing queued

        self.engine.call(withdraw, timeout=self.kv_timeout_s)
        with self._out_cv:
            self._reserved_by.pop(member_id, None)
        self.forget_sample(member_id.split("#", 1)[0], index)  # it will not decode here

    # ------------------------------------------------------------------ KVHost, for connectors
    def register(self, request_id: str, front_id: str, index: int) -> None:
        with self._out_cv:  # one critical section: an abort between check and insert would leave it tracked
            if request_id in self._cancelled:  # aborted since the connector checked: it will be refused
                return
            self._register(request_id, front_id, (index,))

    def owner_front(self, request_id: str) -> str:
        owner = self._owner.get(request_id)
        return owner[0] if owner else "default"

    def forget_sample(self, request_id: str, index: int) -> None:
        with self._out_cv:
            self._sample_left(request_id, index)

    def refuses(self, request_id: str) -> bool:
        return request_id in self._cancelled

    def take_withdrawn(self, member_id: str) -> bool:
        """Engine thread: True (once) when ``member_id``'s sender withdrew it."""
        return self._withdrawn.pop(member_id, None) is not None

    def admit(self, member_id: str) -> None:
        self.engine.submit(lambda e: self.admit_here(e, member_id))

    def admit_here(self, engine: Any, member_id: str) -> None:
        """Engine thread: the KV is in; start decoding unless the request was aborted meanwhile."""
        request_id = member_id.split("#", 1)[0]
        if request_id in self._cancelled:
            engine.cancel_remote(member_id)
            return
        engine.admit_remote(member_id)
        if self._flow.get(request_id, (0, False))[1]:  # its reader fell behind meanwhile
            engine.pause_request(request_id)


def _actor_id(handle: Any) -> Any:
    """The Ray actor a handle names (handles to one actor compare unequal otherwise)."""
    actor_id = getattr(handle, "_actor_id", None)
    return actor_id if actor_id is not None else id(handle)


def _hardware(device: torch.device, threads: int, dtype: str, model: str) -> str:
    """What a step's time depends on besides its tokens: the device (a GPU's name, else the CPU's
    model and threads), the dtype and the model."""
    if device.type == "cuda":
        where = f"cuda:{torch.cuda.get_device_name(device)}"
    else:
        where = f"{device.type}:{capabilities.cpu().model_name or capabilities.cpu().arch}:{threads} threads"
    return f"{where}|{dtype}|{model}"
