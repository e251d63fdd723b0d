"""The Worker: one engine in one Ray actor, with a role (prefill, decode or colocated).

The front talks to it with small calls (``add_request``, ``abort``); peers call the
KV-migration methods. Outputs leave as one msgpack batch per step and front, never one message
per token: pushed down the front's socket (``workers.output_stream``), or held for ``poll`` by a
front that has not connected one; a front whose socket closes has its requests aborted. A
prefill worker parks each request after its first token and ships the KV to the decode worker
named in the request: decode reserves blocks, the data moves over the pair's
``torch.distributed`` group (or the object store), decode admits, prefill releases. Between
workers on one machine (transport ``auto``) decode instead copies the blocks straight out of the
prefill worker's cache, which it maps (``workers.kv_shared``), in its own turn at the cores: one
RPC and one copy per request. Any failure frees both sides and ends the request with
``finish_reason="abort"``.

The class is plain Python; ``cluster.launcher`` wraps it with ``ray.remote``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kernels import capabilities, openmp
from workers.async_engine import AsyncEngine
from workers.config import EngineConfig, SchedulerConfig
from workers.core_share import CoreShare
from workers.errors import BatonError, OutOfBlocksError
from workers.kv_shared import KVExport, can_share, export_alive, map_export
from workers.kv_transfer import KVTransferEngine, KVTransferError, PairGroup, PairRendezvous, transfer_key
from workers.llm import build_engine
from workers.messages import encode_deltas, params_from_dict
from workers.migration import MigrationMeta
from workers.model.llama import KVCache
from workers.output_stream import FrontConnection, OutputServer
from workers.outputs import TokenDelta

log = logging.getLogger("baton.worker")
ROLES = ("prefill", "decode", "colocated")
TRANSPORTS = ("auto", "collective", "object_store")


class Worker:
    """An engine plus its outbox and KV shipping; every engine access goes through its loop thread."""

    def __init__(self, worker_id: str, role: str, engine: dict[str, Any], threads: int | None = 1,
                 kv_transport: str = "auto", kv_timeout_s: float = 30.0,
                 host: str = "127.0.0.1", core_share: dict[str, Any] | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if kv_transport not in TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {TRANSPORTS}, got {kv_transport!r}")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        # None: the cores of the machine this worker landed on (threads_per_worker = "auto" on a
        # cluster without CPU reservations)
        threads = threads or capabilities.usable_cores()
        torch.set_num_threads(threads)
        self.worker_id, self.role = worker_id, role
        self.kv_transport, self.kv_timeout_s, self.host = kv_transport, kv_timeout_s, host
        engine = dict(engine)
        # A prefill worker's cache goes in shared memory when its decode peers may map it.
        engine.setdefault("kv_cache_shared", role == "prefill" and kv_transport == "auto" and can_share())
        sched_keys = set(SchedulerConfig.__dataclass_fields__)
        sched = SchedulerConfig(**{k: engine.pop(k) for k in list(engine) if k in sched_keys})
        config = EngineConfig(scheduler=sched, **engine)

        def build() -> Any:
            core, self.tokenizer, self.model_path = build_engine(config)
            return core

        # A request's deltas go to the front (HTTP replica) that sent it: down that front's output
        # stream once it has connected (workers.output_stream), else to its outbox for ``poll``.
        self._outboxes: dict[str, list[TokenDelta]] = {}
        self._fronts: dict[str, FrontConnection] = {}
        self._gone_fronts: set[str] = set()  # whose stream closed: their late requests are aborted
        self._owner: dict[str, list[Any]] = {}  # request id -> [front id, samples not finished]
        self._out_cv = threading.Condition()
        # Built on the loop thread: every parallel region of the model runs on that one thread.
        # Workers whose threads outnumber this machine's cores take turns at them (workers.core_share).
        share = CoreShare(threads=threads, release_team=openmp.release_team, **core_share) if core_share else None
        self.engine = AsyncEngine(build, on_step=self._on_step, core_share=share)
        self.core = core = self.engine.engine
        self.transfer = KVTransferEngine(core.runner.kv_caches, core.config.block_size, core.runner.device)
        export = core.runner.kv_export  # set on a prefill worker whose peers may map its cache
        self._export = export.to_dict() if export is not None and kv_transport == "auto" else None
        self.peers: dict[str, Any] = {}
        self._pairs: dict[str, PairGroup] = {}
        self._pair_locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._decode_target: dict[str, str] = {}  # request id -> decode worker id (prefill role)
        self._cancelled: dict[str, float] = {}  # recently aborted ids, oldest first: late adds and KV are refused
        self._flow: dict[str, tuple[int, bool]] = {}  # backpressure state; engine thread only
        self._maps_ours: dict[str, bool] = {}  # decode peer id -> it maps our cache (prefill role)
        self._mapped: dict[str, tuple[KVExport, list[KVCache]]] = {}  # prefill peer -> its mapped cache
        self._withdrawn: dict[str, float] = {}  # members whose sender gave up; engine thread only
        # KV copies on side threads run serially: a team of their own would throttle the loop
        # thread's OpenMP waits for good (kernels.openmp). A shared-memory shipment only waits for
        # the decode worker's turn: with 2 threads, a step parking 5 requests took 3 decode turns.
        self._shipper = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-ship",
                                           initializer=openmp.serial_here)
        self.transfer_log: list[float] = []
        self._output = OutputServer(host, self._front_connected)

    # ------------------------------------------------------------------ front-facing
    def info(self) -> dict[str, Any]:
        c = self.core
        return {"worker_id": self.worker_id, "role": self.role, "model": self.model_path.name,
                "model_path": str(self.model_path), "num_blocks": c.block_manager.num_blocks,
                "block_size": c.config.block_size, "max_model_len": c.max_model_len,
                "vocab_size": c.vocab_size, "pid": os.getpid(), "dtype": c.config.dtype,
                "output_address": list(self._output.address)}

    def set_peers(self, peers: dict[str, Any]) -> None:
        """Actor handles of the other workers, by worker id (for KV shipping)."""
        self.peers = {k: v for k, v in peers.items() if k != self.worker_id}
        for gone in set(self._maps_ours) - set(self.peers):
            self._maps_ours.pop(gone, None)
        for gone in set(self._mapped) - set(self.peers):  # unmap: a dead peer's memory is freed
            self._mapped.pop(gone, None)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: dict[str, Any],
                    priority: int = 0, cache_salt: str | None = None, age_s: float = 0.0,
                    decode_worker: str | None = None, front_id: str = "default") -> None:
        """Queue a request (validated by the front). A prefill worker needs ``decode_worker``."""
        sampling = params_from_dict(params)
        self._register(request_id, front_id, sampling.n)
        if self._cancelled.pop(request_id, None) is not None:
            # Its abort overtook it (threaded actors reorder calls), or the id was used moments ago:
            # either way it must not run, and whoever listens must hear so rather than wait.
            self._emit([TokenDelta(request_id, i, [], finish_reason="abort",
                                   stop_reason=f"request id {request_id!r} was aborted moments ago")
                        for i in range(sampling.n)])
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
                                   cache_salt=cache_salt, arrival_time=arrival, prefill_only=prefill_only)
            except BatonError as exc:
                log.warning("request %s rejected by the engine: %s", request_id, exc)
                self._emit([TokenDelta(request_id, i, [], finish_reason="abort", stop_reason=str(exc))
                            for i in range(sampling.n)])

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
        self.engine.submit(lambda e: e.finish_request(request_id, index, "stop", stop))

    def poll(self, front_id: str = "default", timeout_s: float = 0.5) -> bytes:
        """Wait up to ``timeout_s`` for this front's outputs; return them as one msgpack batch."""
        with self._out_cv:
            if not self._outboxes.get(front_id):
                self._out_cv.wait(timeout_s)
            batch = self._outboxes.pop(front_id, [])
        return encode_deltas(batch)

    def stats(self) -> dict[str, Any]:
        for peer_id, (export, _) in list(self._mapped.items()):
            if not export_alive(export):  # its worker died: let the kernel free that memory
                self._mapped.pop(peer_id, None)
        s = self.engine.stats()
        recent, self.transfer_log = self.transfer_log, []
        out = dict(s.__dict__)
        share = self.engine.core_share
        out["extra"] = {"kv_transfer": {"bytes": self.transfer.stats.bytes, "recent_seconds": recent},
                        "core_wait_seconds": share.wait_seconds if share is not None else 0.0}
        out["alive"] = self.engine.is_alive
        out["pair_groups"] = len(self._pairs)
        out["mapped_peer_caches"] = len(self._mapped)
        out["tracked_requests"] = len(self._owner)
        with self._out_cv:
            out["output_fronts"] = sorted(self._fronts)  # fronts whose output stream is up
        return out

    def health(self) -> bool:
        return self.engine.is_alive

    def shutdown(self) -> None:
        self._output.close()
        self._shipper.shutdown(wait=False, cancel_futures=True)
        for group in self._pairs.values():
            group.close()
        self._mapped.clear()
        self.engine.shutdown()

    # ------------------------------------------------------------------ outputs
    def _register(self, request_id: str, front_id: str, n: int) -> None:
        with self._out_cv:
            self._owner.setdefault(request_id, [front_id, n])

    def _emit(self, deltas: list[TokenDelta]) -> None:
        with self._out_cv:
            by_front: dict[str, list[TokenDelta]] = {}
            for d in deltas:
                owner = self._owner.get(d.request_id)
                if owner is None:
                    continue  # aborted by its front: nobody listens
                by_front.setdefault(owner[0], []).append(d)
                if d.finish_reason is not None:
                    self._sample_left(d.request_id)
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

    def _sample_left(self, request_id: str) -> None:
        """One sample finished here or moved to a decode worker; forget the request after the last.
        Caller holds ``_out_cv``."""
        owner = self._owner.get(request_id)
        if owner is not None:
            owner[1] -= 1
            if owner[1] <= 0:
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
        target = self._decode_target.get(request_id)
        peer = self.peers.get(target) if target else None
        started = time.perf_counter()
        shared = False
        try:
            if peer is None:
                raise KVTransferError(f"decode worker {target!r} is not known")
            shared = self._maps_our_cache(target, peer)
            if shared:
                nbytes = self._until_room(meta, lambda front: peer.receive_kv_shared.remote(
                    self.worker_id, meta.to_dict(), front, table, self._export))
                self.transfer.record_transfer(nbytes, time.perf_counter() - started)
            else:
                needed, dst = self._until_room(meta, lambda front: peer.reserve_incoming.remote(meta.to_dict(), front))
                self._push(target, peer, member_id, [table[i] for i in needed], dst)
            self.transfer_log.append(time.perf_counter() - started)
            with self._out_cv:
                self._sample_left(request_id)
        except Exception as exc:  # any failure: free both sides, end the sample as aborted
            log.warning("KV shipping of %s to %s failed: %r", member_id, target, exc)
            if peer is not None:
                withdrawn = peer.cancel_incoming.remote(member_id)
                if shared:  # it may be reading our blocks: they are freed only once it has let go
                    with contextlib.suppress(Exception):
                        _ray_get(withdrawn, self.kv_timeout_s)
            self._drop_pair(target)
            index = int(member_id.rsplit("#", 1)[1]) if "#" in member_id else 0
            self._emit([TokenDelta(request_id, index, [], finish_reason="abort",
                                   stop_reason=f"kv transfer failed: {exc}")])
        finally:
            self.engine.submit(lambda e: e.release_parked(member_id))

    def _push(self, target: str, peer: Any, member_id: str, blocks: list[int], dst: list[int]) -> None:
        """Send the blocks into the decode worker's reserved ``dst`` (collective or object store)."""
        if self.kv_transport == "object_store":
            payload = self.transfer.pack_blocks(blocks)
            _ray_get(peer.receive_kv_packed.remote(member_id, dst, payload), self.kv_timeout_s)
            return
        with self._pair_lock(target):
            group = self._pair(target, peer)
            ref = peer.receive_kv.remote(self.worker_id, member_id, dst)
            # per-layer sends overlap the next gather with the wire; worth it past a few MB
            self.transfer.send_blocks(group, blocks, transfer_id=transfer_key(member_id),
                                      per_layer=len(blocks) >= 16)
            _ray_get(ref, self.kv_timeout_s)

    def _maps_our_cache(self, peer_id: str, peer: Any) -> bool:
        """True when ``peer`` (a decode worker) could map our exported cache: same machine, and
        /proc lets it open our descriptor. Asked once per peer; otherwise the collective path."""
        if self._export is None:
            return False
        same = self._maps_ours.get(peer_id)
        if same is None:
            same = bool(_ray_get(peer.map_peer_cache.remote(self.worker_id, self._export), self.kv_timeout_s))
            self._maps_ours[peer_id] = same
            if not same:
                log.info("decode worker %s cannot map this worker's KV cache: shipping over its pair group",
                         peer_id)
        return same

    def _until_room(self, meta: MigrationMeta, ask: Callable[[str], Any]) -> Any:
        """Call ``ask(front_id)`` (a decode worker RPC) until it answers other than None (None: no
        free blocks there now), backing off, until the timeout."""
        deadline = time.monotonic() + self.kv_timeout_s
        delay = 0.01
        while True:
            owner = self._owner.get(meta.request_id)
            answer = _ray_get(ask(owner[0] if owner else "default"), self.kv_timeout_s)
            if answer is not None:
                return answer
            if time.monotonic() > deadline:
                raise OutOfBlocksError(f"decode worker had no room for {meta.member_id} within "
                                       f"{self.kv_timeout_s}s")
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _pair_lock(self, peer_id: str) -> threading.Lock:
        with self._locks_guard:
            return self._pair_locks.setdefault(peer_id, threading.Lock())

    def _pair(self, peer_id: str, peer: Any) -> PairGroup:
        """The pair group to ``peer_id``, created on first use (this side listens as rank 0)."""
        group = self._pairs.get(peer_id)
        if group is not None and not group.usable:  # broken by an earlier failure: start over
            self._drop_pair(peer_id)
            group = None
        if group is None:
            group = PairGroup(self.core.runner.device)
            rendezvous = group.listen(host=self.host, timeout_s=self.kv_timeout_s)
            ref = peer.join_pair.remote(self.worker_id, rendezvous.to_dict())
            group.join(rendezvous, rank=0)
            _ray_get(ref, self.kv_timeout_s)
            self._pairs[peer_id] = group
        return group

    def _drop_pair(self, peer_id: str | None) -> None:
        group = self._pairs.pop(peer_id, None) if peer_id else None
        if group is not None:
            group.close()

    # ------------------------------------------------------------------ decode side
    def reserve_incoming(self, meta: dict[str, Any], front_id: str = "default"
                         ) -> tuple[list[int], list[int]] | None:
        """Allocate blocks for an arriving request: (logical indices it needs, their physical ids),
        or None when full now (the sender retries)."""
        m = MigrationMeta(**meta)
        if m.request_id in self._cancelled:
            raise KVTransferError(f"request {m.request_id} was aborted")
        self._register(m.request_id, front_id, int(m.params.get("n", 1)))
        def reserve(engine: Any) -> tuple[list[int], list[int]]:
            needed = engine.reserve_remote(m)
            table = engine.incoming_block_table(m.member_id)
            return needed, [table[i] for i in needed]

        try:
            return self.engine.call(reserve)
        except OutOfBlocksError:
            return None

    def join_pair(self, peer_id: str, rendezvous: dict[str, Any]) -> bool:
        """Rank 1 of a new pair group with ``peer_id`` (replaces any previous one)."""
        old = self._pairs.pop(peer_id, None)
        if old is not None:
            old.close()
        group = PairGroup(self.core.runner.device)
        group.join(PairRendezvous.from_dict(rendezvous), rank=1)
        self._pairs[peer_id] = group
        return True

    def receive_kv(self, peer_id: str, member_id: str, blocks: list[int]) -> int:
        """Receive the blocks the sender is pushing now into ``blocks`` (reserved by
        ``reserve_incoming``), then start decoding the request."""
        openmp.serial_here()  # a Ray thread: see _shipper
        try:
            nbytes = self.transfer.recv_blocks(self._pairs[peer_id], blocks, transfer_id=transfer_key(member_id))
        except Exception:
            self.engine.submit(lambda e: e.cancel_remote(member_id))
            raise
        self._admit(member_id)
        return nbytes

    def receive_kv_shared(self, peer_id: str, meta: dict[str, Any], front_id: str, source_table: list[int],
                          export: dict[str, Any]) -> int | None:
        """Same machine: in this worker's next turn at the cores, reserve blocks for the arriving
        request, copy its KV out of the sender's mapped cache and start decoding it. Returns the
        bytes copied, or None when full now (the sender retries)."""
        m = MigrationMeta(**meta)
        if m.request_id in self._cancelled:
            raise KVTransferError(f"request {m.request_id} was aborted")
        source = self._peer_cache(peer_id, KVExport.from_dict(export))
        self._register(m.request_id, front_id, int(m.params.get("n", 1)))

        def copy_in(engine: Any) -> int | None:
            if self._withdrawn.pop(m.member_id, None) is not None:  # its sender gave up meanwhile
                raise KVTransferError(f"{m.member_id} was withdrawn by its sender")
            try:
                needed = engine.reserve_remote(m)
            except OutOfBlocksError:
                return None
            table = engine.incoming_block_table(m.member_id)
            try:
                nbytes = self.transfer.copy_blocks_from(source, [source_table[i] for i in needed],
                                                        [table[i] for i in needed])
            except BaseException:
                engine.cancel_remote(m.member_id)
                raise
            self._admit_here(engine, m.member_id)
            return nbytes

        try:
            return self.engine.call_in_turn(copy_in, timeout=self.kv_timeout_s)
        except TimeoutError as exc:
            raise KVTransferError(f"no turn at the cores for {m.member_id} within {self.kv_timeout_s}s") from exc

    def map_peer_cache(self, peer_id: str, export: dict[str, Any]) -> bool:
        """Map a prefill peer's exported cache now; False when it cannot be (another machine,
        /proc closed to this process), and the peer then ships over its collective group."""
        try:
            self._peer_cache(peer_id, KVExport.from_dict(export))
        except KVTransferError as exc:
            log.info("cannot map the KV cache of %s: %s", peer_id, exc)
            return False
        return True

    def _peer_cache(self, peer_id: str, export: KVExport) -> list[KVCache]:
        """The sender's cache, mapped once per export (a restarted peer exports anew)."""
        held = self._mapped.get(peer_id)
        if held is None or held[0].token != export.token:
            held = self._mapped[peer_id] = (export, map_export(export))
        return held[1]

    def receive_kv_packed(self, member_id: str, blocks: list[int], payload: Any) -> int:
        openmp.serial_here()
        self.transfer.unpack_blocks(blocks, payload)
        self._admit(member_id)
        return int(getattr(payload, "nbytes", 0))

    def cancel_incoming(self, member_id: str) -> None:
        """The sender gave up on ``member_id``: free its reservation; returns once no copy of it
        is running here, and none will start (the sender may then reuse its blocks)."""
        def withdraw(engine: Any) -> None:
            now = time.monotonic()
            if len(self._withdrawn) > 1024:  # only a copy still queued can match an old entry
                self._withdrawn = {k: t for k, t in self._withdrawn.items() if now - t < 4 * self.kv_timeout_s}
            self._withdrawn[member_id] = now
            if engine.cancel_remote(member_id):
                self._withdrawn.pop(member_id, None)  # the reservation was still here: nothing queued

        self.engine.call(withdraw, timeout=self.kv_timeout_s)

    def _admit(self, member_id: str) -> None:
        self.engine.submit(lambda e: self._admit_here(e, member_id))

    def _admit_here(self, engine: Any, member_id: str) -> None:
        """Engine thread: the KV is in; start decoding unless the request was aborted meanwhile."""
        request_id = member_id.split("#", 1)[0]
        if request_id in self._cancelled:
            engine.cancel_remote(member_id)
            return
        engine.admit_remote(member_id)
        if self._flow.get(request_id, (0, False))[1]:  # its reader fell behind meanwhile
            engine.pause_request(request_id)


def _ray_get(ref: Any, timeout: float) -> Any:
    import ray

    return ray.get(ref, timeout=timeout)
