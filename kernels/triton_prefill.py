"""Paged causal prefill attention in Triton for packed query chunks.

One program owns (sequence, kv head, query tile). Its tile rows are ``(query, head)`` pairs for
the ``GROUP = Hq // Hkv`` query heads sharing that kv head (row ``r`` is query ``r // GROUP``,
head ``r % GROUP``), so each K/V tile loaded from the paged cache serves the whole group. All
keys, including the chunk's own, are read from the cache: the chunk's K/V were written there
before the call (``write_kv_cache``), as in the reference contract.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from baton_serve.kernels.triton_common import (
    check_device,
    dot_dtype,
    dot_precision,
    last_dim_contiguous,
    next_pow2,
)

_LOG2E = 1.4426950408889634
_BLOCK_N = 64


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    scale_log2, window,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bts, stride_btb,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    QUERIES_PER_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    tile_q = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    first_q = tile_q * QUERIES_PER_TILE
    if first_q >= q_len:  # the grid is sized for the longest chunk
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    context = seq_len - q_len  # positions before this chunk

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    q_idx = first_q + offs_m // GROUP
    heads = kvh * GROUP + offs_m % GROUP
    row_valid = (offs_m < QUERIES_PER_TILE * GROUP) & (q_idx < q_len)
    q_pos = context + q_idx
    d_mask = offs_d < HEAD_DIM
    row_mask = row_valid[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + (q_start + q_idx).to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh
        + offs_d[None, :],
        mask=row_mask, other=0.0,
    ).to(DOT_DTYPE)

    last_q = tl.minimum(first_q + QUERIES_PER_TILE, q_len) - 1
    hi = context + last_q + 1  # causal: no row sees past the tile's last query
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(context + first_q - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bts
    for tile in range(lo, hi, BLOCK_N):
        pos = tile + offs_n
        valid = pos < hi
        block = tl.load(table_row + (pos // BLOCK_SIZE) * stride_btb, mask=valid, other=0).to(tl.int64)
        tok = pos % BLOCK_SIZE
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(
            k_cache_ptr + block[:, None] * stride_kb + tok[:, None] * stride_kt + kvh * stride_kh
            + offs_d[None, :],
            mask=kv_mask, other=0.0,
        ).to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        allowed = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (q_pos[:, None] - pos[None, :] < window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with no visible key yet (window start, padding rows) keep m = -inf safely.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + block[:, None] * stride_vb + tok[:, None] * stride_vt + kvh * stride_vh
            + offs_d[None, :],
            mask=kv_mask, other=0.0,
        ).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + (q_start + q_idx).to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh
        + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=row_mask,
    )


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
    """Same contract as ``reference.paged_prefill_attention``.

    Rows of ``query`` outside every ``[query_start_loc[s], query_start_loc[s+1])`` are left
    unwritten. Needs one host sync (the longest chunk sizes the grid).
    """
    total, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} not a multiple of kv heads {num_kv_heads}")
    check_device(_prefill_kernel, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_seqs = seq_lens.shape[0]
    if total == 0 or num_seqs == 0:
        return out
    query = last_dim_contiguous(query)
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache need a contiguous head dim")
    max_q_len = int((query_start_loc[1 : num_seqs + 1] - query_start_loc[:num_seqs]).max())
    if max_q_len <= 0:
        return out

    group = num_heads // num_kv_heads
    # 64 rows fill a tensor-core tile; bigger groups (MQA) need one row per head at least.
    block_m = max(64, next_pow2(group))
    queries_per_tile = block_m // group
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_q_len, queries_per_tile))
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        scale * _LOG2E, int(sliding_window) if sliding_window is not None else 0,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), block_tables.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        QUERIES_PER_TILE=queries_per_tile, BLOCK_M=block_m, BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_N=_BLOCK_N, HAS_WINDOW=sliding_window is not None,
        DOT_DTYPE=dot_dtype(_prefill_kernel, k_cache.dtype), DOT_PRECISION=dot_precision(k_cache.dtype),
        num_warps=4, num_stages=2,
    )
    return out
