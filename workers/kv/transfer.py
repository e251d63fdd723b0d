"""KV block shipping from a prefill worker's paged cache into a decode worker's (mechanism only).

Ownership (ARCHITECTURE step 8): decode allocates the destination blocks and calls
``recv_blocks``; prefill calls ``send_blocks`` on its source blocks. ``send_blocks`` returns
only after decode acknowledged the scatter, so prefill may release its blocks then. Every
blocking step waits at most the group's timeout and raises ``KVTransferError``, never hangs.

Wire protocol per transfer on a ``PairGroup`` (rank 0 sends, rank 1 receives): header ->
verdict (0 = accept, else a bitmask of mismatching fields) -> data (one buffer, or one per
layer) -> ack (the sequence number). A rejected header moves nothing and leaves the group
usable; any other failure marks the group broken: close it and join a new one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from baton_serve.kernels import backend
from baton_serve.workers.errors import KVTransferError
from baton_serve.workers.kv.layout import stacked
from baton_serve.workers.kv.pair_group import (  # noqa: F401  (re-exported: the worker imports them from here)
    KVTransferRejected,
    PairGroup,
    PairRendezvous,
    backend_for,
)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64,
           torch.float8_e4m3fn, torch.float8_e5m2)
_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64}
_MAGIC, _VERSION = 0x4241544F4E4B56, 1  # "BATONKV"
_FIELDS = ("magic", "version", "seq", "transfer_id", "num_blocks", "num_layers", "dtype",
           "block_size", "num_kv_heads", "head_dim")
_PER_LAYER = len(_FIELDS)  # header slot after the checked fields; the sender picks the mode
_BAD_IDS = 1 << 20  # verdict bit: the receiver's own block ids are invalid
_TAG_HEADER, _TAG_VERDICT, _TAG_DATA, _TAG_ACK = 1, 2, 3, 4


def transfer_key(request_id: str) -> int:
    """A stable 63-bit id for a request, for ``transfer_id`` (both sides compute it)."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "big") >> 1


@dataclass
class KVTransferStats:
    """Counters for ``baton:kv_transfer_seconds`` / ``baton:kv_transfer_bytes`` (both transports)."""

    transfers: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0
    last_bytes: int = 0
    last_seconds: float = 0.0


