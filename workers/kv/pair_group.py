"""A two-rank ``torch.distributed`` group between one prefill and one decode worker.

Created lazily with its own rendezvous (no world group), so workers can join and leave freely;
gloo for CPU tensors, NCCL for CUDA tensors, same code. Every blocking call waits at most the
group's timeout and raises ``KVTransferError``; a group that failed mid-transfer is broken and
must be closed and joined anew.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from baton_serve.workers.errors import KVTransferError


class KVTransferRejected(KVTransferError):
    """The receiver refused the header: nothing moved and the group is still usable."""


def backend_for(device: torch.device | str) -> str:
    """``"nccl"`` for CUDA caches (raises if this torch lacks NCCL), ``"gloo"`` otherwise."""
    if torch.device(device).type == "cuda":
        if not dist.is_nccl_available():
            raise KVTransferError("CUDA KV caches need NCCL, which this torch build lacks")
        return "nccl"
    return "gloo"


@dataclass(frozen=True)
class PairRendezvous:
    """Where rank 1 finds rank 0's store; plain fields so it travels through msgpack/Ray."""

    host: str
    port: int
    group_name: str
    backend: str = "gloo"
    timeout_s: float = 30.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PairRendezvous:
        return cls(**data)


def local_ip_towards(host: str, port: int) -> str:
    """The local IPv4 address the kernel routes ``host`` from (UDP connect sends no packet)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


def listen_store(host: str, world_size: int, timeout_s: float) -> tuple[socket.socket, Any]:
    """Bind ``host:0`` (IPv4, exactly that address) and start a master TCPStore on it; raises
    OSError or RuntimeError. TCPStore would bind every interface given only a port, and it closes
    the fd it is handed when destroyed: it gets a duplicate, so the socket is closed only once."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen()
        store = dist.TCPStore(host, sock.getsockname()[1], world_size=world_size, is_master=True,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                              master_listen_fd=os.dup(sock.fileno()))
    except (OSError, RuntimeError):
        sock.close()
        raise
    return sock, store


def make_process_group(prefix: Any, rank: int, world_size: int, backend: str, device: torch.device,
                       timeout: timedelta, local_ip: str) -> Any:
    """A gloo (pinned to ``local_ip``'s interface: loopback stays loopback) or NCCL process group
    over ``prefix``, without a world group."""
    if backend == "nccl":
        # Untested here (CPU-only torch); mirrors torch's own new_group NCCL path. The watchdog
        # deadline is longer than ours so our wait() raises (and aborts) first instead of the
        # watchdog tearing the whole process down.
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout * 4
        with torch.cuda.device(device):
            pg = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
            pg.eager_connect_single_device(device)
        return pg
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_ip)]
    return dist.ProcessGroupGloo(prefix, rank, world_size, opts)


