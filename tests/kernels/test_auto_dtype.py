"""dtype = "auto": fp32 where bf16 would be emulated, bf16 where the CPU has it natively and a
one-off microbenchmark agrees, the verdict cached per machine."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from baton_serve.kernels import auto_dtype, capabilities


@pytest.fixture
def cpu_kind(tmp_path, monkeypatch):
    """Pretend to be a CPU with the given flags; a fresh cache folder."""
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))

    def use(flags: set[str], model: str = "test CPU") -> None:
        fake = dataclasses.replace(capabilities.cpu(), flags=frozenset(flags), model_name=model)
        monkeypatch.setattr(capabilities, "cpu", lambda: fake)
    return use


def _no_measuring():
    raise AssertionError("measured")


def test_without_native_bf16_auto_is_fp32_without_measuring(cpu_kind, monkeypatch) -> None:
    cpu_kind({"avx", "avx2", "fma"})
    monkeypatch.setattr(auto_dtype, "measure", _no_measuring)
    choice = auto_dtype.resolve_dtype("auto")
    assert choice.dtype == "float32" and "emulated" in choice.reason


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16"])
def test_native_bf16_is_confirmed_by_measuring_once_then_cached(cpu_kind, monkeypatch, flag: str) -> None:
    cpu_kind({"avx2", "avx512f", flag})
    monkeypatch.setattr(auto_dtype, "measure", lambda: (10.0, 4.0))
    first = auto_dtype.resolve_dtype("auto")
    assert (first.dtype, first.fp32_ms, first.bf16_ms) == ("bfloat16", 10.0, 4.0)
    monkeypatch.setattr(auto_dtype, "measure", _no_measuring)
    assert auto_dtype.resolve_dtype("auto") == first  # the cached verdict


def test_native_bf16_that_measures_slower_stays_fp32(cpu_kind, monkeypatch) -> None:
    cpu_kind({"avx512f", "avx512_bf16"})
    monkeypatch.setattr(auto_dtype, "measure", lambda: (10.0, 12.0))
    choice = auto_dtype.resolve_dtype("auto")
    assert choice.dtype == "float32" and "slower" in choice.reason


def test_the_verdict_is_cached_per_cpu_kind(cpu_kind, monkeypatch) -> None:
    cpu_kind({"avx512f", "avx512_bf16"}, model="one CPU")
    monkeypatch.setattr(auto_dtype, "measure", lambda: (10.0, 4.0))
    assert auto_dtype.resolve_dtype("auto").dtype == "bfloat16"
    cpu_kind({"avx512f", "avx512_bf16"}, model="another CPU")  # another machine sharing the cache
    monkeypatch.setattr(auto_dtype, "measure", lambda: (10.0, 12.0))
    assert auto_dtype.resolve_dtype("auto").dtype == "float32"


def test_a_corrupt_cache_file_is_measured_again(cpu_kind, monkeypatch) -> None:
    cpu_kind({"avx512f", "avx512_bf16"})
    path = auto_dtype._cache_file(__import__("torch").get_num_threads())
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    monkeypatch.setattr(auto_dtype, "measure", lambda: (10.0, 4.0))
    assert auto_dtype.resolve_dtype("auto").dtype == "bfloat16"


def test_an_explicit_dtype_is_kept_and_a_wrong_one_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(auto_dtype, "measure", _no_measuring)
    for name in auto_dtype.DTYPES:
        assert auto_dtype.resolve_dtype(name) == auto_dtype.DtypeChoice(name, "set explicitly")
    with pytest.raises(ValueError, match="auto"):
        auto_dtype.resolve_dtype("int3")


def test_the_microbenchmark_times_both_dtypes() -> None:
    fp32_ms, bf16_ms = auto_dtype.measure()
    assert fp32_ms > 0 and bf16_ms > 0


def test_a_load_burst_during_the_microbenchmark_does_not_flip_the_verdict(monkeypatch) -> None:
    """Another process takes the cores for most of the measurement (here from the 6th pass on):
    the dtypes' passes alternate and the fastest counts, so bf16 (4x faster unloaded) still wins."""
    calls = []

    def one_pass(pairs) -> float:
        calls.append(pairs[0][0].dtype)
        base = 1.0 if pairs[0][0].dtype == torch.bfloat16 else 4.0
        return base * (10.0 if len(calls) > 5 else 1.0)

    monkeypatch.setattr(auto_dtype, "_one_pass", one_pass)
    fp32_ms, bf16_ms = auto_dtype.measure(repeats=7)
    assert (fp32_ms, bf16_ms) == (4.0, 1.0)
    assert calls[:6] == [torch.float32, torch.bfloat16] * 3  # they take turns from the warm-up on
