"""Low-precision logits to fp32, plus the entries whose order the output rounding may have changed.

A bf16 (fp16) matmul rounds each logit to 8 (11) mantissa bits: near 25 they land on a 0.125
grid and near-ties flip greedy choices. ``upcast_with_candidates`` returns the fp32 copy and the
``(rows, cols)`` within ``margin_ulps`` output ulps of each row's max, for the caller to
recompute exactly. On CPU, bf16 runs natively in one pass per row (``kernels.cpu_ops``).
"""

from __future__ import annotations

import torch
from baton_serve.kernels import backend, cpu_ops


def upcast_with_candidates_torch(logits: torch.Tensor, margin_ulps: float = 2.0
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch definition: fp32 logits ``[N, V]`` and the (rows, cols) of near-max entries."""
    out = logits.float()
    row_max = out.max(dim=-1, keepdim=True).values
    mantissa_bits = 8 if logits.dtype == torch.bfloat16 else 11
    ulp = torch.exp2(torch.floor(torch.log2(row_max.abs().clamp_min(1e-3))) - (mantissa_bits - 1))
    rows, cols = torch.nonzero(out >= row_max - margin_ulps * ulp, as_tuple=True)
    return out, rows, cols


def upcast_with_candidates(logits: torch.Tensor, margin_ulps: float = 2.0
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same result as ``upcast_with_candidates_torch``; native for bf16 CPU tensors."""
    if logits.is_cpu and backend.forced() != "torch":
        native = cpu_ops.logits_candidates(logits, margin_ulps)
        if native is not None:
            return native
    return upcast_with_candidates_torch(logits, margin_ulps)
