"""The process group of one tensor-parallel replica: its ranks all-reduce partial sums over it.

Its own rendezvous (a TCPStore on rank 0's address, no world group), so a replica never shares
a group with the KV pair groups of the same process; gloo for CPU tensors, NCCL for CUDA tensors.
Every collective waits at most the group's timeout: a rank that died or hangs turns into a
``TensorParallelError`` on the others, never a hang.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from baton_serve.workers.errors import KVTransferError, TensorParallelError
from baton_serve.workers.kv import pair_group


@dataclass(frozen=True)
class TPRendezvous:
    """Where ranks 1..N-1 find rank 0 (its store and its plan channel); plain fields for Ray/pickle."""

    host: str
    store_port: int
    plan_port: int
    world_size: int
    group_name: str
    secret: str
    backend: str = "gloo"
    timeout_s: float = 60.0
    kv_port: int = 0  # rank 0's listener for the ranks' KV agent channels (workers.parallel.kv_agent)


def group_backend(device: torch.device | str) -> str:
    """``"nccl"`` for CUDA, ``"gloo"`` otherwise (as the KV pair groups choose)."""
    try:
        return pair_group.backend_for(device)
    except KVTransferError as exc:
        raise TensorParallelError(f"tensor parallelism: {exc}") from None


def listen_store(host: str, world_size: int, timeout_s: float) -> tuple[socket.socket, Any]:
    """Rank 0: the replica's store on ``host`` (that address only; see ``pair_group.listen_store``)."""
    try:
        return pair_group.listen_store(host, world_size, timeout_s)
    except (OSError, RuntimeError) as exc:
        raise TensorParallelError(f"cannot listen on {host}: {exc}") from exc


class TPGroup:
    """One replica's group; ``all_reduce`` sums in place across the ranks."""

    def __init__(self, rendezvous: TPRendezvous, rank: int, device: torch.device | str = "cpu",
                 store: Any = None, failed: Callable[[], str | None] | None = None) -> None:
        """Join (blocks until every rank has, or raises ``TensorParallelError`` after the timeout);
        rank 0 passes the store ``listen_store`` started, and ``failed``: why a rank will never
        join (it exited), checked while waiting so that a crash fails the start at once."""
        self.rendezvous, self.rank, self.world_size = rendezvous, rank, rendezvous.world_size
        self.device = torch.device(device)
        self.timeout = timedelta(seconds=rendezvous.timeout_s)
        self.broken = False
        self.num_all_reduces, self.all_reduce_seconds = 0, 0.0  # rank 0's share of a step (benchmarks)
        try:
            if store is None:
                store = dist.TCPStore(rendezvous.host, rendezvous.store_port, world_size=self.world_size,
                                      is_master=False, timeout=self.timeout)
            prefix = dist.PrefixStore(rendezvous.group_name, store)
            # Meet through the store first, bounded: NCCL's setup has no timeout of its own.
            prefix.set(f"joined/{rank}", "1")
            _wait_keys(prefix, [f"joined/{r}" for r in range(self.world_size)], self.timeout, failed)
            self._pg = pair_group.make_process_group(
                prefix, rank, self.world_size, rendezvous.backend, self.device, self.timeout,
                pair_group.local_ip_towards(rendezvous.host, rendezvous.store_port))
        except (RuntimeError, OSError) as exc:
            raise TensorParallelError(f"tensor-parallel group {rendezvous.group_name}: rank {rank} of "
                                      f"{self.world_size} could not join within {rendezvous.timeout_s}s: {exc}") from exc
        self._store = store

    def _wait(self, work: Any, what: str) -> None:
        if self.broken:
            raise TensorParallelError(f"tensor-parallel group {self.rendezvous.group_name} is broken")
        try:
            ok, err = work.wait(self.timeout), None
        except RuntimeError as exc:  # gloo: a peer reset or closed, or the timeout
            ok, err = False, exc
        if not ok:
            self.broken = True
            if self.rendezvous.backend == "nccl":
                with contextlib.suppress(RuntimeError):
                    self._pg.abort()
            raise TensorParallelError(f"{what} on tensor-parallel group {self.rendezvous.group_name} (rank "
                                      f"{self.rank} of {self.world_size}) failed: {err or 'timed out'} "
                                      f"(timeout {self.timeout.total_seconds()}s)") from err

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        started = time.perf_counter()
        self._wait(self._pg.allreduce([x]), "all-reduce")
        self.num_all_reduces += 1
        self.all_reduce_seconds += time.perf_counter() - started
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x``, in rank order (benchmarks price a vocab-parallel LM head with it)."""
        out = [torch.empty_like(x) for _ in range(self.world_size)]
        self._wait(self._pg.allgather([out], [x]), "all-gather")
        return out

    def broadcast(self, x: torch.Tensor, root: int = 0) -> torch.Tensor:
        """``x`` from ``root`` to every rank, in place (benchmarks compare it with the plan channel)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self._wait(self._pg.broadcast([x], opts), "broadcast")
        return x

    def close(self) -> None:
        """Tear down; the other ranks' next collective fails promptly."""
        self.broken = True
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None and self.rendezvous.backend == "nccl":
            with contextlib.suppress(RuntimeError):
                pg.abort()
        self._store = None


def _wait_keys(store: Any, keys: list[str], timeout: timedelta, failed: Callable[[], str | None] | None) -> None:
    if failed is None:
        store.wait(keys, timeout)
        return
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        why = failed()
        if why is not None:
            raise RuntimeError(why)
        if store.check(keys):  # polled: a short wait() logs a warning each time it runs out
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"timed out after {timeout.total_seconds()}s waiting for {keys}")
        time.sleep(0.05)