class KVTransferEngine:
    """Gather/scatter of listed blocks over every layer's K and V, per worker.

    The caller owns the caches and the block ids: the sender's blocks must stay allocated
    until ``send_blocks`` returns, the receiver's are allocated before ``recv_blocks``; on
    a failure after the header was accepted the receiver's blocks hold garbage: free them.
    """

    def __init__(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 device: torch.device | str, heads: tuple[int, int] | None = None) -> None:
        """``heads``: move only KV heads ``[first, stop)`` of every block (a tensor-parallel rank's
        part of a resharded shipment); the header then checks that many heads."""
        if not kv_caches:
            raise ValueError("need at least one layer")
        self._sliced = heads is not None and tuple(heads) != (0, kv_caches[0][0].shape[2])
        if self._sliced:
            first, stop = heads  # type: ignore[misc]
            if not 0 <= first < stop <= kv_caches[0][0].shape[2]:
                raise ValueError(f"heads {heads} outside the cache's {kv_caches[0][0].shape[2]} KV heads")
            kv_caches = [(k[:, :, first:stop], v[:, :, first:stop]) for k, v in kv_caches]
        first = kv_caches[0][0]
        for k, v in kv_caches:
            if k.shape != first.shape or v.shape != first.shape or k.dtype != first.dtype or v.dtype != first.dtype:
                raise ValueError("every layer's K and V cache must share shape and dtype")
        if first.dim() != 4 or first.shape[1] != block_size or first.dtype not in _DTYPES:
            raise ValueError(f"cache {tuple(first.shape)} {first.dtype} is not [blocks, {block_size}, H, D]")
        self.kv_caches = list(kv_caches)
        self._stack = None if self._sliced else stacked(self.kv_caches)  # every layer at once, where the cache is one allocation
        self.block_size = block_size
        self.device = torch.device(device)
        self.num_blocks, _, self.num_kv_heads, self.head_dim = first.shape
        self.dtype = first.dtype
        self._stats = KVTransferStats()
        self._stats_lock = threading.Lock()

    @property
    def stats(self) -> KVTransferStats:
        with self._stats_lock:
            return dataclasses.replace(self._stats)

    def buffer_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one whole-request buffer: ``[layers, 2, N, block_size, H, D]``."""
        return (len(self.kv_caches), 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def send_blocks(self, group: PairGroup, block_ids: Sequence[int], *, transfer_id: int = 0,
                    per_layer: bool = False) -> int:
        """Prefill side: ship the listed blocks; blocks until decode acks. Returns bytes sent."""
        with self._recording() as rec, group.transfer() as seq:
            bad = self._check_ids(block_ids)
            # Bad ids still go through the handshake (as an impossible block count), so the
            # receiver fails at once instead of timing out and the group stays usable.
            count = -1 if bad else len(block_ids)
            group.send(self._header(seq, transfer_id, count, per_layer), _TAG_HEADER)
            verdict = self._scalar(0)
            group.recv(verdict, _TAG_VERDICT)
            if bad:
                raise KVTransferRejected(f"send_blocks: {bad}")
            if int(verdict.item()):
                raise KVTransferRejected(f"decode rejected transfer {transfer_id} (seq {seq}): "
                                         f"{_describe(int(verdict.item()))}")
            ids = self._index(block_ids)
            if per_layer and ids.numel():
                pending = None
                for k, v in self.kv_caches:
                    buf = self._gather_layer(k, v, ids)  # gathered while the previous layer sends
                    if pending is not None:
                        pending()
                    pending = group.isend(buf, _TAG_DATA)
                    rec.bytes += buf.nbytes
                pending()
            elif ids.numel():
                buf = self._gather_all(ids)
                group.send(buf, _TAG_DATA)
                rec.bytes += buf.nbytes
            ack = self._scalar(-1)
            group.recv(ack, _TAG_ACK)
            if int(ack.item()) != seq:
                raise KVTransferError(f"ack for seq {int(ack.item())}, expected {seq}")
        return rec.bytes

    def recv_blocks(self, group: PairGroup, block_ids: Sequence[int], *, transfer_id: int = 0) -> int:
        """Decode side: receive into the listed, already allocated blocks. A header that does
        not match (count, id, shape, dtype, seq) raises ``KVTransferRejected`` before any write."""
        with self._recording() as rec, group.transfer() as seq:
            header = torch.zeros(_PER_LAYER + 1, dtype=torch.int64, device=self.device)
            group.recv(header, _TAG_HEADER)
            got = header.tolist()
            expected = self._header(seq, transfer_id, len(block_ids), False).tolist()
            mask = sum(1 << i for i in range(_PER_LAYER) if got[i] != expected[i])
            bad = self._check_ids(block_ids)
            mask |= _BAD_IDS if bad else 0
            group.send(self._scalar(mask), _TAG_VERDICT)
            if mask:
                raise KVTransferRejected(f"transfer {transfer_id} (seq {seq}) rejected: "
                                         f"{_describe(mask)}{f' ({bad})' if bad else ''}")
            ids = self._index(block_ids)
            if got[_PER_LAYER] and ids.numel():
                buf = torch.empty(self.buffer_shape(ids.numel())[1:], dtype=self.dtype, device=self.device)
                for k, v in self.kv_caches:
                    group.recv(buf, _TAG_DATA)
                    self._scatter_layer(k, v, ids, buf)
                    rec.bytes += buf.nbytes
            elif ids.numel():
                buf = torch.empty(self.buffer_shape(ids.numel()), dtype=self.dtype, device=self.device)
                group.recv(buf, _TAG_DATA)
                self._scatter_all(ids, buf)
                rec.bytes += buf.nbytes
            group.send(self._scalar(seq), _TAG_ACK)
        return rec.bytes

    def pack_blocks(self, block_ids: Sequence[int]) -> np.ndarray:
        """Gather into a host numpy array ``buffer_shape(N)`` for the Ray object store; dtypes
        numpy lacks (bf16, fp8) travel as same-width integers and come back in ``unpack_blocks``."""
        with self._recording() as rec:
            bad = self._check_ids(block_ids)
            if bad:
                raise KVTransferError(f"pack_blocks: {bad}")
            buf = self._gather_all(self._index(block_ids)).cpu()
            if self.dtype not in _NUMPY:
                buf = buf.view(torch.int16 if buf.element_size() == 2 else torch.uint8)
            rec.bytes = buf.nbytes
            return buf.numpy()

    def unpack_blocks(self, block_ids: Sequence[int], array: np.ndarray) -> int:
        """Scatter a ``pack_blocks`` array into the listed blocks; a wrong shape or dtype raises
        ``KVTransferError`` before any write. ``array`` may be read-only (object store)."""
        with self._recording() as rec:
            bad = self._check_ids(block_ids)
            want_dtype = np.dtype(_NUMPY.get(self.dtype, np.int16 if self.dtype.itemsize == 2 else np.uint8))
            want_shape = self.buffer_shape(len(block_ids))
            if bad or array.dtype != want_dtype or tuple(array.shape) != want_shape:
                raise KVTransferError(f"unpack_blocks: got {array.dtype}{list(array.shape)}, expected "
                                      f"{want_dtype}{list(want_shape)} {bad or ''}".rstrip())
            with warnings.catch_warnings():
                # Object-store arrays are read-only; we only read from this view.
                warnings.simplefilter("ignore", UserWarning)
                buf = torch.from_numpy(array)
            buf = buf.view(self.dtype).to(self.device)
            ids = self._index(block_ids)
            for (k, v), layer in zip(self.kv_caches, buf):
                self._scatter_layer(k, v, ids, layer)
            rec.bytes = buf.nbytes
        return rec.bytes

    def copy_blocks_from(self, source: Sequence[tuple[torch.Tensor, torch.Tensor]], src_ids: Sequence[int],
                         dst_ids: Sequence[int]) -> int:
        """Same machine: copy blocks of a peer's mapped cache (``workers.kv.shared``) into the
        listed blocks of this one, layer by layer. A source that does not match this cache's
        layers, block shape or dtype, or bad ids, raise ``KVTransferRejected`` before any write."""
        with self._recording() as rec:
            first = source[0][0] if source else None
            if (first is None or len(source) != len(self.kv_caches) or first.dtype != self.dtype
                    or tuple(first.shape[1:]) != (self.block_size, self.num_kv_heads, self.head_dim)):
                got = "nothing" if first is None else f"{len(source)} x {first.dtype}{list(first.shape)}"
                want = [self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim]
                raise KVTransferRejected(f"copy_blocks_from: source cache {got} does not match "
                                         f"{len(self.kv_caches)} x {self.dtype}{want}")
            bad = self._check_ids(dst_ids)
            src_count = int(first.shape[0])
            if not bad and (len(src_ids) != len(dst_ids) or any(not 0 <= int(b) < src_count for b in src_ids)):
                bad = f"source ids {list(src_ids)} outside [0, {src_count}) or not one per destination"
            if bad:
                raise KVTransferRejected(f"copy_blocks_from: {bad}")
            if dst_ids:
                src, dst = self._index(src_ids), self._index(dst_ids)
                source_stack = stacked(list(source))
                if source_stack is not None and self._stack is not None and source_stack.device == self._stack.device:
                    with torch.inference_mode():  # two indexed copies for every layer at once
                        self._stack.index_copy_(1, dst, source_stack.index_select(1, src))
                else:
                    for (sk, sv), (k, v) in zip(source, self.kv_caches):
                        self._copy_layer(sk, k, src, dst)
                        self._copy_layer(sv, v, src, dst)
                if self.device.type == "cuda":  # the sender frees its blocks once we return
                    torch.cuda.synchronize(self.device)
                rec.bytes = 2 * len(self.kv_caches) * len(dst_ids) * self.kv_caches[0][0][0].nbytes
        return rec.bytes

    # -- helpers -------------------------------------------------------------------------

    @torch.inference_mode()
    def _copy_layer(self, source: torch.Tensor, cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        backend.scatter_kv_blocks(cache, dst, backend.gather_kv_blocks(source, src))

    def _check_ids(self, block_ids: Sequence[int]) -> str | None:
        ids = list(block_ids)
        if any(not 0 <= int(b) < self.num_blocks for b in ids):
            return f"block ids {ids} outside [0, {self.num_blocks})"
        if len(set(ids)) != len(ids):
            return f"duplicate block ids {ids}"
        return None

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor([int(b) for b in block_ids], dtype=torch.int64, device=self.device)

    def _scalar(self, value: int) -> torch.Tensor:
        return torch.tensor([value], dtype=torch.int64, device=self.device)

    def _header(self, seq: int, transfer_id: int, num_blocks: int, per_layer: bool) -> torch.Tensor:
        values = [_MAGIC, _VERSION, seq, transfer_id, num_blocks, len(self.kv_caches),
                  _DTYPES.index(self.dtype) + 1, self.block_size, self.num_kv_heads, self.head_dim,
                  int(per_layer)]
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    @torch.inference_mode()
    def _gather_layer(self, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self._sliced:  # strided head views: the kernels take whole contiguous blocks only
            return torch.stack((k.index_select(0, ids), v.index_select(0, ids)))
        return torch.stack((backend.gather_kv_blocks(k, ids), backend.gather_kv_blocks(v, ids)))

    @torch.inference_mode()
    def _gather_all(self, ids: torch.Tensor) -> torch.Tensor:
        if self._stack is not None:  # K0, V0, K1, ... is the buffer's [layers, 2] order
            return self._stack.index_select(1, ids).view(self.buffer_shape(ids.numel()))
        # One extra copy (gather, then stack) buys a single contiguous send.
        gather = (lambda c, i: c.index_select(0, i)) if self._sliced else backend.gather_kv_blocks
        parts = [gather(c, ids) for layer in self.kv_caches for c in layer]
        return torch.stack(parts).view(self.buffer_shape(ids.numel()))

    @torch.inference_mode()
    def _scatter_all(self, ids: torch.Tensor, buf: torch.Tensor) -> None:
        if self._stack is not None:
            self._stack.index_copy_(1, ids, buf.view((-1,) + tuple(buf.shape[2:])))
            return
        for (k, v), layer in zip(self.kv_caches, buf):
            self._scatter_layer(k, v, ids, layer)

    @torch.inference_mode()
    def _scatter_layer(self, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor, buf: torch.Tensor) -> None:
        if self._sliced:
            k.index_copy_(0, ids, buf[0])
            v.index_copy_(0, ids, buf[1])
            return
        backend.scatter_kv_blocks(k, ids, buf[0])
        backend.scatter_kv_blocks(v, ids, buf[1])

    def record_transfer(self, nbytes: int, seconds: float) -> None:
        """Count one finished transfer. The prefill side calls it for KV the decode side moved
        itself (the same-machine copy out of its mapped cache), so that both sides report every
        transfer, as they do on the collective path."""
        with self._stats_lock:
            s = self._stats
            s.transfers, s.bytes, s.seconds = s.transfers + 1, s.bytes + nbytes, s.seconds + seconds
            s.last_bytes, s.last_seconds = nbytes, seconds

    @contextlib.contextmanager
    def _recording(self) -> Iterator[KVTransferStats]:
        rec = KVTransferStats(transfers=1)
        start = time.perf_counter()
        try:
            yield rec
        except BaseException:
            with self._stats_lock:
                self._stats.failures += 1
            raise
        rec.seconds = time.perf_counter() - start
        self.record_transfer(rec.bytes, rec.seconds)


def _describe(mask: int) -> str:
    names = [name for i, name in enumerate(_FIELDS) if mask >> i & 1]
    if mask & _BAD_IDS:
        names.append("receiver block ids")
    return "mismatch in " + ", ".join(names)