class PairGroup:
    """A two-rank process group: rank 0 = prefill (sends), rank 1 = decode (receives).

    Rank 0: ``rdv = listen()`` (never blocks on the peer: it binds host:0 and starts the
    store at once) -> hand ``rdv`` to rank 1 -> ``join(rdv, 0)``. Rank 1: ``join(rdv, 1)``.
    The two joins may start in either order but must overlap: each blocks until the other
    side has joined or ``timeout_s`` passed (then ``KVTransferError`` and the group is closed).
    Callers issue both joins before waiting on either (``ray.get([a.join.remote(..),
    b.join.remote(..)])``); an actor that must stay responsive joins from a thread. Transfers
    on one group are serialised and must happen in the same order on both sides.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.rank: int | None = None
        self.rendezvous: PairRendezvous | None = None
        self._sock: socket.socket | None = None
        self._store: Any = None
        self._pg: Any = None
        self._timeout = timedelta(seconds=30)
        self._state_lock = threading.Lock()
        self._io_lock = threading.Lock()
        self._seq = 0
        self._broken = False
        self._closed = False

    def listen(self, host: str = "127.0.0.1", timeout_s: float = 30.0,
               group_name: str | None = None) -> PairRendezvous:
        """Rank 0: bind ``host:0`` (IPv4, exactly that address) and start the store there."""
        if self._sock is not None or self._pg is not None or self._closed:
            raise KVTransferError("listen() is called once, on a fresh PairGroup")
        backend_name = backend_for(self.device)
        try:
            sock, store = listen_store(host, 2, timeout_s)
        except (OSError, RuntimeError) as exc:
            raise KVTransferError(f"cannot listen on {host}: {exc}") from exc
        port = sock.getsockname()[1]
        self._sock, self._store = sock, store
        self.rendezvous = PairRendezvous(host, port, group_name or f"kv-{uuid.uuid4().hex[:12]}",
                                         backend_name, float(timeout_s))
        return self.rendezvous

    @property
    def bound_address(self) -> tuple[str, int] | None:
        """Rank 0's listening (host, port); ``None`` on rank 1 or after ``close``."""
        return None if self._sock is None else self._sock.getsockname()[:2]

    def join(self, rendezvous: PairRendezvous, rank: int) -> None:
        """Block until both ranks are in (see the class contract); raises ``KVTransferError``."""
        if rank not in (0, 1):
            raise ValueError(f"rank must be 0 or 1, got {rank}")
        if self._pg is not None or self._closed:
            raise KVTransferError("join() is called once, on an open PairGroup")
        if rank == 0 and (self._store is None or rendezvous != self.rendezvous):
            raise KVTransferError("rank 0 joins the rendezvous its own listen() returned")
        if rendezvous.backend != backend_for(self.device):
            raise KVTransferError(f"rendezvous backend {rendezvous.backend!r} does not fit {self.device}")
        timeout = timedelta(seconds=rendezvous.timeout_s)
        try:
            store = self._store if rank == 0 else dist.TCPStore(
                rendezvous.host, rendezvous.port, world_size=2, is_master=False, timeout=timeout)
            prefix = dist.PrefixStore(rendezvous.group_name, store)
            # Meet through the store first (bounded by the timeout): NCCL's communicator
            # setup has no timeout of its own, so it must only start once the peer is there.
            prefix.set(f"joined/{rank}", "1")
            prefix.wait([f"joined/{1 - rank}"], timeout)
            pg = make_process_group(prefix, rank, 2, rendezvous.backend, self.device, timeout,
                                    local_ip_towards(rendezvous.host, rendezvous.port))
        except (RuntimeError, OSError) as exc:  # DistStoreError / DistNetworkError / gloo
            self.close()
            raise KVTransferError(f"pair {rendezvous.group_name}: rank {rank} could not join "
                                  f"within {rendezvous.timeout_s}s: {exc}") from exc
        with self._state_lock:
            self.rank, self.rendezvous, self._timeout = rank, rendezvous, timeout
            self._store, self._pg = store, pg

    @property
    def usable(self) -> bool:
        """Joined, not closed, and no failed operation left the byte stream out of step."""
        return self._pg is not None and not self._broken and not self._closed

    def mark_broken(self) -> None:
        """A caller's operation failed part-way: nothing more may go over this group."""
        self._broken = True

    def _live_pg(self) -> Any:
        if not self.usable:
            raise KVTransferError("pair group is not joined, broken or closed")
        return self._pg

    def _wait(self, work: Any, what: str) -> None:
        try:
            ok = work.wait(self._timeout)
        except RuntimeError as exc:  # gloo: peer reset/closed, or the timeout
            ok, err = False, exc
        else:
            err = None
        if not ok:
            self._broken = True
            pg = self._pg
            if pg is not None and self.rendezvous.backend == "nccl":
                with contextlib.suppress(RuntimeError):
                    pg.abort()  # a stuck NCCL op never completes; free the communicator
            raise KVTransferError(f"{what} on pair {self.rendezvous.group_name} failed: "
                                  f"{err or 'timed out'} (timeout {self._timeout.total_seconds()}s)") from err

    def isend(self, tensor: torch.Tensor, tag: int = 0) -> Callable[[], None]:
        """Start sending a contiguous tensor; the returned callable waits (with the timeout)."""
        work = self._live_pg().send([_wire(tensor)], 1 - self.rank, tag)
        return lambda: self._wait(work, "send")

    def send(self, tensor: torch.Tensor, tag: int = 0) -> None:
        """Blocking send to the peer; ``KVTransferError`` on timeout or peer death."""
        self.isend(tensor, tag)()

    def recv(self, tensor: torch.Tensor, tag: int = 0) -> None:
        """Blocking receive into ``tensor`` (same byte size as sent); errors as ``send``."""
        self._wait(self._live_pg().recv([_wire(tensor)], 1 - self.rank, tag), "recv")

    @contextlib.contextmanager
    def transfer(self) -> Iterator[int]:
        """Serialise one transfer; yields its sequence number. A failure other than a clean
        rejection leaves the byte stream out of step, so it marks the group broken."""
        with self._io_lock:
            self._live_pg()
            self._seq += 1
            try:
                yield self._seq
            except KVTransferRejected:
                raise
            except BaseException:
                self._broken = True
                raise

    def close(self) -> None:
        """Tear down (idempotent); may wait for an in-flight op on another thread to end (it is
        bounded by the timeout). The peer's pending or next operation then fails promptly."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            pg, sock = self._pg, self._sock
            self._pg = self._store = self._sock = None
        if pg is not None and self.rendezvous is not None and self.rendezvous.backend == "nccl":
            with contextlib.suppress(RuntimeError):
                pg.abort()  # NCCL communicators outlive the Python object unless aborted
        if sock is not None:
            sock.close()

    def __enter__(self) -> PairGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    # Send raw bytes: any dtype (bf16, fp8) goes through either backend unchanged.
    if not tensor.is_contiguous():
        raise ValueError("pair group send/recv needs a contiguous tensor")
    return tensor.view(-1).view(torch.uint8)
