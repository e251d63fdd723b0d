"""Paged attention for a mixed batch: decode tokens first, then prefill chunks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
from baton_serve.kernels import backend
from torch import nn


@dataclass
class AttentionMetadata:
    """Where each token's K/V goes and what each query attends to, for one forward.

    Tokens are ordered ``[decode tokens (one per decode seq) | prefill tokens]``.
    ``slot_mapping[t] = block * block_size + offset`` for every token.
    """

    slot_mapping: torch.Tensor  # [T] int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [D, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [D] int32
    decode_max_seq_len: int
    prefill_block_tables: torch.Tensor  # [P, max_blocks] int32
    prefill_seq_lens: torch.Tensor  # [P] int32
    prefill_query_start_loc: torch.Tensor  # [P + 1] int32, offsets within the prefill tokens

    @property
    def num_prefills(self) -> int:
        return int(self.prefill_seq_lens.shape[0])

    @cached_property
    def decode_query_start_loc(self) -> torch.Tensor:
        """``[D + 1]`` int32 offsets of the decode tokens as one-token chunks (the deterministic
        mode's decode through the prefill kernel); built once per forward, shared by the layers."""
        return torch.arange(self.num_decode_tokens + 1, dtype=torch.int32, device=self.slot_mapping.device)


class PagedAttention(nn.Module):
    """Writes this layer's new K/V into the paged cache, then attends over it.

    ``deterministic``: decode tokens go through the prefill kernel as one-token chunks, so a
    position's attention is the same arithmetic whether it was decoded or (re-)prefilled; the
    prefill kernels walk keys in tiles fixed by absolute position, whatever the chunking.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 sliding_window: int | None, deterministic: bool = False) -> None:
        super().__init__()
        self.deterministic = deterministic
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        # set by the model's kernel plan (kernels.kernel_choice); None: the backend's dispatch
        self.prefill_kernel: Callable[..., torch.Tensor] | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """``q [T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]`` -> ``[T, Hq, D]``."""
        k_cache, v_cache = kv_cache
        backend.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        d = meta.num_decode_tokens
        if meta.num_prefills == 0:
            return self._decode(q, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        if d:
            out[:d] = self._decode(q[:d], k_cache, v_cache, meta)
        out[d:] = (self.prefill_kernel or backend.paged_prefill_attention)(
            q[d:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_seq_lens,
            meta.prefill_query_start_loc, self.scale, self.sliding_window)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if self.deterministic:
            return backend.paged_prefill_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens,
                                                   meta.decode_query_start_loc, self.scale, self.sliding_window)
        return backend.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens,
                                              self.scale, self.sliding_window, meta.decode_max_seq_len)
