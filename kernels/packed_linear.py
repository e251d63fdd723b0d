"""Linear layers over weights packed once into oneDNN's blocked layout (CPU; bf16, and fp32 on x86-64).

``F.linear`` reorders a plain weight into a blocked layout on every call (oneDNN for bf16, MKL's
sgemm packing for fp32); at the few rows of a decode step that reorder costs as much as the
multiply itself. Packing at load time skips it:
- bf16: outputs equal to ``F.linear``'s but where the exact sum lies at a bf16 halfway point within
  fp32 error (both sum in fp32, in different orders, and round once; then they may round to
  neighbours: a few elements in 10^5 at K=16); 1.3-2x faster at 1-32 rows and a few percent at
  1024 rows (one core, SmolLM2 shapes).
- fp32 (x86-64): the same sums in another order (within fp32 rounding of ``F.linear``). SmolLM2's
  30 layers + lm_head, 2 threads, 2-core Zen 3 (AVX2): ``F.linear`` 38.3 / 208.7 / 860.2 ms
  against packed 27.6 / 108.9 / 597.7 at 1 / 32 / 256 rows (``benchmarks/quant_gemm.py``,
  results/quant_gemm_avx2.json). Not measured on aarch64, which keeps ``F.linear`` in fp32.
A packed layer drops its plain weight (``FullPrecision.pack``), except the output projection, whose
rows the logit upcast reads, and a tied embedding. ``BATON_PACKED_LINEAR=0`` turns packing off.
Which layout (packed with which batch hint, or plain) each weight shape gets on this CPU is measured
at start by ``kernels.kernel_choice``; the hints below are the defaults where it is not.
"""

from __future__ import annotations

import os
import platform

import torch
import torch.nn.functional as F
from baton_serve.kernels import backend

# oneDNN's layout choice depends a little on the row count it is told to expect. bf16: 1 (decode
# rows are few; larger hints measured the same). fp32: 64, which on the Zen 3 was no slower than 1
# at one row and faster from 8 rows up (16 and 64 came out alike).
_BATCH_HINT = {torch.bfloat16: 1, torch.float32: 64}


def enabled() -> bool:
    """Whether packing is allowed (on by default; ``BATON_PACKED_LINEAR=0`` or a forced torch backend turn it off)."""
    if backend.forced() == "torch":
        return False
    return os.environ.get("BATON_PACKED_LINEAR", "1").strip() not in ("0", "false", "no", "off")


def _packs(dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        return True
    return dtype == torch.float32 and platform.machine() in ("x86_64", "AMD64")


def default_hint(dtype: torch.dtype) -> int | None:
    """The batch hint a ``dtype`` weight is packed with when no measurement says otherwise (None: not packed)."""
    return _BATCH_HINT[dtype] if _packs(dtype) else None


def pack(weight: torch.Tensor, batch_hint: int | None = None) -> torch.Tensor | None:
    """A packed copy of a ``[out, in]`` CPU weight, or None where packing does not apply.

    ``batch_hint``: the row count oneDNN lays the weight out for (default: ``default_hint``; a hint
    packs fp32 off x86-64 too, where a measurement found that faster). Other dtypes (fp16),
    devices and torch builds without oneDNN keep ``F.linear``.
    """
    if not enabled() or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if batch_hint is None:
        batch_hint = default_hint(weight.dtype)
    if batch_hint is None or weight.dtype not in _BATCH_HINT or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)
    except (RuntimeError, AttributeError):  # an older torch, or a CPU oneDNN refuses for this dtype
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` through the packed weight when there is one (``weight`` may then be
    released, empty); x of another dtype is computed in the packed one and cast back."""
    if packed is None or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    if x.dtype != packed.dtype:
        return linear(x.to(packed.dtype), weight, packed, None if bias is None else bias.to(packed.dtype)).to(x.dtype)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
