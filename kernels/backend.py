"""Kernel dispatch: Triton on CUDA tensors; on CPU the native C kernels where they exist
(``kernels.cpu_ops``), else the torch reference.

``BATON_KERNEL_BACKEND=torch|native|triton`` forces one side (``triton`` on CPU needs
``TRITON_INTERPRET=1`` set before import). The engine calls only the functions here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from baton_serve.kernels import cpu_ops, reference

_OPS = (
    "write_kv_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "gather_kv_blocks",
    "scatter_kv_blocks",
    "copy_blocks",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
)


def forced() -> str | None:
    """The backend ``BATON_KERNEL_BACKEND`` forces (torch, native or triton), or None for automatic."""
    value = os.environ.get("BATON_KERNEL_BACKEND", "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in ("torch", "native", "triton"):
        raise ValueError(f"BATON_KERNEL_BACKEND must be 'torch', 'native', 'triton' or 'auto', got {value!r}")
    return value


def _triton_ops() -> Any | None:
    try:
        from baton_serve.kernels import triton_ops
    except ImportError:
        return None
    return triton_ops


def select(op: str, device: torch.device) -> Callable[..., Any]:
    """The implementation of ``op`` to use for tensors on ``device``."""
    forced_now = forced()
    use_triton = forced_now == "triton" or (forced_now is None and device.type == "cuda")
    if use_triton:
        ops = _triton_ops()
        if ops is not None and hasattr(ops, op):
            return getattr(ops, op)
        if forced_now == "triton":
            if ops is None:
                from baton_serve.extras import require

                require("triton", "BATON_KERNEL_BACKEND=triton")  # raises, naming the extra, if Triton is missing
            raise RuntimeError(f"BATON_KERNEL_BACKEND=triton but no Triton kernel for {op!r} is available")
    elif forced_now != "torch" and device.type == "cpu" and hasattr(cpu_ops, op):
        return getattr(cpu_ops, op)  # falls back to the reference by itself when it cannot run
    return getattr(reference, op)


def _dispatcher(op: str) -> Callable[..., Any]:
    # These run ~10 times per layer per engine step: remember the choice per device type and
    # override value rather than re-deciding on every call.
    chosen: dict[tuple[str, str], Callable[..., Any]] = {}

    def call(first: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        key = (first.device.type, os.environ.get("BATON_KERNEL_BACKEND", ""))
        impl = chosen.get(key)
        if impl is None:
            impl = chosen[key] = select(op, first.device)
        return impl(first, *args, **kwargs)

    call.__name__ = op
    call.__doc__ = getattr(reference, op).__doc__
    return call


write_kv_cache = _dispatcher("write_kv_cache")
paged_decode_attention = _dispatcher("paged_decode_attention")
paged_prefill_attention = _dispatcher("paged_prefill_attention")
gather_kv_blocks = _dispatcher("gather_kv_blocks")
scatter_kv_blocks = _dispatcher("scatter_kv_blocks")
copy_blocks = _dispatcher("copy_blocks")
rms_norm = _dispatcher("rms_norm")
fused_add_rms_norm = _dispatcher("fused_add_rms_norm")
rotary_embedding = _dispatcher("rotary_embedding")
silu_and_mul = _dispatcher("silu_and_mul")

# Dispatched like the ops above but not listed in _OPS (the set every backend must implement as a
# kernel): on GPUs torch's fused reduction is the implementation, triton_ops re-exports it.
argmax_rows = _dispatcher("argmax_rows")
