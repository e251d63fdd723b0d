"""Each rank's part of KV shipments between tensor-parallel replicas (KV resharding).

A rank's cache holds only its KV heads, so a shipment moves rank to rank: every prefill rank that
is a route's source (``workers.parallel.kv_routes``) sends those heads of the sample's blocks to
the decode rank that holds them, over a pair group of their own. Rank 0 (the Worker) drives it:
it calls ``KVAgent`` methods on itself directly and on ranks 1..N-1 through a command channel
(one TCP connection per rank, msgpack request/reply frames, each command on its own thread so a
transfer waiting for its peer does not hold up the next one). Block ids are rank 0's: every rank
of a replica has the same blocks, since every rank runs rank 0's step plans.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgpack
import torch
from baton_serve.kernels import openmp
from baton_serve.workers.errors import KVTransferError, TensorParallelError
from baton_serve.workers.kv.integrity import block_crcs, corrupt_block
from baton_serve.workers.kv.pair_group import KVTransferRejected, PairGroup, PairRendezvous
from baton_serve.workers.kv.transfer import KVTransferEngine
from baton_serve.workers.parallel.plan_channel import (
    LEN,
    accept_ranks,
    connect_rank,
    rank_listener,
    recv_exact,
)

log = logging.getLogger("baton.tp")
_OPS = ("listen", "join", "close_pair", "send", "recv", "crcs", "stats")


class KVAgent:
    """One rank's pair groups to ranks of other replicas, and the sends and receives of its heads."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 device: torch.device | str, host: str) -> None:
        self.kv_caches, self.block_size, self.device, self.host = kv_caches, block_size, torch.device(device), host
        self._groups: dict[str, PairGroup] = {}
        self._engines: dict[tuple[int, int], KVTransferEngine] = {}
        self._lock = threading.Lock()

    def listen(self, key: str, timeout_s: float) -> dict[str, Any]:
        """Open pair group ``key`` as its rank 0 (the sender); its rendezvous for the peer rank."""
        group = PairGroup(self.device)
        rendezvous = group.listen(host=self.host, timeout_s=timeout_s)
        self._replace(key, group)
        return rendezvous.to_dict()

    def join(self, key: str, rank: int, rendezvous: dict[str, Any] | None = None) -> bool:
        """Join pair group ``key``: rank 0 the one ``listen`` opened, rank 1 the peer's ``rendezvous``."""
        if rank == 0:
            group = self._groups.get(key)
            if group is None or group.rendezvous is None:
                raise KVTransferError(f"pair {key} was not opened here")
            group.join(group.rendezvous, rank=0)
        else:
            group = PairGroup(self.device)
            self._replace(key, group)
            group.join(PairRendezvous.from_dict(rendezvous or {}), rank=1)
        return True

    def close_pair(self, key: str) -> None:
        with self._lock:
            group = self._groups.pop(key, None)
        if group is not None:
            group.close()

    def usable(self, key: str) -> bool:
        group = self._groups.get(key)
        return group is not None and group.usable

    def send(self, key: str, blocks: list[int], heads: list[int], transfer_id: int, per_layer: bool) -> int:
        """Send KV heads ``[heads[0], heads[1])`` of ``blocks`` down pair ``key``; the bytes sent."""
        group = self._group(key)
        try:
            return self._engine(heads).send_blocks(group, blocks, transfer_id=transfer_id, per_layer=per_layer)
        except KVTransferRejected:
            raise
        except BaseException:
            group.mark_broken()
            raise

    def recv(self, key: str, blocks: list[int], heads: list[int], transfer_id: int,
             expect: list[list[int]] | None = None, num_tokens: int = 0, corrupt: bool = False) -> int:
        """Receive into ``blocks`` (those heads) from pair ``key``, then check each
        ``(block, logical index, crc)`` of ``expect``; the bytes received."""
        group = self._group(key)
        engine = self._engine(heads)
        try:
            nbytes = engine.recv_blocks(group, blocks, transfer_id=transfer_id)
        except KVTransferRejected:
            raise
        except BaseException:
            group.mark_broken()
            raise
        if expect:
            if corrupt:  # the fault suite's corruption, on this rank's part
                corrupt_block(engine.kv_caches, expect[0][0])
            got = block_crcs(engine.kv_caches, [e[0] for e in expect], num_tokens, self.block_size,
                             [e[1] for e in expect])
            bad = [e[1] for e, crc in zip(expect, got) if crc != e[2]]
            if bad:
                raise KVTransferError(f"KV heads {heads} failed their checksum in {len(bad)} of {len(expect)} "
                                      f"block(s) (logical {bad[:8]}): not decoded, placed again")
        return nbytes

    def crcs(self, blocks: list[int], heads: list[int], num_tokens: int, logical: list[int]) -> list[int]:
        """CRC-32 of heads ``heads`` of each block (``workers.kv.integrity``), for the receiver to check."""
        return block_crcs(self._engine(heads).kv_caches, blocks, num_tokens, self.block_size, logical)

    def stats(self) -> dict[str, Any]:
        return {"pair_groups": sum(g.usable for g in list(self._groups.values()))}

    def close(self) -> None:
        for key in list(self._groups):
            self.close_pair(key)

    def _replace(self, key: str, group: PairGroup) -> None:
        with self._lock:
            old, self._groups[key] = self._groups.get(key), group
        if old is not None:
            old.close()

    def _group(self, key: str) -> PairGroup:
        group = self._groups.get(key)
        if group is None or not group.usable:
            raise KVTransferError(f"pair {key} is not joined, or broken")
        return group

    def _engine(self, heads: list[int]) -> KVTransferEngine:
        span = (int(heads[0]), int(heads[1]))
        with self._lock:
            engine = self._engines.get(span)
            if engine is None:
                engine = self._engines[span] = KVTransferEngine(self.kv_caches, self.block_size, self.device, span)
        return engine


