"""Weight-only quantised linear layers: how a layer holds its weight and multiplies by it.

A linear layer delegates both to a *linear method* chosen by name (``LINEAR_METHODS``), as vLLM's
``QuantizeMethodBase`` does: ``full`` keeps a float weight (packed for the CPU matmul), ``int8``
holds per-output-channel int8 weights, ``int4`` group-wise asymmetric 4-bit ones
(``kernels.quant_linear`` has the formats and the kernels). Adding a method is one class here and
one registry entry. Quantised checkpoints are written by ``workers.checkpoint.quantize``; their
``config.json`` carries a ``quantization_config`` that ``ModelConfig`` reads into ``QuantConfig``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from baton_serve.kernels import invariant_linear, packed_linear, quant_linear, w8a8_linear
from baton_serve.kernels.kernel_choice import KernelPlan, prepare_weight
from baton_serve.workers.errors import ModelLoadError
from torch import nn

QUANT_METHOD = "baton"  # quantization_config.quant_method of the checkpoints workers.checkpoint.quantize writes
GROUP_SIZES = (32, 64, 128)
ACTIVATIONS = ("float", "int8")


@dataclass(frozen=True)
class QuantConfig:
    """How a checkpoint's linear layers are quantised; ``lm_head`` is the output projection's method."""

    method: str  # "int8" or "int4"
    group_size: int = 0  # input features per scale (int4: per scale and min); int8 may use 0: per channel
    lm_head: str = "full"
    activations: str = "float"  # "int8": W8A8, rows quantised on the fly (kernels.w8a8_linear)

    def __post_init__(self) -> None:
        if self.method not in ("int8", "int4"):
            raise ModelLoadError(f"quantization_config.bits: Baton runs 8 or 4, got method {self.method!r}")
        allowed = GROUP_SIZES if self.method == "int4" else (0, *GROUP_SIZES)
        if self.group_size not in allowed:
            raise ModelLoadError(f"quantization_config.group_size must be one of {allowed} for {self.method}, "
                                 f"got {self.group_size}")
        if self.activations not in ACTIVATIONS:
            raise ModelLoadError(f"quantization_config.activations must be one of {ACTIVATIONS}, "
                                 f"got {self.activations!r}")
        if self.activations == "int8" and (self.method != "int8" or self.group_size != 0):
            raise ModelLoadError("quantization_config.activations = 'int8' needs int8 weights per output channel "
                                 f"(group_size 0), got {self.method} with group_size {self.group_size}")
        if self.lm_head not in LINEAR_METHODS:
            raise ModelLoadError(f"quantization_config.lm_head must be one of {sorted(LINEAR_METHODS)}, "
                                 f"got {self.lm_head!r}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> QuantConfig | None:
        """From config.json's ``quantization_config`` (None when the checkpoint is not quantised)."""
        if not raw:
            return None
        if raw.get("quant_method") != QUANT_METHOD:
            raise ModelLoadError(f"quantization_config.quant_method {raw.get('quant_method')!r} is not "
                                 f"supported: Baton loads its own ({QUANT_METHOD!r}, `baton convert --quantize`)")
        bits = raw.get("bits")
        if bits not in (8, 4):
            raise ModelLoadError(f"quantization_config.bits must be 8 or 4, got {bits!r}")
        return cls(method=f"int{bits}", group_size=int(raw.get("group_size") or 0),
                   lm_head=str(raw.get("lm_head", "full")), activations=str(raw.get("activations", "float")))

    def to_dict(self) -> dict[str, Any]:
        out = {"quant_method": QUANT_METHOD, "bits": int(self.method[3:]), "group_size": self.group_size,
               "lm_head": self.lm_head}
        if self.activations != "float":
            out["activations"] = self.activations
        return out

    def for_lm_head(self) -> QuantConfig | None:
        """The config of the output projection (None: full precision)."""
        if self.lm_head == "full":
            return None
        return QuantConfig(self.lm_head, self.group_size,
                           activations=self.activations if self.lm_head == "int8" else "float")


Loader = Callable[[nn.Parameter, torch.Tensor, Any], None]


class LinearMethod(Protocol):
    """Creates a layer's weight parameters and computes ``x W^T + b`` with them."""

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int, dtype: torch.dtype,
                       loader: Loader) -> None: ...

    def pack(self, layer: nn.Module, release_plain: bool, invariant: bool = False,
             plan: KernelPlan | None = None) -> None:
        """Prepare the loaded weight for the matmul; ``release_plain`` lets a packed copy replace it;
        ``invariant``: for the deterministic mode's batch-invariant kernel (``kernels.invariant_linear``);
        ``plan``: the layouts measured on this CPU (``kernels.kernel_choice``)."""
        ...

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def rows(self, layer: nn.Module, index: torch.Tensor) -> torch.Tensor:
        """fp32 rows ``index`` of the (dequantised) weight."""
        ...


