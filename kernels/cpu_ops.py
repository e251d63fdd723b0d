"""Native CPU kernels (C + OpenMP, loaded with ctypes), built once per machine with the system
compiler. The torch reference stays the ground truth; when no compiler is available, or an input
is outside what a kernel handles (dtype, layout, shape), the call goes to the reference.

Decode attention dominates a CPU decode step at batch sizes that matter (the KV read is several
times the weights): the reference gathers every sequence's blocks into a padded copy, this kernel
reads each K/V row once, in place, and skips the padding. Prefill attention over fp32 and bf16
caches is a flash kernel (AVX512_BF16 q.k products for bf16 where the CPU has them, fp32 8-lane
vectors everywhere else): on AVX2 at GQA, D = 64, ~2-2.5x torch's CPU SDPA for fresh prompts of a
few hundred tokens and ~1.4x for a chunk after a long cached context, where SDPA itself runs at
about half the FMA peak. The element-wise ops (RMSNorm, RoPE, SiLU-and-mul) are each one pass
over the data instead of a chain of small torch ops.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path

import torch
from baton_serve.kernels import capabilities, cpu_build, reference
from baton_serve.kernels.cpu_build import KernelBuildError, UnsupportedTarget, isa

__all__ = ["KernelBuildError", "UnsupportedTarget", "available", "build_library", "isa", "library"]

log = logging.getLogger("baton.kernels")
_SOURCES = tuple(Path(__file__).with_name("cpu") / name for name in ("paged_attention.c", "prefill_attention.c",
                                                                     "elementwise.c", "build_info.c",
                                                                     "quant_linear.c", "invariant_linear.c"))
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {  # name: (restype, argtypes)
    "paged_decode_bf16": (_I, [_P] * 6 + [_I] * 6 + [_F, _I, _I, _I]),
    "paged_decode_f32": (_I, [_P] * 6 + [_I] * 6 + [_F, _I, _I, _I]),
    "paged_prefill_bf16": (_I, [_P] * 7 + [_I] * 6 + [_F, _I, _I]),
    "paged_prefill_f32": (_I, [_P] * 7 + [_I] * 6 + [_F, _I, _I]),
    "baton_rms_norm": (_I, [_P] * 5 + [_I64, _I, _I, _I, _F, _I]),
    "baton_rope_neox": (_I, [_P] * 6 + [_I64, _I, _I, _I, _I64, _I64, _I64, _I, _I]),
    "baton_silu_and_mul": (None, [_P, _P, _I64, _I, _I, _I]),
    "baton_logits_candidates": (_I, [_P] * 4 + [_I64, _I64, _I64, _F, _I]),
    "baton_write_kv": (_I, [_P] * 5 + [_I64] * 5 + [_I, _I]),
    "baton_argmax_f32": (None, [_P, _P, _I64, _I64, _I64, _I]),
    "baton_linear_int8": (_I, [_P] * 5 + [_I64] * 6 + [_I, _I, _I]),
    "baton_linear_int4": (_I, [_P] * 6 + [_I64] * 6 + [_I, _I, _I]),
    "baton_linear_invariant": (_I, [_P] * 4 + [_I64] * 4 + [_I] * 3),
}
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed = False
_built: dict[str, ctypes.CDLL] = {}


def build_library(target: str | None = None) -> ctypes.CDLL:
    """The kernels built for ``-march=target`` (default: ``capabilities.kernel_target()``), once per
    process; raises ``UnsupportedTarget`` or ``KernelBuildError`` (see ``kernels.cpu_build``)."""
    target = target or capabilities.kernel_target()
    with _lock:
        if target not in _built:
            _built[target] = cpu_build.build(_SOURCES, _SIGNATURES, target)
        return _built[target]


def library() -> ctypes.CDLL | None:
    """The compiled kernels for this CPU, building them on first use; None when that is not possible here."""
    global _lib, _failed
    if _lib is None and not _failed:
        try:
            lib = build_library()  # concurrent first callers wait in there for one build
        except (KernelBuildError, UnsupportedTarget) as exc:  # fall back to the reference
            _failed = True
            log.warning("native CPU kernels unavailable, using the torch reference: %s", exc)
            return None
        _lib = lib
    return _lib


def describe() -> str:
    """Which native kernels this process runs, for the start-up log line."""
    lib = library()
    if lib is None:
        return "native kernels unavailable (torch reference)"
    return f"kernels -march={capabilities.kernel_target()} ({isa(lib) or 'portable, no vector extensions'})"


def available() -> bool:
    return library() is not None


_KERNELS = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}
_DT = {torch.float32: 0, torch.bfloat16: 1}  # dtype codes of elementwise.c


def supports(k_cache: torch.Tensor) -> bool:
    return (k_cache.device.type == "cpu" and k_cache.dtype in _KERNELS and k_cache.is_contiguous()
            and k_cache.shape[1] <= 128 and k_cache.shape[3] <= 256 and available())


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    split_keys: int | None = None,
) -> torch.Tensor:
    """Same contract as ``kernels.reference.paged_decode_attention``; fp32 accumulation (one pass
    over the keys: ``num_splits`` and ``split_keys`` are ignored)."""
    num_seqs, hq, d = query.shape
    hkv = k_cache.shape[2]
    if not supports(k_cache) or hq % hkv or hq // hkv > 16 or num_seqs == 0:
        return reference.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale,
                                                sliding_window, max_seq_len, num_splits)
    lib = library()
    # bf16 queries go in and come out as they are (the kernel widens and rounds); anything else
    # is rounded to the cache dtype, as the reference does, and passed as fp32.
    io_bf16 = query.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16
    q = query.contiguous() if io_bf16 else query.to(k_cache.dtype).float().contiguous()
    tables = block_tables.to(torch.int32).contiguous()  # both no-ops when they already are
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty((num_seqs, hq, d), dtype=torch.bfloat16 if io_bf16 else torch.float32)
    if getattr(lib, _KERNELS[k_cache.dtype])(
            q.data_ptr(), k_cache.data_ptr(), v_cache.contiguous().data_ptr(), tables.data_ptr(),
            lens.data_ptr(), out.data_ptr(), num_seqs, hq, hkv, d, k_cache.shape[1], tables.shape[1],
            float(scale), int(sliding_window or 0), torch.get_num_threads(), int(io_bf16)):
        return reference.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale,
                                                sliding_window, max_seq_len, num_splits)
    return out if io_bf16 else out.to(query.dtype)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Same contract as ``kernels.reference.paged_prefill_attention``: fp32 and bf16 caches with
    ``D % 8 == 0`` run the native flash kernel (fp32 softmax and accumulation); anything else
    (fp16, other head dims, non-contiguous caches), the reference. Output dtype = query dtype."""
    total, hq, d = query.shape
    hkv = k_cache.shape[2]
    kernel = {torch.bfloat16: "paged_prefill_bf16", torch.float32: "paged_prefill_f32"}.get(k_cache.dtype)
    if (total and kernel and supports(k_cache) and not hq % hkv and not d % 8 and v_cache.dtype == k_cache.dtype
            and v_cache.is_contiguous()):
        q = query.to(k_cache.dtype).contiguous()  # rounded to the cache dtype, as the reference does
        tables = block_tables.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        starts = query_start_loc.to(torch.int32).contiguous()
        out = torch.empty((total, hq, d), dtype=torch.float32)
        # nonzero only for shapes the checks above already exclude, or when out of memory
        if not getattr(library(), kernel)(
                q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                starts.data_ptr(), out.data_ptr(), lens.shape[0], hq, hkv, d, k_cache.shape[1],
                tables.shape[1], float(scale), int(sliding_window or 0), torch.get_num_threads()):
            return out.to(query.dtype)
    return reference.paged_prefill_attention(query, k_cache, v_cache, block_tables, seq_lens,
                                             query_start_loc, scale, sliding_window)