class AgentHandle:
    """How rank 0 calls one rank's agent: ``call(op, limit_s, **args)``, waiting at most ``limit_s``
    (rank 0's own: directly)."""

    rank: int = 0

    def call(self, op: str, limit_s: float, **args: Any) -> Any:
        raise NotImplementedError


class LocalAgent(AgentHandle):
    """Rank 0's own agent, called in its process."""

    def __init__(self, agent: KVAgent) -> None:
        self.agent = agent

    def call(self, op: str, limit_s: float, **args: Any) -> Any:
        if op not in _OPS:
            raise ValueError(f"unknown KV agent op {op!r}")
        return getattr(self.agent, op)(**args)


class RemoteAgent(AgentHandle):
    """Rank 0's end of one rank's command channel: frames ``[id, op, args]`` out, ``[id, ok,
    result or [error type, message]]`` back, in any order."""

    def __init__(self, rank: int, conn: socket.socket) -> None:
        self.rank, self._conn = rank, conn
        self._ids = itertools.count()
        self._waiting: dict[int, Future[Any]] = {}
        self._lock = threading.Lock()
        self._gone: str | None = None
        threading.Thread(target=self._read, name=f"kv-agent-{rank}", daemon=True).start()

    def call(self, op: str, limit_s: float, **args: Any) -> Any:
        future: Future[Any] = Future()
        with self._lock:
            if self._gone is not None:
                raise KVTransferError(self._gone)
            call_id = next(self._ids)
            self._waiting[call_id] = future
            payload = msgpack.packb([call_id, op, args])
            try:
                self._conn.sendall(LEN.pack(len(payload)) + payload)
            except OSError as exc:
                self._waiting.pop(call_id, None)
                raise KVTransferError(f"tensor-parallel rank {self.rank} is gone: {exc}") from exc
        try:
            return future.result(timeout=limit_s)
        except TimeoutError as exc:
            raise KVTransferError(f"tensor-parallel rank {self.rank} did not finish {op} within {limit_s}s") from exc
        finally:
            with self._lock:
                self._waiting.pop(call_id, None)

    def _read(self) -> None:
        while True:
            try:
                head = recv_exact(self._conn, LEN.size)
                frame = None if head is None else recv_exact(self._conn, LEN.unpack(head)[0])
            except OSError:
                frame = None
            if frame is None:
                break
            call_id, ok, result = msgpack.unpackb(frame)
            with self._lock:
                future = self._waiting.get(call_id)
            if future is None:
                continue  # its caller timed out
            if ok:
                future.set_result(result)
            else:
                kind, message = result
                error = KVTransferRejected if kind == "KVTransferRejected" else KVTransferError
                future.set_exception(error(f"tensor-parallel rank {self.rank}: {message}"))
        with self._lock:
            self._gone = f"tensor-parallel rank {self.rank} is gone"
            waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(KVTransferError(self._gone))

    def close(self) -> None:
        self._conn.close()


class AgentListener:
    """Rank 0's listener for its ranks' command channels (``accept`` once they have a cache)."""

    def __init__(self, host: str, world_size: int, secret: str) -> None:
        self.world_size, self._secret = world_size, secret.encode()[:32].ljust(32, b"\0")
        self._listener = rank_listener(host, world_size)
        self.port = self._listener.getsockname()[1]

    def accept(self, timeout_s: float) -> list[RemoteAgent]:
        conns = accept_ranks(self._listener, self.world_size, self._secret, timeout_s, "KV agent channel")
        return [RemoteAgent(rank, conns[rank]) for rank in sorted(conns)]

    def close(self) -> None:
        self._listener.close()


def serve_agent(agent: KVAgent, host: str, port: int, rank: int, secret: str, timeout_s: float) -> threading.Thread:
    """Rank 1..N-1: connect the command channel and run rank 0's commands on ``agent`` in a
    daemon thread, until rank 0 closes the channel."""
    conn = connect_rank(host, port, rank, secret, timeout_s, "KV agent channel")
    send_lock = threading.Lock()
    pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-agent", initializer=openmp.serial_here)

    def run(call_id: int, op: str, args: dict[str, Any]) -> None:
        try:
            if op not in _OPS:
                raise ValueError(f"unknown KV agent op {op!r}")
            reply = [call_id, True, getattr(agent, op)(**args)]
        except Exception as exc:  # noqa: BLE001 - every failure goes back to rank 0, typed by name
            reply = [call_id, False, [type(exc).__name__, str(exc)]]
        payload = msgpack.packb(reply)
        with send_lock:
            try:
                conn.sendall(LEN.pack(len(payload)) + payload)
            except OSError:
                pass  # rank 0 is gone; the loop below reads end-of-file

    def loop() -> None:
        try:
            while True:
                head = recv_exact(conn, LEN.size)
                frame = None if head is None else recv_exact(conn, LEN.unpack(head)[0])
                if frame is None:
                    break
                call_id, op, args = msgpack.unpackb(frame)
                pool.submit(run, call_id, op, args)
        except (OSError, TensorParallelError):
            pass
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            agent.close()
            conn.close()

    thread = threading.Thread(target=loop, name="kv-agent", daemon=True)
    thread.start()
    return thread
