"""What the deterministic mode needs, checked once at engine start.

In the mode every kernel on the serving path computes a row with a reduction order that depends
on that row alone (``kernels.invariant_linear`` for the matmuls, the native prefill attention
kernel for decode and prefill alike; the element-wise kernels and the logit upcast are per row
already). Those are the native CPU kernels in fp32 and bf16; anything else would fall back to
torch ops whose blocking follows the batch, so the mode refuses to start there instead.
"""

from __future__ import annotations

import torch
from baton_serve.kernels import backend, cpu_ops


class DeterministicModeError(RuntimeError):
    """The deterministic mode cannot run on this machine or with this model (the message says why)."""


def check(dtype: torch.dtype, device: torch.device, head_dim: int) -> None:
    """Raise ``DeterministicModeError`` naming the setting to change unless the mode can run here."""
    if device.type != "cpu":
        raise DeterministicModeError(
            f"deterministic mode runs on CPU workers (device = 'cpu'); on {device.type} the matmuls are "
            "cuBLAS's, whose blocking follows the batch: set device = 'cpu' or serve without --deterministic")
    if dtype not in (torch.bfloat16, torch.float32):
        raise DeterministicModeError(f"deterministic mode runs dtype bfloat16 or float32, got {dtype}: set --dtype")
    if backend.forced() not in (None, "native"):
        raise DeterministicModeError(
            f"deterministic mode needs the native CPU kernels; BATON_KERNEL_BACKEND={backend.forced()} "
            "forces another backend: unset it")
    if head_dim % 8:
        raise DeterministicModeError(
            f"deterministic mode's attention kernel takes head dims that are multiples of 8, this model's is {head_dim}")
    if not cpu_ops.available():
        raise DeterministicModeError(
            "deterministic mode needs Baton's native CPU kernels, which could not be built here "
            "(no C compiler?): install gcc, or serve without --deterministic")
