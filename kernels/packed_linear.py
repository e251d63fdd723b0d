"""Linear layers over weights packed once into oneDNN's blocked layout (CPU, bf16).

``F.linear`` on a plain bf16 CPU weight reorders the weight into oneDNN's layout on every call;
at the few rows of a decode step that reorder costs as much as the multiply itself. Packing at
load time skips it: outputs are bit-identical, 1.3-2x faster at 1-32 rows and a few percent at
1024 rows (one core, SmolLM2 shapes). ``BATON_PACKED_LINEAR=0`` turns it off.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernels import backend

_BATCH_HINT = 1  # oneDNN's layout choice barely depends on it for these shapes; decode rows are few


def enabled() -> bool:
    """Whether packing is allowed (on by default; ``BATON_PACKED_LINEAR=0`` or a forced torch backend turn it off)."""
    if backend.forced() == "torch":
        return False
    return os.environ.get("BATON_PACKED_LINEAR", "1").strip() not in ("0", "false", "no", "off")


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """A packed copy of a ``[out, in]`` bf16 CPU weight, or None where packing does not apply.

    Other dtypes, devices and CPUs without oneDNN's bf16 path keep the plain ``F.linear``.
    """
    if not enabled() or weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _BATCH_HINT)
    except (RuntimeError, AttributeError):  # an older torch, or a CPU oneDNN refuses for bf16
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` through the packed weight when there is one."""
    if packed is None or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
