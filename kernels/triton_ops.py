"""Triton implementations of every op in ``kernels.reference``, with identical signatures.

``kernels.backend`` picks these for CUDA tensors. Under ``TRITON_INTERPRET=1`` (set before this
module is imported) they also accept CPU tensors, which is how they are tested without a GPU.
The kernels live in ``kernels.triton_*`` modules; this module is the public surface.
"""

from __future__ import annotations

# Not kernels, re-exported so both modules expose the same names: a one-off host-side table, and
# the row argmax, where torch's CUDA reduction is already a single fused pass.
from baton_serve.kernels.reference import argmax_rows, build_cos_sin_cache
from baton_serve.kernels.triton_cache import copy_blocks, gather_kv_blocks, scatter_kv_blocks, write_kv_cache
from baton_serve.kernels.triton_decode import paged_decode_attention
from baton_serve.kernels.triton_norm import fused_add_rms_norm, rms_norm, silu_and_mul
from baton_serve.kernels.triton_prefill import paged_prefill_attention
from baton_serve.kernels.triton_rotary import rotary_embedding

__all__ = [
    "argmax_rows",
    "build_cos_sin_cache",
    "copy_blocks",
    "fused_add_rms_norm",
    "gather_kv_blocks",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_embedding",
    "scatter_kv_blocks",
    "silu_and_mul",
    "write_kv_cache",
]
