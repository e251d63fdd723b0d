"""Batch-invariant linear layers for the deterministic mode (CPU, bf16 and fp32 weights).

oneDNN's and MKL's matmuls choose their blocking, and at a few rows a split of K across threads,
from the shape: a row's output then depends on how many rows share the call (measured on SmolLM2's
down_proj, K = 1536, bf16: 1-2 rows in 40 differ between M = 1 and M >= 7; fp32 ``F.linear``
differs at every M > 1). ``kernels/cpu/invariant_linear.c`` sums every output over k in one fixed
order, so a row's bits depend on that row and the weight alone.

``pack`` lays a ``[N, K]`` weight out once in the kernel's panels; ``linear`` runs it. There is no
torch fallback: the engine refuses the mode where the native kernels cannot run
(``kernels.deterministic.check``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from baton_serve.kernels import cpu_ops
from baton_serve.kernels.deterministic import DeterministicModeError

PANEL = 32  # output columns per panel (invariant_linear.c's PW)


@dataclass(frozen=True)
class InvariantWeight:
    """A weight in the invariant kernel's panel layout, with the shape it came from."""

    panels: torch.Tensor  # bf16: int32 [N/32, K/2, 32] (k pairs); fp32: float32 [N/32, K, 32]
    out_features: int
    in_features: int
    dtype: torch.dtype

    def dense(self) -> torch.Tensor:
        """The plain ``[N, K]`` weight back (exact)."""
        n, k = self.out_features, self.in_features
        if self.dtype == torch.bfloat16:
            pairs = self.panels.view(torch.bfloat16).view(self.panels.shape[0], -1, PANEL, 2)
            w = pairs.permute(0, 2, 1, 3).reshape(-1, pairs.shape[1] * 2)
        else:
            w = self.panels.permute(0, 2, 1).reshape(-1, self.panels.shape[1])
        return w[:n, :k].contiguous()


def pack(weight: torch.Tensor) -> InvariantWeight:
    """``weight [N, K]`` (bf16 or fp32, CPU) in panels of 32 output columns, zero-padded."""
    if weight.dim() != 2 or weight.dtype not in (torch.bfloat16, torch.float32) or weight.device.type != "cpu":
        raise DeterministicModeError(f"deterministic mode runs bf16 and fp32 weights on the CPU, got a "
                                     f"{weight.dtype} weight of shape {tuple(weight.shape)} on {weight.device}")
    n, k = weight.shape
    npad = -n % PANEL
    if weight.dtype == torch.bfloat16:
        w = F.pad(weight.detach(), (0, k % 2, 0, npad))
        panels = w.view(-1, PANEL, w.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()
        panels = panels.view(torch.int32).view(-1, w.shape[1] // 2, PANEL)
    else:
        w = F.pad(weight.detach(), (0, 0, 0, npad))
        panels = w.view(-1, PANEL, k).permute(0, 2, 1).contiguous()
    return InvariantWeight(panels, n, k, weight.dtype)


def linear(x: torch.Tensor, weight: InvariantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W.T + bias`` in ``weight``'s dtype (x of another dtype is cast to it and the
    result cast back), each output summed over k in one order whatever the batch."""
    if x.dtype != weight.dtype:
        b = None if bias is None else bias.to(weight.dtype)
        return linear(x.to(weight.dtype), weight, b).to(x.dtype)
    n, k = weight.out_features, weight.in_features
    if x.shape[-1] != k:
        raise ValueError(f"linear: input has {x.shape[-1]} features, the weight takes {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < k):
        x2 = x2.contiguous()
    bf16 = weight.dtype == torch.bfloat16
    if bf16 and k % 2:
        x2 = F.pad(x2, (0, 1))  # the panels' k pairs end in a zero; so must x
    lib = cpu_ops.library() if x2.is_cpu else None
    if lib is None:
        raise DeterministicModeError("the invariant linear kernel needs Baton's native CPU kernels and a CPU tensor")
    b = None if bias is None else bias.float().contiguous()
    out = torch.empty((x2.shape[0], n), dtype=weight.dtype)
    stride = x2.stride(0) if x2.shape[0] > 1 else x2.shape[1]
    if lib.baton_linear_invariant(x2.data_ptr(), weight.panels.data_ptr(), None if b is None else b.data_ptr(),
                                  out.data_ptr(), x2.shape[0], n, x2.shape[1], stride, int(bf16), int(bf16),
                                  torch.get_num_threads()):
        raise DeterministicModeError(f"the invariant linear kernel refused shape M={x2.shape[0]} N={n} K={k}")
    return out.view(*lead, n)
