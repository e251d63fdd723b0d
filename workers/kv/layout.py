"""A worker's paged KV cache as one allocation: every layer's K and V cache is a view of it, in
the order K0, V0, K1, V1, ... Kernels see the per-layer views; block moves that touch every layer
(a shipment's gather and scatter, the same-machine copy) go through ``stacked`` at once, in two
indexed copies instead of two per layer (on a GPU, 120 kernel launches for SmolLM2's 30 layers).
"""

from __future__ import annotations

import math

import torch
from baton_serve.workers.model.llama import KVCache


def allocate_kv(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device | str = "cpu") -> list[KVCache]:
    """Zeroed K and V caches of ``shape`` ([blocks, block_size, kv_heads, head_dim]) per layer, in one
    allocation."""
    flat = torch.zeros(2 * num_layers * math.prod(shape), dtype=dtype, device=device)
    return split_layers(flat, num_layers, shape)


def split_layers(flat: torch.Tensor, num_layers: int, shape: tuple[int, ...]) -> list[KVCache]:
    """Per-layer (K, V) views of a flat buffer laid out K0, V0, K1, V1, ..."""
    per = math.prod(shape)
    return [(flat[(2 * i) * per:(2 * i + 1) * per].view(shape), flat[(2 * i + 1) * per:(2 * i + 2) * per].view(shape))
            for i in range(num_layers)]


def stacked(caches: list[KVCache]) -> torch.Tensor | None:
    """All layers as one ``[2 x layers, blocks, ...]`` view (K0, V0, K1, ...) when the caches are
    consecutive views of one allocation (``allocate_kv``, a mapped peer cache), else None."""
    if not caches:
        return None
    first = caches[0][0]
    per = first.numel()
    storage = first.untyped_storage()
    for i, (k, v) in enumerate(caches):
        for j, t in enumerate((k, v)):
            if (t.shape != first.shape or t.dtype != first.dtype or t.device != first.device
                    or not t.is_contiguous() or t.untyped_storage().data_ptr() != storage.data_ptr()
                    or t.storage_offset() != first.storage_offset() + (2 * i + j) * per):
                return None
    out = torch.empty(0, dtype=first.dtype, device=first.device)
    full = (2 * len(caches),) + tuple(first.shape)
    return out.set_(storage, first.storage_offset(), full, torch.empty(full, device="meta").stride())
