"""Same-machine KV sharing: a prefill worker's paged cache in a memfd its decode peers map.

When both workers of a pair run on one machine with the cache in host memory, the decode worker
maps the prefill worker's KV cache (an anonymous memfd, opened through ``/proc/<pid>/fd``) and
copies a request's blocks straight into its own, with its whole OpenMP team, in its own turn at
the cores. One copy, where the collective path makes four (gather, two socket copies, scatter) on
side threads that preempt whichever step is running. The kernel frees the memory once the
exporting process and every mapping of it are gone, so a crash leaves nothing behind.
"""

from __future__ import annotations

import math
import os
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from workers.errors import KVTransferError
from workers.model.llama import KVCache
from workers.model.loader import parse_dtype


def machine_id() -> str:
    """Same value in two processes iff ``/proc/<pid>`` names the same process in both:
    the same booted kernel and the same PID namespace."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"


def can_share() -> bool:
    """True where this process can export a cache (Linux with memfd and /proc)."""
    try:
        machine_id()
    except OSError:
        return False
    return hasattr(os, "memfd_create")


@dataclass(frozen=True)
class KVExport:
    """What a peer on the same machine needs to map an exported KV cache."""

    machine: str
    pid: int
    fd: int
    token: str  # in the memfd's name: a reused pid or fd cannot pass for this export
    num_layers: int
    shape: tuple[int, ...]  # one layer's K (or V) cache: [blocks, block_size, kv_heads, head_dim]
    dtype: str

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> KVExport:
        return cls(**{**d, "shape": tuple(d["shape"])})

    @property
    def nbytes(self) -> int:
        return 2 * self.num_layers * math.prod(self.shape) * parse_dtype(self.dtype).itemsize


def allocate_shared(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[list[KVCache], KVExport]:
    """Zeroed K and V caches for ``num_layers`` layers in one memfd, and how peers map it.
    The descriptor stays open for the life of the process (peers open it through /proc)."""
    name = str(dtype).removeprefix("torch.")
    token = uuid.uuid4().hex
    fd = os.memfd_create(f"baton-kv-{token}", os.MFD_CLOEXEC)
    export = KVExport(machine_id(), os.getpid(), fd, token, num_layers, tuple(shape), name)
    try:
        os.ftruncate(fd, export.nbytes)
        caches = _views(f"/proc/self/fd/{fd}", export)
    except BaseException:
        os.close(fd)
        raise
    return caches, export


def export_alive(export: KVExport) -> bool:
    """True while the exporting process still holds the cache (a mapping made earlier stays
    valid either way, and keeps the memory until it is dropped)."""
    try:
        return f"baton-kv-{export.token}" in os.readlink(f"/proc/{export.pid}/fd/{export.fd}")
    except OSError:
        return False


def map_export(export: KVExport) -> list[KVCache]:
    """Map a peer's exported cache (read and written in place: no copy is made here).
    Raises ``KVTransferError`` when the peer is on another machine or gone."""
    if export.machine != machine_id():
        raise KVTransferError(f"KV cache of pid {export.pid} is on another machine")
    path = f"/proc/{export.pid}/fd/{export.fd}"
    try:
        target = os.readlink(path)
        size = os.stat(path).st_size
    except OSError as exc:
        raise KVTransferError(f"cannot open the KV cache of pid {export.pid}: {exc}") from exc
    if f"baton-kv-{export.token}" not in target or size != export.nbytes:
        raise KVTransferError(f"pid {export.pid} fd {export.fd} is not the exported KV cache "
                              f"({target}, {size} bytes)")
    try:
        return _views(path, export)
    except RuntimeError as exc:  # the process exited between the checks and the mapping
        raise KVTransferError(f"cannot map the KV cache of pid {export.pid}: {exc}") from exc


def _views(path: str, export: KVExport) -> list[KVCache]:
    per = math.prod(export.shape)
    flat = torch.from_file(path, shared=True, size=2 * export.num_layers * per,
                           dtype=parse_dtype(export.dtype))
    return [(flat[(2 * i) * per:(2 * i + 1) * per].view(export.shape),
             flat[(2 * i + 1) * per:(2 * i + 2) * per].view(export.shape))
            for i in range(export.num_layers)]
