"""Rotary position embedding (neox and GPT-J layouts, partial rotary dims) in Triton.

One program owns one token and rotates all its query and key heads with a single cos/sin row.
Results go to new tensors, like the reference; dims past ``rot_dim`` are copied through.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from baton_serve.kernels.triton_common import check_device, last_dim_contiguous, next_pow2


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, cos, sin, token, num_heads,
    stride_xt, stride_xh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    h_mask = heads < num_heads
    mask = h_mask[:, None] & (offs[None, :] < HALF)
    if IS_NEOX:  # pairs (i, i + half): the two halves of the rotated dims
        first = offs
        second = offs + HALF
    else:  # pairs (2i, 2i + 1): adjacent dims
        first = offs * 2
        second = offs * 2 + 1
    src = x_ptr + token * stride_xt + heads[:, None] * stride_xh
    dst = out_ptr + token * stride_ot + heads[:, None] * stride_oh
    x1 = tl.load(src + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + second[None, :], mask=mask, other=0.0).to(tl.float32)
    out_dtype = out_ptr.dtype.element_ty
    tl.store(dst + first[None, :], (x1 * cos[None, :] - x2 * sin[None, :]).to(out_dtype), mask=mask)
    tl.store(dst + second[None, :], (x2 * cos[None, :] + x1 * sin[None, :]).to(out_dtype), mask=mask)
    if BLOCK_PASS > 0:
        rest = 2 * HALF + tl.arange(0, BLOCK_PASS)
        rest_mask = h_mask[:, None] & (rest[None, :] < HEAD_DIM)
        tl.store(dst + rest[None, :], tl.load(src + rest[None, :], mask=rest_mask), mask=rest_mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cos_sin_ptr, q_out_ptr, k_out_ptr,
    num_q_heads, num_k_heads,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + pos * stride_cs
    cos = tl.load(row + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, cos, sin, token, num_q_heads,
                  stride_qt, stride_qh, stride_qot, stride_qoh,
                  HEAD_DIM, HALF, IS_NEOX, BLOCK_HQ, BLOCK_HALF, BLOCK_PASS)
    _rotate_heads(k_ptr, k_out_ptr, cos, sin, token, num_k_heads,
                  stride_kt, stride_kh, stride_kot, stride_koh,
                  HEAD_DIM, HALF, IS_NEOX, BLOCK_HK, BLOCK_HALF, BLOCK_PASS)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``reference.rotary_embedding``; positions index ``cos_sin_cache`` rows."""
    check_device(_rotary_kernel, positions, query, key, cos_sin_cache)
    num_tokens, num_q_heads, head_dim = query.shape
    num_k_heads = key.shape[1]
    rot_dim = cos_sin_cache.shape[-1]
    if rot_dim % 2 or rot_dim > head_dim or key.shape[2] != head_dim:
        raise ValueError(f"rot_dim {rot_dim} must be even and <= head dim {head_dim} of query and key")
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out
    query, key = last_dim_contiguous(query), last_dim_contiguous(key)
    cos_sin_cache = last_dim_contiguous(cos_sin_cache)
    half = rot_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, query, key, cos_sin_cache, q_out, k_out,
        num_q_heads, num_k_heads,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
        HEAD_DIM=head_dim, HALF=half, IS_NEOX=bool(is_neox),
        BLOCK_HQ=next_pow2(num_q_heads), BLOCK_HK=next_pow2(num_k_heads),
        BLOCK_HALF=next_pow2(half),
        BLOCK_PASS=next_pow2(head_dim - rot_dim) if head_dim > rot_dim else 0,
        num_warps=4,
    )
    return q_out, k_out
