"""Which device a worker computes on (kernels.device): auto, explicit CPU/CUDA, and the KV budget."""

from __future__ import annotations

import pytest
import torch
from baton_serve.kernels import device as device_mod
from baton_serve.kernels.device import (
    DeviceUnavailableError,
    check_device_name,
    kv_cache_bytes,
    resolve_device,
)


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: f"Fake GPU {i}")


def test_cpu_is_always_the_cpu(monkeypatch):
    _fake_cuda(monkeypatch, 2)
    assert resolve_device("cpu").device == torch.device("cpu")


def test_auto_takes_the_first_visible_cuda_device_else_the_cpu(monkeypatch):
    _fake_cuda(monkeypatch, 2)
    choice = resolve_device("auto")
    assert choice.device == torch.device("cuda", 0) and choice.is_cuda and "Fake GPU 0" in choice.reason
    _fake_cuda(monkeypatch, 0)
    choice = resolve_device("auto")
    assert choice.device == torch.device("cpu") and not choice.is_cuda and "no CUDA" in choice.reason


def test_cuda_without_a_device_is_an_error_naming_what_is_visible(monkeypatch):
    _fake_cuda(monkeypatch, 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(DeviceUnavailableError, match="CUDA_VISIBLE_DEVICES=.*device = 'cpu'"):
        resolve_device("cuda")


def test_cuda_index_must_be_visible(monkeypatch):
    _fake_cuda(monkeypatch, 2)
    assert resolve_device("cuda:1").device == torch.device("cuda", 1)
    with pytest.raises(DeviceUnavailableError, match="only 2 CUDA"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("name", ["gpu", "CUDA", "cuda:", "cuda:-1", "mps", ""])
def test_unknown_device_names_are_refused(name):
    with pytest.raises(ValueError, match="device must be"):
        check_device_name(name)


def test_kv_budget_is_the_share_less_weights_and_activations_within_what_is_free():
    gib = 1 << 30
    assert kv_cache_bytes(80 * gib, 0.9, 2 * gib, 1 * gib, 70 * gib) == 72 * gib - 3 * gib
    # a second worker on the same GPU gets its share only as far as the first left room
    assert kv_cache_bytes(80 * gib, 0.45, 2 * gib, 1 * gib, 50 * gib) == 36 * gib - 3 * gib
    assert kv_cache_bytes(80 * gib, 0.45, 2 * gib, 1 * gib, 20 * gib) == 19 * gib  # room left for activations
    assert kv_cache_bytes(8 * gib, 0.5, 4 * gib, 1 * gib, 4 * gib) == 0  # never negative
    for bad in (0.0, 1.01, -0.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            kv_cache_bytes(gib, bad, 0, 0, 0)


def test_this_machine_resolves_auto_to_what_torch_reports():
    want = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() else "cpu"
    assert device_mod.resolve_device("auto").device.type == want
