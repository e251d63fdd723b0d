"""One place reads the CPU: ISA level, native bf16, AMX and cores, from /proc/cpuinfo as each CPU
kind the project meets writes it."""

from __future__ import annotations

import pytest
from baton_serve.kernels import capabilities
from baton_serve.kernels.capabilities import CpuInfo

_V3 = "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx avx2 fma f16c bmi1 bmi2 movbe"
ZEN3 = f"model name\t: AMD EPYC 7B13\nflags\t\t: {_V3} vaes vpclmulqdq\n"
ZEN4 = f"model name\t: AMD EPYC 9B14\nflags\t\t: {_V3} avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16\n"
SPR = (f"model name\t: Intel(R) Xeon(R) Platinum 8481C\nflags\t\t: {_V3} avx512f avx512dq avx512cd avx512bw "
       "avx512vl avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8\n")
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes crc32 asimdhp asimddp sve bf16 i8mm\n"
OLD = "model name\t: Some Core 2\nflags\t\t: fpu sse sse2 ssse3\n"


@pytest.mark.parametrize("text,arch,level,bf16,fp16,amx", [
    (ZEN3, "x86_64", "x86-64-v3", False, False, False),
    (ZEN4, "x86_64", "x86-64-v4", True, False, False),
    (SPR, "x86_64", "x86-64-v4", True, True, True),
    (GRAVITON3, "aarch64", "aarch64", True, True, False),
    (OLD, "x86_64", "x86-64", False, False, False),
], ids=["zen3", "zen4", "sapphire-rapids", "graviton3", "core2"])
def test_cpu_kinds(tmp_path, text: str, arch: str, level: str, bf16: bool, fp16: bool, amx: bool) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    model, flags = capabilities._read_cpuinfo(str(path))
    info = CpuInfo(arch=arch, model_name=model, flags=flags, cores=2)
    assert (info.isa_level, info.native_bf16, info.native_fp16, info.amx) == (level, bf16, fp16, amx)
    assert info.isa_level in info.describe() and "2 usable cores" in info.describe()


def test_this_machine_is_read_once_and_names_what_it_has() -> None:
    info = capabilities.cpu()
    assert info is capabilities.cpu()
    assert 1 <= info.cores <= (__import__("os").cpu_count() or 1)
    if info.arch == "x86_64":
        assert info.flags, "no CPU flags read from /proc/cpuinfo"
        assert info.native_bf16 == bool({"avx512_bf16", "amx_bf16"} & info.flags)


def test_missing_names_flags_this_cpu_lacks() -> None:
    info = CpuInfo(arch="x86_64", model_name="x", flags=frozenset({"avx2", "fma"}), cores=1)
    assert info.missing({"avx2", "avx512f"}) == {"avx512f"}
