"""Weight-only quantised linear layers (int8 per output channel or per group, int4 per group), native on CPU.

A decode step at one sequence reads every weight once per token: 538 MB of fp32 for SmolLM2-135M.
int8 weights cut that to a quarter, int4 to about an eighth, and the kernels in
``kernels/cpu/quant_linear.c`` widen them to fp32 in registers, so the fp32 weights never exist.
Activations stay fp32 or bf16, the math is fp32 and the output is rounded once to x's dtype.

Formats (fixed: checkpoints are converted to them), plain tensors so that layers can keep them as
parameters and narrow them along N (or, on group boundaries, K) for tensor parallelism:

* int8: ``qweight`` int8 ``[N, K]``, symmetric, ``q = clamp(round(w / scale), -127, 127)``, the
  scale ``amax(|w|) / 127`` over the values it covers (1.0 where they are all zero). Per output
  channel: ``scales`` fp32 ``[N]``, ``w[n, k] = qweight[n, k] * scales[n]``. Per group of ``g``
  in (32, 64, 128) along K (``K % g == 0``): ``scales`` fp32 ``[N, K / g]``,
  ``w[n, k] = qweight[n, k] * scales[n, k // g]``. The functions read the layout off the shape
  of ``scales``: 1-D is per channel, ``[N, G]`` is groups of ``K / G``.
* int4: group size ``g`` in (32, 64, 128), ``K % g == 0``; ``scales``, ``mins`` fp32 ``[N, K / g]``
  with ``scales = (max - min) / 15`` and ``mins = min`` over each group,
  ``q = clamp(round((w - min) / scale), 0, 15)``, ``w = q * scale + min``. A constant group has
  scale 0 and q 0, and dequantises exactly to its value. ``qweight`` uint8 ``[N, K / 2]``: each
  run of 32 consecutive k is 16 bytes, byte i holding ``q[i]`` in its low nibble and ``q[i + 16]``
  in its high nibble (llama.cpp's Q4 layout).

``linear_int8`` / ``linear_int4`` have the semantics of their ``*_reference`` functions below
(dequantise to fp32, ``F.linear`` in fp32 with the bias, round to x's dtype), which also run
whatever the native kernels do not take: no compiler, other devices or dtypes (fp16), weights
or scales whose rows are not contiguous, int8 scales ``[N, G]`` whose ``K / G`` is neither a
multiple of 32 nor K. Activations that are not contiguous are copied.

SmolLM2-135M's linear layers per forward (30 x q/k/v, o, gate/up, down + lm_head), 2-core Zen 3
(AVX2 + FMA), 2 threads, every call on weights not in cache, medians of 9 interleaved runs on a
shared machine (ms; "g=128|64": 128 for down_proj, K = 1536, and 64 where K = 576 allows no more):

    M       fp32 F.linear   int8 per channel   int8 g=32   int8 g=64   int8 g=128|64   int4 g=32
    1           38.9              7.5              8.6         7.7          7.1            7.2
    8           76.6             20.7             25.4        25.6         25.9           32.8
    32         116.9             61.7             67.5        62.2         61.9           68.3
    128        282.2            221.0            231.4       226.0        243.3          229.6
    512       1239.7           1119.3           1103.9      1109.5       1102.7         1160.0

Group-wise int8 reads 1/8 (g=32) or 1/16 (g=64) more bytes than per channel and multiplies each
weight vector by its scale in the dot tiles (few rows); the GEMM (many rows) folds the scales into
its dequantised panels, so from M = 32 the layouts run within ~10% of each other. Dequantising into an fp32
scratch weight and calling F.linear (MKL), the alternative for many rows, measured slower at every
M (int8 per channel, an earlier session: 222 / 388 / 1022 ms at M = 32 / 128 / 512 against 62 /
203 / 822 native): the native GEMM (kernels/cpu/quant_linear.c) runs at MKL's fp32 speed from
M ~ 100 and never writes or re-reads an fp32 weight, so no row count routes to it. int4 reads
fewer bytes than int8 but converts each weight with more instructions; on these two cores the two
come out close at M = 1, and int8 is faster at 8.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from baton_serve.kernels import cpu_ops
from baton_serve.kernels.deterministic import DeterministicModeError

__all__ = [
    "GROUP_SIZES", "dequantize_int4", "dequantize_int8", "linear_int4", "linear_int4_reference", "linear_int8",
    "linear_int8_reference", "pack_int4", "quantize_int4", "quantize_int8", "unpack_int4",
]

GROUP_SIZES = (32, 64, 128)
_DT = {torch.float32: 0, torch.bfloat16: 1}  # dtype codes of quant_linear.c


# --- quantisation (torch, deterministic) --------------------------------------------------------

def quantize_int8(w: torch.Tensor, group_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qweight int8 [N, K], scales fp32)`` of a ``[N, K]`` fp32 / bf16 weight, symmetric:
    ``group_size`` 0 (the default) scales each output channel (``scales [N]``), 32 / 64 / 128 each
    group of that many input features (``scales [N, K / group_size]``; ``K`` must be a multiple).
    ``|w - q * scale| <= scale / 2`` for the scale of each value."""
    if w.dim() != 2:
        raise ValueError(f"expected a [N, K] weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    if group_size not in (0, *GROUP_SIZES):
        raise ValueError(f"int8 group_size must be 0 (per output channel) or one of {GROUP_SIZES}, "
                         f"got {group_size}")
    if group_size:
        _check_groups(k, group_size)
    w = w.detach().float()
    groups = w.reshape(n, k // group_size, group_size) if group_size else w[:, None, :]  # [N, G, g]
    amax = groups.abs().amax(dim=-1) if groups.shape[-1] else torch.zeros(n, 1, device=w.device)
    scales = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(groups / scales[..., None]).clamp_(-127, 127).to(torch.int8).reshape(n, k)
    return q.contiguous(), (scales if group_size else scales[:, 0]).contiguous()


def _int8_groups(k: int, scales: torch.Tensor) -> int:
    """The group size of int8 ``scales`` over K input features: K for 1-D (per channel) scales,
    ``K / G`` for ``[N, G]`` ones."""
    if scales.dim() == 1:
        return k
    if scales.dim() != 2 or not scales.shape[1] or k % scales.shape[1]:
        raise ValueError(f"int8 scales of shape {tuple(scales.shape)} do not divide K = {k} into groups")
    return k // scales.shape[1]


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``qweight * scales`` in fp32 (``scales [N]`` per channel, ``[N, G]`` per group of ``K / G``),
    then cast to ``dtype``: ``[N, K]``."""
    n, k = qweight.shape
    g = _int8_groups(k, scales)
    if scales.dim() == 1:
        return (qweight.float() * scales.float()[:, None]).to(dtype)
    w = qweight.float().reshape(n, k // g, g) * scales.float()[..., None]
    return w.reshape(n, k).to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K / 2]`` of 4-bit values ``q`` ``[N, K]`` (0..15, ``K % 32 == 0``): per run of 32
    values, byte i = ``q[i] | q[i + 16] << 4``."""
    n, k = q.shape
    if k % 32:
        raise ValueError(f"K = {k} is not a multiple of 32")
    runs = q.to(torch.uint8).reshape(n, k // 32, 2, 16)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """The uint8 ``[N, K]`` values (0..15) that ``pack_int4`` packed into ``qweight`` ``[N, K / 2]``."""
    n, half = qweight.shape
    runs = qweight.reshape(n, half // 16, 1, 16)
    return torch.cat([runs & 15, runs >> 4], dim=2).reshape(n, half * 2)


def _check_groups(k: int, group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    if k % group_size:
        raise ValueError(f"K = {k} is not a multiple of the group size {group_size}")


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(qweight uint8 [N, K / 2], scales fp32 [N, K / g], mins fp32 [N, K / g])`` of a ``[N, K]``
    fp32 / bf16 weight: asymmetric per group of ``group_size`` along K,
    ``|w - (q * scale + min)| <= scale / 2``."""
    if w.dim() != 2:
        raise ValueError(f"expected a [N, K] weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    _check_groups(k, group_size)
    groups = w.detach().float().reshape(n, k // group_size, group_size)
    mins = groups.amin(dim=-1)
    scales = (groups.amax(dim=-1) - mins) / 15
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))  # constant groups: w - min = 0, q = 0
    q = torch.round((groups - mins[..., None]) / divisor[..., None]).clamp_(0, 15)
    return pack_int4(q.reshape(n, k)), scales.contiguous(), mins.contiguous()


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale + min`` per group in fp32, then cast to ``dtype``: ``[N, K]``."""
    q = unpack_int4(qweight).float()
    n, k = q.shape
    _check_groups(k, group_size)
    w = q.reshape(n, k // group_size, group_size) * scales.float()[..., None] + mins.float()[..., None]
    return w.reshape(n, k).to(dtype)


# --- linear layers ------------------------------------------------------------------------------

def _finish(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)


def linear_int8_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize_int8(qweight, scales).T + bias`` in fp32, rounded to ``x.dtype``."""
    return _finish(x, dequantize_int8(qweight, scales).to(x.device), bias)


def linear_int4_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                          group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize_int4(qweight, scales, mins, group_size).T + bias`` in fp32, rounded to ``x.dtype``."""
    return _finish(x, dequantize_int4(qweight, scales, mins, group_size).to(x.device), bias)


# The wrappers run a few hundred times per forward, at a few microseconds of work each at decode:
# the checks use the cheapest tensor queries (about 4 us on top of the ctypes call).

def _row_stride(t: torch.Tensor, n: int, width: int) -> int:
    """The row stride of a CPU ``t`` of shape ``[n, width]`` whose rows are contiguous (it may be a
    view narrowed along either dim), or 0 when the kernels cannot read it that way."""
    shape = t.shape
    if len(shape) != 2 or shape[0] != n or shape[1] != width or not width or not t.is_cpu:
        return 0
    s0, s1 = t.stride()
    if n == 1:
        return width
    return s0 if s1 == 1 and s0 >= width else 0


def _native_io(x: torch.Tensor, n: int, bias: torch.Tensor | None):
    """(library, dtype code, contiguous x, rows, out) when x and bias are what the kernels take,
    else None."""
    dt = _DT.get(x.dtype)
    if dt is None or not x.is_cpu:
        return None
    if bias is not None and (bias.dtype != x.dtype or not bias.is_cpu or bias.shape != (n,)
                             or not bias.is_contiguous()):
        return None
    numel = x.numel()
    lib = cpu_ops.library() if numel else None
    if lib is None:
        return None
    m = numel // x.shape[-1]
    out = torch.empty(m, n, dtype=x.dtype)  # ints: a third of the cost of a shape tuple
    return lib, dt, x.contiguous(), m, out if x.dim() == 2 else out.view(*x.shape[:-1], n)


def _int8_native_scales(scales: torch.Tensor, n: int, k: int) -> tuple[int, int]:
    """(group size, row stride) of fp32 CPU int8 scales the kernels read: 1-D contiguous ``[N]``
    (group size K, stride 1), or ``[N, G]`` with contiguous rows (a view narrowed along either
    dim) and ``K / G`` a multiple of 32 or K itself; else (0, 0)."""
    if scales.dtype != torch.float32 or not scales.is_cpu:
        return 0, 0
    shape = scales.shape
    if len(shape) == 1:
        return (k, 1) if shape[0] == n and scales.is_contiguous() else (0, 0)
    if len(shape) != 2 or not shape[1] or k % shape[1]:
        return 0, 0
    g = k // shape[1]
    lds = _row_stride(scales, n, shape[1]) if g == k or not g % 32 else 0
    return (g, lds) if lds else (0, 0)


def linear_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None, invariant: bool = False) -> torch.Tensor:
    """``x [..., K] @ dequantize_int8(qweight, scales).T + bias -> [..., N]`` in x's dtype (scales
    ``[N]`` per channel or ``[N, G]`` per group); same semantics as ``linear_int8_reference``.
    ``invariant``: a row's result does not depend on the other rows (the deterministic mode; raises
    ``DeterministicModeError`` where only the reference could run it)."""
    shape = qweight.shape
    if qweight.dtype == torch.int8 and len(shape) == 2 and x.dim() and x.shape[-1] == shape[1]:
        n, k = shape
        ldq = _row_stride(qweight, n, k)
        g, lds = _int8_native_scales(scales, n, k) if ldq else (0, 0)
        io = _native_io(x, n, bias) if lds else None
        if io is not None:
            lib, dt, xc, m, out = io
            if not lib.baton_linear_int8(xc.data_ptr(), qweight.data_ptr(), scales.data_ptr(),
                                         None if bias is None else bias.data_ptr(), out.data_ptr(), m, n, k, g,
                                         ldq, lds, dt, torch.get_num_threads(), int(invariant)):
                return out
    _no_invariant_reference(invariant, "int8", x)
    return linear_int8_reference(x, qweight, scales, bias)


def linear_int4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                group_size: int, bias: torch.Tensor | None = None, invariant: bool = False) -> torch.Tensor:
    """``x [..., K] @ dequantize_int4(qweight, scales, mins, group_size).T + bias -> [..., N]`` in
    x's dtype; same semantics as ``linear_int4_reference``; ``invariant`` as for ``linear_int8``."""
    shape = qweight.shape
    if (qweight.dtype == torch.uint8 and len(shape) == 2 and group_size in GROUP_SIZES and x.dim()
            and x.shape[-1] == 2 * shape[1] and not x.shape[-1] % group_size):
        n, k = shape[0], 2 * shape[1]
        groups = k // group_size
        ldq, lds = _row_stride(qweight, n, k // 2), _row_stride(scales, n, groups)
        io = _native_io(x, n, bias) if ldq and lds else None
        if (io is not None and scales.dtype == torch.float32 and mins.dtype == torch.float32
                and _row_stride(mins, n, groups) == lds):
            lib, dt, xc, m, out = io
            if not lib.baton_linear_int4(xc.data_ptr(), qweight.data_ptr(), scales.data_ptr(), mins.data_ptr(),
                                         None if bias is None else bias.data_ptr(), out.data_ptr(), m, n, k,
                                         group_size, ldq, lds, dt, torch.get_num_threads(), int(invariant)):
                return out
    _no_invariant_reference(invariant, "int4", x)
    return linear_int4_reference(x, qweight, scales, mins, group_size, bias)


def _no_invariant_reference(invariant: bool, method: str, x: torch.Tensor) -> None:
    # The reference is F.linear on the dequantised weight: its blocking follows the batch.
    if invariant and x.numel():
        raise DeterministicModeError(f"deterministic mode: no native {method} kernel runs this call "
                                     f"(x {x.dtype} {tuple(x.shape)} on {x.device})")