def _param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, loader: Loader,
           input_divisor: int | None) -> None:
    """Register ``name`` on ``layer``. ``input_divisor``: input features per element along dim 1
    (2 for packed nibbles, the group size for group scales), so a row-parallel layer narrows its
    slice of the input dim; None for a tensor without an input dim."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    p.input_divisor = input_divisor  # type: ignore[attr-defined]
    layer.register_parameter(name, p)


class FullPrecision:
    """A float ``weight [out, in]`` in the model dtype (packed for the CPU matmul where that pays)."""

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int, dtype: torch.dtype,
                       loader: Loader) -> None:
        _param(layer, "weight", (out_features, in_features), dtype, loader, 1)
        layer.packed = None

    def pack(self, layer: nn.Module, release_plain: bool, invariant: bool = False,
             plan: KernelPlan | None = None) -> None:
        layer.packed = prepare_weight(layer.weight, None if plan is None else plan.linear_kernel(layer.weight),
                                      invariant)
        if layer.packed is not None and release_plain:
            # the packed copy is the weight from now on: keeping both doubled a model's matmul
            # weights in memory (+538 MB per fp32 SmolLM2-135M worker)
            layer.weight.data = layer.weight.data.new_empty((0, layer.weight.shape[1]))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(layer.packed, invariant_linear.InvariantWeight):
            return invariant_linear.linear(x, layer.packed, bias)
        return packed_linear.linear(x, layer.weight, layer.packed, bias)

    def rows(self, layer: nn.Module, index: torch.Tensor) -> torch.Tensor:
        if not layer.weight.numel() and layer.packed is not None:  # released: a slow, exact way back
            if isinstance(layer.packed, invariant_linear.InvariantWeight):
                return layer.packed.dense()[index].float()
            return layer.packed.to_dense()[index].float()
        return layer.weight[index].float()


class Int8:
    """``qweight int8 [out, in]`` and ``scales`` fp32: ``[out]`` (one per output channel, group
    size 0) or ``[out, in / group]`` (one per group of input features); w = q * scale."""

    def __init__(self, group_size: int, activations: str = "float") -> None:
        self.group_size = group_size
        self.activations = activations

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int, dtype: torch.dtype,
                       loader: Loader) -> None:
        g = self.group_size
        _param(layer, "qweight", (out_features, in_features), torch.int8, loader, 1)
        if g == 0:
            _param(layer, "scales", (out_features,), torch.float32, loader, None)
            return
        if in_features % g:
            raise ModelLoadError(f"int8: {in_features} input features per rank are not a multiple of the "
                                 f"group size {g}")
        _param(layer, "scales", (out_features, in_features // g), torch.float32, loader, g)

    def pack(self, layer: nn.Module, release_plain: bool, invariant: bool = False,
             plan: KernelPlan | None = None) -> None:
        layer.invariant = invariant
        # W8A8 sums int8 products in int32, exactly, so a row's result never depends on its
        # batch: the deterministic mode keeps it as it is
        layer.w8a8 = w8a8_linear.pack(layer.qweight) if self.activations == "int8" else None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if getattr(layer, "w8a8", None) is not None:
            return w8a8_linear.linear(x, layer.w8a8, layer.scales, bias)
        return quant_linear.linear_int8(x, layer.qweight, layer.scales, bias, getattr(layer, "invariant", False))

    def rows(self, layer: nn.Module, index: torch.Tensor) -> torch.Tensor:
        return quant_linear.dequantize_int8(layer.qweight[index], layer.scales[index])


class Int4:
    """``qweight uint8 [out, in / 2]`` (two nibbles a byte), ``scales`` and ``mins`` fp32
    ``[out, in / group]``: w = q * scale + min per group of input features."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int, dtype: torch.dtype,
                       loader: Loader) -> None:
        g = self.group_size
        if in_features % g:
            raise ModelLoadError(f"int4: {in_features} input features per rank are not a multiple of the "
                                 f"group size {g}")
        _param(layer, "qweight", (out_features, in_features // 2), torch.uint8, loader, 2)
        _param(layer, "scales", (out_features, in_features // g), torch.float32, loader, g)
        _param(layer, "mins", (out_features, in_features // g), torch.float32, loader, g)

    def pack(self, layer: nn.Module, release_plain: bool, invariant: bool = False,
             plan: KernelPlan | None = None) -> None:
        layer.invariant = invariant

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return quant_linear.linear_int4(x, layer.qweight, layer.scales, layer.mins, self.group_size, bias,
                                        getattr(layer, "invariant", False))

    def rows(self, layer: nn.Module, index: torch.Tensor) -> torch.Tensor:
        return quant_linear.dequantize_int4(layer.qweight[index], layer.scales[index], layer.mins[index],
                                            self.group_size)


LINEAR_METHODS: dict[str, Callable[[QuantConfig], LinearMethod]] = {
    "full": lambda quant: FullPrecision(),
    "int8": lambda quant: Int8(quant.group_size, quant.activations),
    "int4": lambda quant: Int4(quant.group_size),
}


def linear_method(quant: QuantConfig | None) -> LinearMethod:
    """The method for a layer of a checkpoint quantised as ``quant`` (None: full precision)."""
    if quant is None:
        return FullPrecision()
    return LINEAR_METHODS[quant.method](quant)
