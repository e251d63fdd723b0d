"""Same-machine KV sharing: a prefill worker's paged cache that its decode peers map.

When both workers of a pair run on one machine with the cache in host memory, the decode worker
maps the prefill worker's KV cache (an anonymous memfd, opened through ``/proc/<pid>/fd``) and
copies a request's blocks straight into its own, with its whole OpenMP team, in its own turn at
the cores. One copy, where the collective path makes four (gather, two socket copies, scatter) on
side threads that preempt whichever step is running. The kernel frees the memory once the
exporting process and every mapping of it are gone, so a crash leaves nothing behind.

A cache on a GPU is exported as a CUDA IPC handle instead, and a decode worker maps it only when it
sees the same physical GPU (by UUID): two workers sharing one GPU cannot use NCCL at all (it refuses
two ranks on one device), and a device-to-device copy is the cheapest move there is. The memfd then
only names the export, so that ``export_alive`` works alike for both.
"""

from __future__ import annotations

import dataclasses
import math
import os
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from baton_serve.workers.errors import KVTransferError
from baton_serve.workers.kv.layout import split_layers
from baton_serve.workers.model.llama import KVCache
from baton_serve.workers.model.loader import parse_dtype


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
    cuda: dict | None = None  # a GPU cache: its device's UUID and the CUDA IPC handle (``_cuda_ipc``)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> KVExport:
        return cls(**{**d, "shape": tuple(d["shape"])})

    @property
    def nbytes(self) -> int:
        return 2 * self.num_layers * math.prod(self.shape) * parse_dtype(self.dtype).itemsize


def allocate_shared(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device | str = "cpu") -> tuple[list[KVCache], KVExport]:
    """Zeroed K and V caches for ``num_layers`` layers in one allocation peers can map (a memfd,
    or GPU memory behind a CUDA IPC handle), and how they map it. The memfd stays open for the
    life of the process (peers open it through /proc; for a GPU cache it only names the export)."""
    device = torch.device(device)
    name = str(dtype).removeprefix("torch.")
    token = uuid.uuid4().hex
    fd = os.memfd_create(f"baton-kv-{token}", os.MFD_CLOEXEC)
    export = KVExport(machine_id(), os.getpid(), fd, token, num_layers, tuple(shape), name)
    try:
        if device.type == "cuda":
            flat = torch.zeros(export.nbytes // dtype.itemsize, dtype=dtype, device=device)
            export = dataclasses.replace(export, cuda=_cuda_ipc(flat))
            caches = _split(flat, export)
        else:
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
    if f"baton-kv-{export.token}" not in target or size != (0 if export.cuda else export.nbytes):
        raise KVTransferError(f"pid {export.pid} fd {export.fd} is not the exported KV cache "
                              f"({target}, {size} bytes)")
    try:
        return _open_cuda(export) if export.cuda else _views(path, export)
    except RuntimeError as exc:  # the process exited between the checks and the mapping
        raise KVTransferError(f"cannot map the KV cache of pid {export.pid}: {exc}") from exc


def _views(path: str, export: KVExport) -> list[KVCache]:
    flat = torch.from_file(path, shared=True, size=export.nbytes // parse_dtype(export.dtype).itemsize,
                           dtype=parse_dtype(export.dtype))
    return _split(flat, export)


def _split(flat: torch.Tensor, export: KVExport) -> list[KVCache]:
    return split_layers(flat, export.num_layers, export.shape)


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _cuda_ipc(flat: torch.Tensor) -> dict:
    """The IPC handle of ``flat``'s allocation, as plain fields (what torch's multiprocessing
    reductions send, without pickling tensor classes)."""
    (_, handle, size, offset, ref_handle, ref_offset, event, event_sync) = flat.untyped_storage()._share_cuda_()
    return {"uuid": _device_uuid(flat.device.index), "handle": handle, "size": size, "offset": offset,
            "ref_handle": ref_handle, "ref_offset": ref_offset, "event": event, "event_sync": event_sync}


def _open_cuda(export: KVExport) -> list[KVCache]:
    """Open a GPU cache's IPC handle on this process's view of the same physical device (its
    index may differ here: ``CUDA_VISIBLE_DEVICES``); ``KVTransferError`` when it is not visible."""
    ipc = export.cuda
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = next((i for i in range(visible) if _device_uuid(i) == ipc["uuid"]), None)
    if index is None:
        raise KVTransferError(f"the GPU holding the KV cache of pid {export.pid} ({ipc['uuid']}) is not "
                              f"visible to this process")
    storage = torch.UntypedStorage._new_shared_cuda(index, ipc["handle"], ipc["size"], ipc["offset"],
                                                    ipc["ref_handle"], ipc["ref_offset"], ipc["event"],
                                                    ipc["event_sync"])
    dtype = parse_dtype(export.dtype)
    flat = torch.empty(0, dtype=dtype, device=torch.device("cuda", index))
    flat.set_(storage, 0, (export.nbytes // dtype.itemsize,), (1,))
    return _split(flat, export)
