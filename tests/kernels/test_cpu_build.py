"""The kernel build is keyed by the ISA its target resolves to, and a library that uses
instructions this CPU lacks is never loaded, whether it would be built or found in the cache."""

from __future__ import annotations

import dataclasses
import platform
import shutil

import pytest
from baton_serve.kernels import capabilities, cpu_build, cpu_ops

x86_only = pytest.mark.skipif(platform.machine() != "x86_64", reason="the targets below are x86-64 levels")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    return tmp_path / "kernels"


def _cpu_with(monkeypatch, flags: set[str]) -> None:
    """Pretend this CPU has only ``flags``."""
    fake = dataclasses.replace(capabilities.cpu(), flags=frozenset(flags))
    monkeypatch.setattr(capabilities, "cpu", lambda: fake)


@x86_only
def test_the_cache_key_follows_the_isa_the_target_resolves_to(cache) -> None:
    cc = cpu_build.compiler()
    paths = {t: cpu_build.library_path(cpu_ops._SOURCES, t, cc, cpu_build.target_macros(cc, t))
             for t in ("x86-64", "x86-64-v3", "x86-64-v4")}
    assert len(set(paths.values())) == 3
    assert paths["x86-64"] == cpu_build.library_path(cpu_ops._SOURCES, "x86-64", cc,
                                                      cpu_build.target_macros(cc, "x86-64"))
    # native resolves to this CPU: AVX2 in the key exactly where the CPU has it
    native = cpu_build.target_macros(cc, "native")
    assert ("__AVX2__" in native) == ("avx2" in capabilities.cpu().flags)
    assert ("__AVX512F__" in native) == ("avx512f" in capabilities.cpu().flags)


@x86_only
def test_a_target_this_cpu_lacks_is_refused_before_anything_is_built(cache, monkeypatch) -> None:
    _cpu_with(monkeypatch, {"sse2", "sse4_2", "popcnt", "ssse3"})
    with pytest.raises(cpu_build.UnsupportedTarget, match="avx2"):
        cpu_build.build(cpu_ops._SOURCES, cpu_ops._SIGNATURES, "x86-64-v3")
    assert not cache.exists() or not list(cache.iterdir())


@x86_only
def test_a_cached_library_compiled_for_another_cpu_is_never_loaded(cache, monkeypatch) -> None:
    """A v3 (AVX2) build sitting at the baseline build's path, as a cache shared with another
    machine or a hand-copied file would leave it: the loader reads what the library was compiled
    with and refuses it on a CPU without AVX2, before any kernel runs."""
    if not {"avx2", "fma"} <= capabilities.cpu().flags:
        pytest.skip("needs an AVX2 CPU to build the v3 library for real")
    v3 = cpu_build.build(cpu_ops._SOURCES, cpu_ops._SIGNATURES, "x86-64-v3")
    assert "AVX2" in cpu_build.isa(v3).split()
    cc = cpu_build.compiler()
    v3_path = cpu_build.library_path(cpu_ops._SOURCES, "x86-64-v3", cc, cpu_build.target_macros(cc, "x86-64-v3"))
    base_path = cpu_build.library_path(cpu_ops._SOURCES, "x86-64", cc, cpu_build.target_macros(cc, "x86-64"))
    shutil.copy(v3_path, base_path)
    _cpu_with(monkeypatch, {"sse2", "sse4_2", "popcnt", "ssse3"})
    with pytest.raises(cpu_build.UnsupportedTarget, match="avx2"):
        cpu_build.build(cpu_ops._SOURCES, cpu_ops._SIGNATURES, "x86-64")


def test_the_native_build_reports_the_isa_of_this_cpu(cache) -> None:
    lib = cpu_build.build(cpu_ops._SOURCES, cpu_ops._SIGNATURES, "native")
    names = set(cpu_build.isa(lib).split())
    flags = capabilities.cpu().flags
    if platform.machine() == "x86_64":
        assert ("AVX2" in names) == ("avx2" in flags)
        assert ("AVX512F" in names) == ("avx512f" in flags)
        assert ("AVX512BF16" in names) == ("avx512_bf16" in flags)
    assert cpu_build.required_flags({f"__{n}__" for n in names} | {f"__{n}" for n in names}) <= flags


def test_without_a_compiler_the_ops_fall_back_to_the_reference(cache, monkeypatch, caplog) -> None:
    monkeypatch.setenv("CC", str(cache / "no-such-cc"))
    monkeypatch.setattr(cpu_ops, "_lib", None)
    monkeypatch.setattr(cpu_ops, "_failed", False)
    monkeypatch.setattr(cpu_ops, "_built", {})
    assert cpu_ops.library() is None and not cpu_ops.available()
    assert "using the torch reference" in caplog.text


def test_baton_cpu_target_chooses_the_build(monkeypatch) -> None:
    monkeypatch.setenv("BATON_CPU_TARGET", "x86-64-v3")
    assert capabilities.kernel_target() == "x86-64-v3"
    monkeypatch.delenv("BATON_CPU_TARGET")
    assert capabilities.kernel_target() == "native"


@pytest.mark.parametrize("march", ["armv8-a", "armv8.6-a+bf16"])
def test_the_kernels_build_for_aarch64(tmp_path, march: str) -> None:
    """aarch64 gets the portable vector code (NEON); a cross compiler checks it builds here."""
    import subprocess

    cc = shutil.which("aarch64-linux-gnu-gcc")
    if cc is None:
        pytest.skip("no aarch64 cross compiler (apt install gcc-aarch64-linux-gnu)")
    out = tmp_path / "k.so"
    subprocess.run([cc, *cpu_build.FLAGS, f"-march={march}", "-o", str(out), *map(str, cpu_ops._SOURCES), "-lm"],
                   check=True, capture_output=True, text=True)
    assert out.stat().st_size > 0
