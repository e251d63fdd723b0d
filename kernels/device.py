"""Which device a worker computes on, decided in one place: ``auto`` takes the first CUDA device
this process can see (Ray sets ``CUDA_VISIBLE_DEVICES`` to the GPUs it granted the actor), else
the CPU. ``cuda`` without a usable CUDA device is an error at start, never a silent CPU run.

The KV cache on a GPU is sized like vLLM's ``gpu_memory_utilization``: the share of the device's
memory this worker may use, less the weights and a profiled activation peak, within what is free
(``kv_cache_bytes``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

DEVICE_NAMES = ("auto", "cpu", "cuda")
_CUDA_INDEX = re.compile(r"cuda:(\d+)")


class DeviceUnavailableError(RuntimeError):
    """The configured device is not present in this process."""


def check_device_name(name: str) -> None:
    """ValueError unless ``name`` is ``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    if name not in DEVICE_NAMES and not _CUDA_INDEX.fullmatch(name):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {name!r}")


@dataclass(frozen=True)
class DeviceChoice:
    """The resolved device and why it was chosen (logged once at start)."""

    device: torch.device
    reason: str

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def resolve_device(requested: str = "auto") -> DeviceChoice:
    """The concrete device for ``requested``; DeviceUnavailableError where CUDA is asked for and absent."""
    check_device_name(requested)
    if requested == "cpu":
        return DeviceChoice(torch.device("cpu"), "set explicitly")
    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    if requested == "auto":
        if count:
            return DeviceChoice(torch.device("cuda", 0), f"{count} CUDA device(s) visible: {_name(0)}")
        return DeviceChoice(torch.device("cpu"), "no CUDA device visible")
    index = int(requested.split(":", 1)[1]) if ":" in requested else 0
    if not count:
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise DeviceUnavailableError(f"engine.device = {requested!r}, but {why} (CUDA_VISIBLE_DEVICES="
                                     f"{_visible()}); use device = 'cpu' or 'auto', or give the worker a GPU")
    if index >= count:
        raise DeviceUnavailableError(f"engine.device = {requested!r}, but only {count} CUDA device(s) are visible")
    return DeviceChoice(torch.device("cuda", index), f"set explicitly: {_name(index)}")


def kv_cache_bytes(total: int, utilization: float, weights: int, activation_peak: int, free: int) -> int:
    """Bytes for the KV cache of a worker that may use ``utilization`` of a device of ``total``
    bytes (vLLM's per-instance ``gpu_memory_utilization``): its share less its weights and its
    activation peak, and never more than the device has ``free`` now less room for those
    activations (other workers sharing the GPU took theirs first). Never negative."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    share = int(total * utilization) - weights - activation_peak
    return max(min(share, free - activation_peak), 0)


def _name(index: int) -> str:
    try:
        return torch.cuda.get_device_name(index)
    except (RuntimeError, AssertionError):  # a driver that answers is_available() but not this
        return f"cuda:{index}"


def _visible() -> str:
    return os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
