"""Paged decode attention in Triton: one query token per sequence.

One program owns (sequence, kv head, split) and computes all ``Hq // Hkv`` query heads that
share the kv head as the rows of one ``tl.dot`` tile, so every K/V element is read from HBM
once. Long contexts with few sequences are split along the keys (flash-decoding): each split
writes an unnormalised partial result plus its running max / denominator, and a second kernel
merges them.
"""

from __future__ import annotations

import math

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
# Keys per inner iteration. 64 keeps two bf16 [64, 128] K/V tiles in flight per program.
_BLOCK_N = 64
_MAX_SPLITS = 64
# A split must cover at least this many keys, otherwise merge traffic outweighs the parallelism.
_MIN_KEYS_PER_SPLIT = 512


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    scale_log2, window, num_heads,
    stride_qs, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bts, stride_btb,
    stride_os, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT_TILES: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)

    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    # Tiles start on BLOCK_N multiples so every split sees whole, aligned tiles.
    first = (lo // BLOCK_N) * BLOCK_N
    if SPLIT_TILES > 0:  # batch-invariant: a split's keys depend on the sequence alone
        tiles_per_split = SPLIT_TILES
    else:
        tiles_per_split = tl.cdiv(tl.cdiv(seq_len - first, BLOCK_N), NUM_SPLITS)
    start = first + split * tiles_per_split * BLOCK_N
    end = tl.minimum(seq_len, start + tiles_per_split * BLOCK_N)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    ).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bts
    for tile in range(start, end, BLOCK_N):
        pos = tile + offs_n
        valid = (pos >= lo) & (pos < end)
        block = tl.load(table_row + (pos // BLOCK_SIZE) * stride_btb, mask=valid, other=0).to(tl.int64)
        tok = pos % BLOCK_SIZE
        kv_mask = valid[:, None] & d_mask[None, :]
        # Masked loads never touch slots outside the context, so stale or NaN cache contents
        # (unwritten tail of the last block, other sequences' blocks) cannot leak in.
        k = tl.load(
            k_cache_ptr + block[:, None] * stride_kb + tok[:, None] * stride_kt + kvh * stride_kh
            + offs_d[None, :],
            mask=kv_mask, other=0.0,
        ).to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; subtracting 0 instead avoids inf - inf.
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

    row_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1 and SPLIT_TILES == 0:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=row_mask,
        )
    else:
        # Partials are [S, Hq, NUM_SPLITS, (HEAD_DIM)] fp32, contiguous.
        part = (seq.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_m_ptr + part, m_i, mask=g_mask)
        tl.store(part_l_ptr + part, l_i, mask=g_mask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_mask)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr,
    stride_os, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr, IN_ORDER: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    part = (seq.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + offs_s
    m = tl.load(part_m_ptr + part, mask=s_mask, other=float("-inf"))
    m_max = tl.max(m, 0)
    # Empty splits carry m = -inf and get weight exp2(-inf) = 0.
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    if IN_ORDER:
        # Split by split, in order: a sequence's trailing empty splits add exact zeros, so how
        # many splits the batch's longest sequence needs cannot change its sums (a tree
        # reduction over BLOCK_SPLITS lanes could).
        base = (seq.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS
        num = tl.zeros([BLOCK_D], dtype=tl.float32)
        den = tl.sum(num, 0)
        for sp in range(NUM_SPLITS):
            ws = tl.exp2(tl.load(part_m_ptr + base + sp) - m_ref)
            num += tl.load(part_acc_ptr + (base + sp) * HEAD_DIM + offs_d, mask=offs_d < HEAD_DIM, other=0.0) * ws
            den += tl.load(part_l_ptr + base + sp) * ws
    else:
        w = tl.exp2(m - m_ref)
        denom = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)
        acc = tl.load(
            part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
            mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0,
        )
        num = tl.sum(acc * w[:, None], 0)
        den = tl.sum(denom * w, 0)
    out = num / tl.where(den == 0.0, 1.0, den)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM,
    )


def _auto_splits(query: torch.Tensor, num_kv_heads: int, max_seq_len: int) -> int:
    """Split only when (sequences x kv heads) cannot fill the GPU and contexts are long."""
    if query.device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(query.device).multi_processor_count
    else:
        num_sms = 4  # interpreter: any small number keeps the heuristic exercised
    programs = query.shape[0] * num_kv_heads
    if programs >= 2 * num_sms:
        return 1
    wanted = math.ceil(2 * num_sms / programs)
    by_length = max_seq_len // _MIN_KEYS_PER_SPLIT
    return max(1, min(wanted, by_length, _MAX_SPLITS))


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
    """Same contract as ``reference.paged_decode_attention``.

    ``num_splits`` forces the number of key splits (1 = single pass); ``None`` picks it from the
    batch shape and ``max_seq_len`` (or, without that hint, the block table width, so no host
    sync is needed). Sequences with ``seq_lens == 0`` produce zeros. ``split_keys`` (a multiple of
    64) fixes the keys per split instead, and the merge runs split by split: a sequence's output
    then does not depend on the other sequences of the batch (the deterministic mode's property).
    """
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} not a multiple of kv heads {num_kv_heads}")
    check_device(_decode_kernel, query, k_cache, v_cache, block_tables, seq_lens)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    query = last_dim_contiguous(query)
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache need a contiguous head dim")
    split_tiles = 0
    if split_keys is not None:
        if split_keys < _BLOCK_N or split_keys % _BLOCK_N:
            raise ValueError(f"split_keys must be a positive multiple of {_BLOCK_N}, got {split_keys}")
        split_tiles = split_keys // _BLOCK_N
        # enough splits for the longest context the tables can hold (+1: a window's first tile
        # starts below its first key)
        num_splits = math.ceil(block_tables.shape[1] * block_size / split_keys) + 1
    if num_splits is None:
        hint = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
        if sliding_window is not None:  # only the window's keys are read, however long the context
            hint = min(hint, int(sliding_window))
        num_splits = _auto_splits(query, num_kv_heads, hint)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    group = num_heads // num_kv_heads
    block_d = max(16, next_pow2(head_dim))  # tl.dot needs K >= 16
    merged = num_splits > 1 or split_tiles > 0
    if merged:
        part_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, device=query.device,
                               dtype=torch.float32)
        part_m = torch.empty(num_seqs, num_heads, num_splits, device=query.device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
    else:  # unused by the single-pass specialisation
        part_acc = part_m = part_l = out
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens,
        out, part_acc, part_m, part_l,
        scale * _LOG2E, int(sliding_window) if sliding_window is not None else 0, num_heads,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), block_tables.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_G=max(16, next_pow2(group)), BLOCK_D=block_d, BLOCK_N=_BLOCK_N,
        NUM_SPLITS=num_splits, HAS_WINDOW=sliding_window is not None,
        DOT_DTYPE=dot_dtype(_decode_kernel, k_cache.dtype), DOT_PRECISION=dot_precision(k_cache.dtype),
        SPLIT_TILES=split_tiles, num_warps=4, num_stages=2,
    )
    if merged:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_acc, part_m, part_l, out,
            out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            BLOCK_SPLITS=next_pow2(num_splits), BLOCK_D=block_d, IN_ORDER=split_tiles > 0,
            num_warps=4,
        )
    return out
