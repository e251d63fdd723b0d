"""Fused RMSNorm (optionally with the residual add) and SiLU-and-mul in Triton.

All math is fp32; each program owns one row (norms) or one row slice (SiLU), so rows never
need a cross-program reduction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from baton_serve.kernels.triton_common import check_device, next_pow2

_SILU_BLOCK = 1024


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    hidden, eps,
    stride_x, stride_r, stride_o, stride_ro,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, summed, mask=mask)
        # Normalise the rounded sum, exactly what a later unfused rms_norm(residual) would see.
        x = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / hidden + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (x * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last]`` with a unit-stride last dim (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {hidden}")
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    res_out = torch.empty(x.shape, dtype=out_dtype, device=x.device) if residual is not None else None
    if x2.shape[0] == 0 or hidden == 0:
        return out, res_out
    r2 = _rows(residual) if residual is not None else x2
    o2 = out.view(-1, hidden)
    ro2 = res_out.view(-1, hidden) if res_out is not None else o2
    block = next_pow2(hidden)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight.contiguous(), o2, ro2,
        hidden, float(eps),
        x2.stride(0), r2.stride(0), o2.stride(0), ro2.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as ``reference.rms_norm``."""
    check_device(_rms_norm_kernel, x, weight)
    return _launch_norm(x, None, weight, eps, x.dtype)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``reference.fused_add_rms_norm``: new tensors, inputs untouched."""
    check_device(_rms_norm_kernel, x, residual, weight)
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    out, new_residual = _launch_norm(x, residual, weight, eps, torch.result_type(x, residual))
    assert new_residual is not None
    return out, new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same contract as ``reference.silu_and_mul``."""
    check_device(_silu_and_mul_kernel, x)
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    x2 = _rows(x)
    if x2.shape[0] == 0 or inter == 0:
        return out
    o2 = out.view(-1, inter)
    block = min(_SILU_BLOCK, next_pow2(inter))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
        x2, o2, inter, x2.stride(0), o2.stride(0), BLOCK=block, num_warps=4,
    )
    return out
