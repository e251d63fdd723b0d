"""Paged prefill attention through torch's ``scaled_dot_product_attention``, a candidate that
``kernels.kernel_choice`` times against the native C flash kernel.

A fresh prompt (no cached context, no sliding window) takes SDPA's causal path, whose CPU flash
kernel runs QK^T and PV as bf16/fp32 GEMM tiles through oneDNN's brgemm (AMX tiles where the CPU has
them); a chunk after cached context, or a windowed layer, goes through the masked reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from baton_serve.kernels import reference


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
    """Same contract as ``kernels.reference.paged_prefill_attention``."""
    _, hq, d = query.shape
    _, block_size, hkv, _ = k_cache.shape
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        if q_len != seq_len or sliding_window is not None:
            out[q_start:q_end] = reference.paged_prefill_attention(
                query[q_start:q_end], k_cache, v_cache, block_tables[s:s + 1], seq_lens[s:s + 1],
                torch.tensor([0, q_len], dtype=query_start_loc.dtype), scale, sliding_window)
            continue
        blocks = block_tables[s, :(seq_len + block_size - 1) // block_size].long()
        k = k_cache[blocks].view(-1, hkv, d)[:seq_len].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
        v = v_cache[blocks].view(-1, hkv, d)[:seq_len].transpose(0, 1).unsqueeze(0)
        q = query[q_start:q_end].to(k.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=hq != hkv)
        out[q_start:q_end] = o[0].transpose(0, 1).to(query.dtype)
    return out
