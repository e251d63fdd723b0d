"""int8 x int8 linear layers (W8A8): each row of activations is quantised to int8 on the fly and
multiplied with per-output-channel int8 weights in int32, then scaled back.

``kernels.quant_linear``'s int8 kernels widen the weights to fp32 and compute in fp32, so at many
rows they run at fp32 speed (an int8 checkpoint was no faster than fp32 at saturation). Here the
products are int8 dot products: ``torch._int_mm`` goes to oneDNN, which runs them as AVX512-VNNI /
AVX-VNNI ``vpdpbusd`` (AVX2 ``vpmaddubsw`` without VNNI) and AMX-INT8 tiles where the CPU has them.

Activations: symmetric per row, ``s = amax(|x|) / 127``, ``xq = clamp(round(x / s), -127, 127)``
(an all-zero row gets s = 1 and stays zero); ``out = (xq @ q^T) * s * scales + bias`` in fp32,
rounded once to x's dtype. The error against the weight-only result is the activation rounding:
at most ``s / 2`` per element, so a relative ``1 / 254`` of the row's largest value.
"""

from __future__ import annotations

import torch

_CHUNK_ELEMENTS = 1 << 20  # outputs per row block of a large call (4 MB of int32)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` as int8 ``[M, K]`` and the fp32 scale of each row ``[M]``."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(xf / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def pack(qweight: torch.Tensor) -> torch.Tensor:
    """An int8 ``[N, K]`` weight as the ``[K, N]`` operand ``torch._int_mm`` takes (a transposed
    view of a contiguous copy: oneDNN reads it as the column-major B of its GEMM)."""
    if qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise ValueError(f"W8A8 packs an int8 [N, K] weight, got {qweight.dtype} {tuple(qweight.shape)}")
    return qweight.contiguous().t()


def linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ (q * scales)^T + bias -> [..., N]`` in x's dtype, through int8 activations;
    ``packed`` from ``pack``, ``scales`` fp32 ``[N]`` (per output channel)."""
    k, n = packed.shape
    if x.shape[-1] != k:
        raise ValueError(f"linear: input has {x.shape[-1]} features, the weight takes {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return x.new_empty((*lead, n))
    xq, row_scale = quantize_rows(x2)
    m = x2.shape[0]
    rows = max(16, _CHUNK_ELEMENTS // n)
    if m <= rows:
        return _scaled(torch._int_mm(xq, packed), row_scale, scales, bias, x.dtype).view(*lead, n)
    # A prefill chunk's int32 and fp32 intermediates (tens of MB) are made and dropped per call;
    # row blocks keep them in cache (2048 x 3072 in bf16: 7.5 -> 5.3 ms on Zen 4)
    out = torch.empty((m, n), dtype=x.dtype)
    for i in range(0, m, rows):
        out[i:i + rows] = _scaled(torch._int_mm(xq[i:i + rows], packed), row_scale[i:i + rows], scales, bias,
                                  x.dtype)
    return out.view(*lead, n)


def _scaled(acc: torch.Tensor, row_scale: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
            dtype: torch.dtype) -> torch.Tensor:
    out = acc.float().mul_(row_scale.unsqueeze(-1)).mul_(scales)
    if bias is not None:
        out.add_(bias.float())
    return out.to(dtype)