_MAX_CANDIDATES = 64  # per row; real logits have a handful near the max, ties beyond this use the reference


def logits_candidates(logits: torch.Tensor, margin_ulps: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``kernels.logits.upcast_with_candidates`` for bf16 ``[N, V]`` in one native pass per row
    (instead of four torch passes over the vocabulary); None when it cannot run here."""
    lib = _elementwise_lib(logits) if logits.dtype == torch.bfloat16 and logits.dim() == 2 else None
    if lib is None:
        return None
    n, v = logits.shape
    out = torch.empty((n, v), dtype=torch.float32)
    cand = torch.empty((n, _MAX_CANDIDATES), dtype=torch.int32)
    counts = torch.empty(n, dtype=torch.int32)
    if lib.baton_logits_candidates(logits.data_ptr(), out.data_ptr(), cand.data_ptr(), counts.data_ptr(),
                                   n, v, _MAX_CANDIDATES, float(margin_ulps), torch.get_num_threads()):
        return None  # a row with more near-ties than _MAX_CANDIDATES
    counts = counts.long()
    keep = torch.arange(_MAX_CANDIDATES) < counts[:, None]
    return out, torch.repeat_interleave(torch.arange(n), counts), cand[keep].long()


def _elementwise_lib(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The library when every tensor is a non-empty contiguous fp32/bf16 CPU tensor, else None.
    (These wrappers run hundreds of times per forward: checks use the cheapest tensor queries.)"""
    for t in tensors:
        if not t.is_cpu or t.dtype not in _DT or not t.is_contiguous() or t.numel() == 0:
            return None
    return library()


def _rows(x: torch.Tensor, weight: torch.Tensor) -> int:
    """Number of rows of ``x [..., H]`` for a ``weight [H]``; 0 when the shapes do not fit."""
    if weight.dim() != 1 or x.dim() == 0 or x.shape[-1] != weight.shape[0]:
        return 0
    return x.numel() // weight.shape[0]


def _token_rows(x: torch.Tensor) -> bool:
    """``[T, H, D]`` with each token's ``H * D`` elements contiguous (rows may be strided)."""
    return x.dim() == 3 and x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2])


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as ``kernels.reference.write_kv_cache``: one native pass of row copies, with
    no mask, gather or dtype-conversion ops around it (those cost more than the copy at decode)."""
    lib = _elementwise_lib(k_cache, v_cache)
    if (lib is not None and key.dtype == value.dtype == k_cache.dtype == v_cache.dtype
            and k_cache.shape == v_cache.shape and _token_rows(key) and _token_rows(value)
            and key.shape == value.shape and key.shape[1:] == k_cache.shape[2:] and key.is_cpu and value.is_cpu
            and slot_mapping.is_cpu and slot_mapping.dim() == 1 and slot_mapping.shape[0] == key.shape[0]):
        slots = slot_mapping.to(torch.int64).contiguous()
        t = key.shape[0]
        nslots = k_cache.shape[0] * k_cache.shape[1]
        # nonzero: a slot past the cache, left to the reference to raise its indexing error
        if t == 0 or not lib.baton_write_kv(key.data_ptr(), value.data_ptr(), k_cache.data_ptr(),
                                            v_cache.data_ptr(), slots.data_ptr(), t, key.shape[1] * key.shape[2],
                                            key.stride(0), value.stride(0), nslots, _DT[key.dtype],
                                            torch.get_num_threads()):
            return
    reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Same contract as ``kernels.reference.argmax_rows``; fp32 rows natively (torch's CPU argmax is
    a scalar loop, ~15x slower than a vector max over a 49k vocabulary)."""
    if (x.dim() == 2 and x.dtype == torch.float32 and x.is_cpu and x.stride(1) == 1 and x.shape[1]
            and x.shape[0] and (x.shape[0] == 1 or x.stride(0) >= x.shape[1])):
        lib = library()
        if lib is not None:
            out = torch.empty(x.shape[0], dtype=torch.int64)
            lib.baton_argmax_f32(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
                                 torch.get_num_threads())
            return out
    return reference.argmax_rows(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as ``kernels.reference.rms_norm``."""
    lib = _elementwise_lib(x, weight)
    rows = _rows(x, weight) if lib is not None else 0
    if rows:
        out = torch.empty_like(x)
        if not lib.baton_rms_norm(x.data_ptr(), None, out.data_ptr(), None, weight.data_ptr(), rows,
                                  weight.shape[0], _DT[x.dtype], _DT[weight.dtype], eps,
                                  torch.get_num_threads()):
            return out
    return reference.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``kernels.reference.fused_add_rms_norm``: ``x + residual`` is rounded to
    the input dtype (the returned residual) before it is normalised."""
    lib = _elementwise_lib(x, residual, weight)
    ok = lib is not None and x.dtype == residual.dtype and x.shape == residual.shape
    rows = _rows(x, weight) if ok else 0
    if rows:
        out, new_residual = torch.empty_like(x), torch.empty_like(x)
        if not lib.baton_rms_norm(x.data_ptr(), residual.data_ptr(), out.data_ptr(), new_residual.data_ptr(),
                                  weight.data_ptr(), rows, weight.shape[0], _DT[x.dtype], _DT[weight.dtype],
                                  eps, torch.get_num_threads()):
            return out, new_residual
    return reference.fused_add_rms_norm(x, residual, weight, eps)


def _rope_shape(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                table: torch.Tensor) -> tuple[int, int, int, int] | None:
    """``(T, Hq, Hkv, D)`` when the native RoPE handles these inputs: ``[T, H, D]`` q/k of one
    dtype whose heads are contiguous (rows may be strided: views into a fused QKV output), a table
    covering the full head dim, 1-D integer positions."""
    if query.dim() != 3 or key.dim() != 3 or positions.dim() != 1 or table.dim() != 2:
        return None
    t, hq, d = query.shape
    _, hkv, _ = key.shape
    if (key.shape[0] != t or key.shape[2] != d or table.shape[1] != d or d % 2 or positions.shape[0] != t
            or query.dtype != key.dtype or table.dtype != torch.float32 or not positions.is_cpu
            or positions.dtype not in (torch.int64, torch.int32) or not query.is_cpu or not key.is_cpu
            or query.stride(2) != 1 or key.stride(2) != 1 or (hq > 1 and query.stride(1) != d)
            or (hkv > 1 and key.stride(1) != d)):
        return None
    return t, hq, hkv, d


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``kernels.reference.rotary_embedding``; Neox layout over the full head
    dim natively, the GPT-J layout and partial rotary dims through the reference."""
    lib = _elementwise_lib(cos_sin_cache) if is_neox and query.dtype in _DT else None
    shape = _rope_shape(positions, query, key, cos_sin_cache) if lib is not None else None
    if shape is not None and shape[0]:
        t, hq, hkv, d = shape
        pos = positions if positions.dtype == torch.int64 and positions.is_contiguous() else (
            positions.to(torch.int64).contiguous())
        q_out = torch.empty((t, hq, d), dtype=query.dtype)
        k_out = torch.empty((t, hkv, d), dtype=key.dtype)
        # nonzero: a position outside the table, left to the reference to raise its indexing error
        if not lib.baton_rope_neox(pos.data_ptr(), query.data_ptr(), key.data_ptr(), q_out.data_ptr(),
                                   k_out.data_ptr(), cos_sin_cache.data_ptr(), t, hq, hkv, d, query.stride(0),
                                   key.stride(0), cos_sin_cache.shape[0], _DT[query.dtype],
                                   torch.get_num_threads()):
            return q_out, k_out
    return reference.rotary_embedding(positions, query, key, cos_sin_cache, is_neox)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same contract as ``kernels.reference.silu_and_mul``; bf16 rounds ``silu(a)`` before the
    multiply, as the reference's two bf16 ops do."""
    lib = _elementwise_lib(x)
    if lib is None or x.dim() == 0 or x.shape[-1] % 2:
        return reference.silu_and_mul(x)
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype)
    lib.baton_silu_and_mul(x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], inter, _DT[x.dtype],
                           torch.get_num_threads())
    return out
