"""Triton kernels that move K/V between tokens, paged cache blocks and contiguous buffers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from baton_serve.kernels.triton_common import check_device, last_dim_contiguous, next_pow2

# Elements per program for whole-block copies: 4 KiB-16 KiB per program is enough to hide latency.
_COPY_BLOCK = 2048
# Upper bound on a write_kv_cache tile (heads x head dim) so big models don't spill registers.
_WRITE_TILE = 4096


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    num_kv_heads, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    block = slot // block_size
    offset = slot % block_size
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM)
    src = token.to(tl.int64)
    k = tl.load(key_ptr + src * stride_kt + heads[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + src * stride_vt + heads[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(
        k_cache_ptr + block * stride_kcb + offset * stride_kct + heads[:, None] * stride_kch
        + offs_d[None, :],
        k.to(k_cache_ptr.dtype.element_ty), mask=mask,
    )
    tl.store(
        v_cache_ptr + block * stride_vcb + offset * stride_vct + heads[:, None] * stride_vch
        + offs_d[None, :],
        v.to(v_cache_ptr.dtype.element_ty), mask=mask,
    )


@triton.jit
def _copy_blocks_kernel(
    src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr,
    stride_src_block, stride_dst_block, block_numel,
    HAS_SRC_IDS: tl.constexpr, HAS_DST_IDS: tl.constexpr, BLOCK: tl.constexpr,
):
    # Each cache block is a dense run of block_numel elements (checked by the launchers).
    i = tl.program_id(0)
    src_block = i.to(tl.int64)
    dst_block = i.to(tl.int64)
    if HAS_SRC_IDS:
        src_block = tl.load(src_ids_ptr + i).to(tl.int64)
    if HAS_DST_IDS:
        dst_block = tl.load(dst_ids_ptr + i).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    x = tl.load(src_ptr + src_block * stride_src_block + offs, mask=mask)
    tl.store(dst_ptr + dst_block * stride_dst_block + offs, x.to(dst_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as ``reference.write_kv_cache``; slots must be distinct (else any one wins)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    check_device(_write_kv_kernel, key, value, k_cache, v_cache, slot_mapping)
    if num_tokens == 0:
        return
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache need a contiguous head dim")
    key, value = last_dim_contiguous(key), last_dim_contiguous(value)
    block_d = next_pow2(head_dim)
    block_h = min(next_pow2(num_kv_heads), max(1, _WRITE_TILE // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _write_kv_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping,
        num_kv_heads, k_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4,
    )


def _dense_blocks(t: torch.Tensor) -> bool:
    """True when every ``t[i]`` is one dense run of memory (any stride between blocks)."""
    return t[0].is_contiguous() if t.shape[0] else True


def _launch_copy(
    src: torch.Tensor, dst: torch.Tensor, num: int,
    src_ids: torch.Tensor | None, dst_ids: torch.Tensor | None,
) -> None:
    if num == 0:
        return
    if not (_dense_blocks(src) and _dense_blocks(dst)):
        raise ValueError("block copies need each cache block to be contiguous in memory")
    block_numel = src[0].numel()
    grid = (num, triton.cdiv(block_numel, _COPY_BLOCK))
    _copy_blocks_kernel[grid](
        src, dst,
        src_ids if src_ids is not None else src, dst_ids if dst_ids is not None else dst,
        src.stride(0), dst.stride(0), block_numel,
        HAS_SRC_IDS=src_ids is not None, HAS_DST_IDS=dst_ids is not None,
        BLOCK=min(_COPY_BLOCK, next_pow2(block_numel)),
        num_warps=4,
    )


def gather_kv_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Same contract as ``reference.gather_kv_blocks``."""
    check_device(_copy_blocks_kernel, cache, block_ids)
    out = torch.empty((block_ids.shape[0], *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
    _launch_copy(cache, out, block_ids.shape[0], block_ids, None)
    return out


def scatter_kv_blocks(cache: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor) -> None:
    """Same contract as ``reference.scatter_kv_blocks``; ``block_ids`` must be distinct."""
    check_device(_copy_blocks_kernel, cache, block_ids, buffer)
    if buffer.shape[1:] != cache.shape[1:] or buffer.shape[0] != block_ids.shape[0]:
        raise ValueError(f"buffer {tuple(buffer.shape)} does not match cache blocks {tuple(cache.shape)}")
    _launch_copy(buffer, cache, block_ids.shape[0], None, block_ids)


def copy_blocks(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Same contract as ``reference.copy_blocks``.

    Blocks are copied in parallel, so no ``dst`` block may also appear in ``src`` (true for
    copy-on-write, whose destinations are fresh) and ``dst`` must be distinct.
    """
    check_device(_copy_blocks_kernel, cache, src, dst)
    if src.shape != dst.shape:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} differ")
    _launch_copy(cache, cache, src.shape[0], src, dst)
