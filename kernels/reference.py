"""Torch reference implementations of every kernel Baton uses.

These are the CPU path and the ground truth the Triton kernels are tested against.
Shapes (T tokens, S sequences, Hq query heads, Hkv key/value heads, D head dim):

- KV cache of one layer: ``k_cache``, ``v_cache`` are ``[num_blocks, block_size, Hkv, D]``.
- ``slot_mapping[t] = block_id * block_size + offset``; a negative slot means "do not write".
- ``block_tables`` is ``[S, max_blocks]`` int32; entries past a sequence's length are ignored.
- ``seq_lens[s]`` is the number of KV positions of sequence ``s`` already in the cache,
  including the tokens whose queries are being computed now.

The functions are pure except the ``write_kv_cache`` / ``scatter_kv_blocks`` / ``copy_blocks``
family, which update a cache in place and return nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` ``[T, Hkv, D]`` into the paged cache at ``slot_mapping`` ``[T]``."""
    num_blocks, block_size, h, d = k_cache.shape
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    slots = slot_mapping.long()
    k_cache.view(num_blocks * block_size, h, d).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, h, d).index_copy_(0, slots, value.to(v_cache.dtype))


def _gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, num_positions: int
) -> torch.Tensor:
    """``[S, num_positions, Hkv, D]`` view of the first positions of each block table."""
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    num_table_blocks = (num_positions + block_size - 1) // block_size
    # Entries past a sequence's length may be any padding value (-1, stale ids); clamp them to a
    # valid block so indexing cannot fail. Callers mask those positions.
    table = block_tables[:, :num_table_blocks].long().clamp(0, num_blocks - 1)
    gathered = cache[table]  # [S, nb, bs, H, D]
    s, nb, bs, h, d = gathered.shape
    return gathered.view(s, nb * bs, h, d)[:, :num_positions]


def _window_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, kv_len: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """Boolean mask ``[..., Lq, Lk]``: True where the query may attend the key."""
    mask = (k_pos <= q_pos) & (k_pos < kv_len)
    if sliding_window is not None:
        mask &= q_pos - k_pos < sliding_window
    return mask


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
    """One query token per sequence (the last position): ``query [S, Hq, D] -> [S, Hq, D]``.

    ``max_seq_len`` is an optional host-side hint (max of ``seq_lens``) that saves a sync.
    ``num_splits`` and ``split_keys`` are knobs of the split-K Triton kernel (how many splits, or a
    fixed size per split), accepted and ignored here: one pass over the keys.
    """
    del num_splits, split_keys
    num_seqs, hq, d = query.shape
    hkv = k_cache.shape[2]
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    k = _gather_context(k_cache, block_tables, max_seq_len).transpose(1, 2)  # [S, Hkv, L, D]
    v = _gather_context(v_cache, block_tables, max_seq_len).transpose(1, 2)
    k_pos = torch.arange(max_seq_len, device=query.device)
    lens = seq_lens.to(query.device).long().view(num_seqs, 1)
    mask = _window_mask(lens - 1, k_pos.view(1, -1), lens, sliding_window)  # [S, L]
    # Zero the masked keys/values: slots past a shorter sequence's end (the unwritten tail of its
    # last block, other sequences' blocks) may hold NaN/inf, and a -inf mask does not stop
    # NaN * 0 in the score or P @ V products.
    keep = mask.view(num_seqs, 1, max_seq_len, 1)
    k = k.masked_fill(~keep, 0)
    v = v.masked_fill(~keep, 0)
    # Fold the query heads sharing a KV head into the query-length axis: one [G, L] score
    # matrix per (sequence, KV head) instead of G broadcast copies of K/V (3x faster on CPU).
    q = query.view(num_seqs, hkv, hq // hkv, d).to(k.dtype)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask.view(num_seqs, 1, 1, max_seq_len), scale=scale
    )
    return out.reshape(num_seqs, hq, d).to(query.dtype)


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
    """Causal attention for packed query chunks over their paged context.

    Sequence ``s`` owns queries ``query[query_start_loc[s]:query_start_loc[s+1]]``; they are the
    last ``q_len`` of its ``seq_lens[s]`` positions, whose keys/values are already in the cache
    (earlier chunks and prefix-cache hits included). ``query [T, Hq, D] -> [T, Hq, D]``.
    """
    total, hq, d = query.shape
    hkv = k_cache.shape[2]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        k = _gather_context(k_cache, block_tables[s : s + 1], seq_len)[0].transpose(0, 1)  # [Hkv,L,D]
        v = _gather_context(v_cache, block_tables[s : s + 1], seq_len)[0].transpose(0, 1)
        q = query[q_start:q_end].transpose(0, 1).unsqueeze(0).to(k.dtype)  # [1, Hq, q_len, D]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).view(-1, 1)
        k_pos = torch.arange(seq_len, device=query.device).view(1, -1)
        mask = _window_mask(q_pos, k_pos, torch.tensor(seq_len), sliding_window)
        o = F.scaled_dot_product_attention(
            q, k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=scale, enable_gqa=hq != hkv
        )  # [1, Hq, q_len, D]
        out[q_start:q_end] = o[0].transpose(0, 1).to(query.dtype)
    return out


def gather_kv_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Copy the listed blocks of one cache into a new contiguous ``[N, block_size, Hkv, D]`` buffer."""
    return cache.index_select(0, block_ids.long())


def scatter_kv_blocks(cache: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor) -> None:
    """Write ``buffer [N, block_size, Hkv, D]`` into the listed blocks of ``cache`` in place."""
    cache.index_copy_(0, block_ids.long(), buffer.to(cache.dtype))


def copy_blocks(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks ``src[i] -> dst[i]`` within one cache (copy-on-write)."""
    cache.index_copy_(0, dst.long(), cache.index_select(0, src.long()))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight``, computed in fp32, returned in ``x.dtype``."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual' = x + residual``; returns ``(rms_norm(residual'), residual')``."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply RoPE to ``query [T, Hq, D]`` and ``key [T, Hkv, D]``.

    ``cos_sin_cache`` is ``[max_positions, rot_dim]``: the first half cos, the second half sin
    (fp32). ``is_neox`` rotates the two halves of the head (Llama/HF); otherwise adjacent pairs
    (GPT-J). Dims past ``rot_dim`` pass through unchanged.
    """
    cos_sin = cos_sin_cache.index_select(0, positions.long())
    half = cos_sin.shape[-1] // 2
    cos = cos_sin[:, :half].unsqueeze(1)
    sin = cos_sin[:, half:].unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        rot = x[..., : 2 * half].float()
        if is_neox:
            x1, x2 = rot[..., :half], rot[..., half:]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        if rot.shape[-1] == x.shape[-1]:
            return out.to(x.dtype)
        return torch.cat((out.to(x.dtype), x[..., 2 * half :]), dim=-1)

    return rotate(query), rotate(key)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for ``x [..., 2I]``."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of ``x [N, V]`` as int64 ``[N]``: the first maximal index, NaN counting as maximal."""
    return x.argmax(-1)


def build_cos_sin_cache(
    rot_dim: int, max_positions: int, inv_freq: torch.Tensor
) -> torch.Tensor:
    """``[max_positions, rot_dim]`` fp32 table of cos (first half) and sin (second half)."""
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq.float())
    assert freqs.shape[-1] * 2 == rot_dim
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
