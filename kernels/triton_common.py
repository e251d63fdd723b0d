"""Launch helpers shared by the Triton kernel modules.

Nothing here holds state: interpreter mode is detected from a kernel object, which Triton fixes
when the ``@triton.jit`` decorator runs (``TRITON_INTERPRET=1`` must be set before import).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def is_interpreted(kernel: object) -> bool:
    """True when ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (runs on the host)."""
    return isinstance(kernel, InterpretedFunction)


def check_device(kernel: object, *tensors: torch.Tensor) -> None:
    """Fail early with a clear message instead of a Triton launch error on host tensors."""
    if is_interpreted(kernel):
        return
    for t in tensors:
        if t.device.type != "cuda":
            raise RuntimeError(
                "Triton kernels need CUDA tensors; for CPU tensors set TRITON_INTERPRET=1 "
                f"before importing kernels.triton_ops (got a tensor on {t.device})"
            )


def dot_dtype(kernel: object, dtype: torch.dtype) -> tl.dtype:
    """Operand dtype of ``tl.dot`` for cache elements of ``dtype``.

    The interpreter emulates bf16 with integer storage, so its dots must run in fp32; on the GPU
    the native half type keeps the tensor cores at full rate (accumulation is fp32 either way).
    """
    if dtype not in _TL_DTYPES:
        raise TypeError(f"unsupported dtype {dtype} (fp32, bf16, fp16)")
    return tl.float32 if is_interpreted(kernel) else _TL_DTYPES[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    """``ieee`` for fp32 operands so results are not silently rounded through TF32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``max(n, 1)``."""
    return triton.next_power_of_2(max(int(n), 1))


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dim has stride 1 (kernels index it densely), else a copy."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()
