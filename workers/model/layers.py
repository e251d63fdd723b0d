"""Layer types of a Llama-family decoder; tensor parallelism lives here, not in the model.

Each parameter carries a ``weight_loader(param, loaded, shard_id)`` that copies its slice of a
checkpoint tensor, so a model with ``tp_size > 1`` loads unchanged checkpoints; ``loaded`` may be
a lazy ``CheckpointSlice``, narrowed before it is read, so a rank reads only its part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from baton_serve.kernels import backend
from baton_serve.kernels.kernel_choice import KernelPlan
from baton_serve.kernels.reference import build_cos_sin_cache
from baton_serve.workers.model.checkpoint_slice import CheckpointSlice, as_tensor
from baton_serve.workers.model.quantization import QuantConfig, linear_method
from torch import nn


@dataclass(frozen=True)
class ParallelContext:
    """This rank's place in its tensor-parallel group (size 1 means no parallelism); ``group`` is
    what sums partial results across the ranks (``workers.parallel.group.TPGroup``)."""

    tp_size: int = 1
    tp_rank: int = 0
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            if self.group is None:
                raise RuntimeError(f"rank {self.tp_rank} of {self.tp_size} has no group to all-reduce over")
            self.group.all_reduce(x)
        return x


def _set_loader(param: nn.Parameter, loader: Any) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor | CheckpointSlice,
                          shard_id: Any = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(as_tensor(loaded))


class ColumnParallelLinear(nn.Module):
    """``y = x W^T (+ b)`` with W split by output rows across ranks.

    ``output_sizes`` lists merged sub-matrices (e.g. q, k, v) so one matmul serves them all;
    ``shard_id`` in the loader is the index of the sub-matrix. ``shard_rows`` overrides, per
    sub-matrix, the (first row, rows) this rank holds: replicated KV heads are not an even split.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, ctx: ParallelContext,
                 dtype: torch.dtype, quant: QuantConfig | None = None,
                 shard_rows: list[tuple[int, int]] | None = None) -> None:
        super().__init__()
        if shard_rows is None:
            for size in output_sizes:
                if size % ctx.tp_size:
                    raise ValueError(f"output size {size} is not divisible by tp_size {ctx.tp_size}")
            shard_rows = [(ctx.tp_rank * (s // ctx.tp_size), s // ctx.tp_size) for s in output_sizes]
        if len(shard_rows) != len(output_sizes) or any(
                first < 0 or first + rows > size for (first, rows), size in zip(shard_rows, output_sizes)):
            raise ValueError(f"shard rows {shard_rows} do not fit output sizes {output_sizes}")
        self.ctx = ctx
        self.shard_rows = list(shard_rows)
        self.local_sizes = [rows for _, rows in shard_rows]
        out = sum(self.local_sizes)
        self.method = linear_method(quant)
        self.method.create_weights(self, out, input_size, dtype, self._load)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out, dtype=dtype), requires_grad=False)
            _set_loader(self.bias, self._load)

    def pack_weights(self, release_plain: bool = True, invariant: bool = False,
                     plan: KernelPlan | None = None) -> None:
        """Prepare the loaded weight for the CPU matmul (see ``kernels.packed_linear``; ``invariant``:
        ``kernels.invariant_linear``; ``plan``: ``kernels.kernel_choice``); with ``release_plain`` a
        packed copy replaces the plain weight."""
        self.method.pack(self, release_plain, invariant, plan)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        idx = 0 if shard_id is None else shard_id
        first, local = self.shard_rows[idx]
        offset = sum(self.local_sizes[:idx])
        param.data.narrow(0, offset, local).copy_(as_tensor(loaded.narrow(0, first, local)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


class RowParallelLinear(nn.Module):
    """``y = x W^T`` with W split by input columns; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool, ctx: ParallelContext,
                 dtype: torch.dtype, quant: QuantConfig | None = None) -> None:
        super().__init__()
        if input_size % ctx.tp_size:
            raise ValueError(f"input size {input_size} is not divisible by tp_size {ctx.tp_size}")
        self.ctx = ctx
        self.local_in = input_size // ctx.tp_size
        self.method = linear_method(quant)
        self.method.create_weights(self, output_size, self.local_in, dtype, self._load)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
            _set_loader(self.bias, default_weight_loader)

    def pack_weights(self, release_plain: bool = True, invariant: bool = False,
                     plan: KernelPlan | None = None) -> None:
        """Prepare the loaded weight for the CPU matmul (see ``kernels.packed_linear``; ``invariant``:
        ``kernels.invariant_linear``; ``plan``: ``kernels.kernel_choice``); with ``release_plain`` a
        packed copy replaces the plain weight."""
        self.method.pack(self, release_plain, invariant, plan)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        divisor = getattr(param, "input_divisor", 1)
        if divisor is None:  # no input dim (per-output-channel scales): every rank holds all of it
            param.data.copy_(as_tensor(loaded))
            return
        local = self.local_in // divisor
        param.data.copy_(as_tensor(loaded.narrow(1, self.ctx.tp_rank * local, local)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ctx.all_reduce(self.method.apply(self, x, None))
        return y if self.bias is None else y + self.bias


class RMSNorm(nn.Module):
    """RMSNorm; with ``residual`` it fuses the residual add and returns both outputs."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        _set_loader(self.weight, default_weight_loader)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if residual is None:
            return backend.rms_norm(x, self.weight, self.eps)
        return backend.fused_add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """RoPE inverse frequencies, with Llama-3 style ``rope_scaling`` when configured."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        orig = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = orig / low, orig / high
        wavelen = 2 * math.pi / inv_freq
        smooth = (orig / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return torch.where(mid, blended, scaled).float()
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if kind in (None, "default"):
        return inv_freq.float()
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3, linear, default)")


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE from a precomputed cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(head_dim, max_positions, inv_freq),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return backend.rotary_embedding(positions, q, k, self.cos_sin_cache, True)
