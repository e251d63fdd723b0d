"""A checkpoint tensor read lazily: a tensor-parallel rank narrows it to its slice first, so only
those bytes are read from the safetensors file (the whole tensor is never materialised)."""

from __future__ import annotations

from typing import Any

import torch


class CheckpointSlice:
    """``narrow`` like a tensor, ``materialize`` to read (and cast) the selected part."""

    def __init__(self, source: Any, dtype: torch.dtype, shape: tuple[int, ...] | None = None,
                 index: tuple[slice, ...] = ()) -> None:
        self.source = source  # a safetensors PySafeSlice, or a tensor
        self.dtype = dtype
        self.shape = torch.Size(shape if shape is not None else source.get_shape())
        self.index = index

    def narrow(self, dim: int, start: int, length: int) -> CheckpointSlice:
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise ValueError(f"slice {start}:{start + length} of dim {dim} is outside shape {tuple(self.shape)}")
        index = list(self.index) + [slice(None)] * (len(self.shape) - len(self.index))
        base = index[dim].start or 0
        index[dim] = slice(base + start, base + start + length)
        shape = list(self.shape)
        shape[dim] = length
        return CheckpointSlice(self.source, self.dtype, tuple(shape), tuple(index))

    def materialize(self) -> torch.Tensor:
        data = self.source[self.index] if self.index else self.source[:]
        if not isinstance(data, torch.Tensor):
            data = torch.as_tensor(data)
        return data.reshape(self.shape).to(self.dtype)


def as_tensor(loaded: torch.Tensor | CheckpointSlice) -> torch.Tensor:
    """The tensor itself, or the lazily read slice materialised."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded.materialize()
