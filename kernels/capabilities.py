"""What this machine's CPU can do, decided in one place: ISA level, native bf16/fp16 dot products,
AMX, usable cores, and the instruction sets a compiled kernel library may use here.

Everything else asks this module (the kernel build, the dtype and thread defaults) so that code,
defaults and tests follow the CPU they run on, never the one that wrote them.
"""

from __future__ import annotations

import logging
import os
import platform
import threading
from dataclasses import dataclass
from functools import cache

log = logging.getLogger("baton.kernels")

# Compiler macros of instruction sets a kernel build may use -> the /proc/cpuinfo flag the CPU
# must show to run it. A library whose macros name a flag this CPU lacks is never loaded.
MACRO_FLAGS = {
    "__SSE4_2__": "sse4_2", "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c",
    "__BMI2__": "bmi2", "__AVXVNNI__": "avx_vnni",
    "__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw", "__AVX512DQ__": "avx512dq",
    "__AVX512VL__": "avx512vl", "__AVX512CD__": "avx512cd", "__AVX512VNNI__": "avx512_vnni",
    "__AVX512BF16__": "avx512_bf16", "__AVX512FP16__": "avx512_fp16",
    "__AMX_TILE__": "amx_tile", "__AMX_BF16__": "amx_bf16", "__AMX_INT8__": "amx_int8",
    # aarch64 (flags from the "Features" line)
    "__ARM_FEATURE_DOTPROD": "asimddp", "__ARM_FEATURE_FP16_VECTOR_ARITHMETIC": "asimdhp",
    "__ARM_FEATURE_BF16_VECTOR_ARITHMETIC": "bf16", "__ARM_FEATURE_MATMUL_INT8": "i8mm",
    "__ARM_FEATURE_SVE": "sve",
}

_X86_V2 = {"sse4_2", "popcnt", "ssse3"}
_X86_V3 = _X86_V2 | {"avx", "avx2", "fma", "f16c", "bmi2", "movbe"}
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}


@dataclass(frozen=True)
class CpuInfo:
    """The CPU as the kernels see it."""

    arch: str  # platform.machine(): x86_64, aarch64, ...
    model_name: str
    flags: frozenset[str]
    cores: int  # usable by this process (its affinity mask)

    @property
    def isa_level(self) -> str:
        """x86-64 micro-architecture level (``x86-64-v4`` = AVX-512, ``-v3`` = AVX2 + FMA) or the arch."""
        if self.arch not in ("x86_64", "AMD64"):
            return self.arch
        for level, needed in (("x86-64-v4", _X86_V4), ("x86-64-v3", _X86_V3), ("x86-64-v2", _X86_V2)):
            if needed <= self.flags:
                return level
        return "x86-64"

    @property
    def amx(self) -> bool:
        return "amx_bf16" in self.flags

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware (AVX512_BF16, AMX, Arm BF16): elsewhere bf16 math is emulated."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags) or (self.arch == "aarch64" and "bf16" in self.flags)

    @property
    def native_fp16(self) -> bool:
        """fp16 arithmetic in hardware (AVX512_FP16, AMX-FP16, Arm FP16 vectors)."""
        return bool({"avx512_fp16", "amx_fp16"} & self.flags) or (self.arch == "aarch64" and "asimdhp" in self.flags)

    def missing(self, required: set[str]) -> set[str]:
        """The flags of ``required`` this CPU does not have."""
        return set(required) - self.flags

    def describe(self) -> str:
        return (f"{self.model_name or 'unknown CPU'} ({self.arch}, {self.isa_level}), {self.cores} usable cores, "
                f"bf16 dot {'native' if self.native_bf16 else 'emulated'}, "
                f"fp16 {'native' if self.native_fp16 else 'emulated'}, AMX {'yes' if self.amx else 'no'}")


def _read_cpuinfo(path: str = "/proc/cpuinfo") -> tuple[str, frozenset[str]]:
    model, flags = "", set()
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "hardware", "cpu model") and not model:
                    model = value.strip()
                elif key in ("flags", "features") and not flags:  # x86 "flags", aarch64 "Features"
                    flags = set(value.split())
    except OSError:  # not Linux: no flags, so only portable builds and fp32
        pass
    return model, frozenset(flags)


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@cache
def cpu() -> CpuInfo:
    """This machine's CPU, read once per process."""
    model, flags = _read_cpuinfo()
    return CpuInfo(arch=platform.machine(), model_name=model, flags=flags, cores=usable_cores())


def kernel_target() -> str:
    """The ``-march`` the native kernels are built for: ``native`` unless ``BATON_CPU_TARGET`` names
    another (e.g. ``x86-64-v3`` to run the AVX2 paths on an AVX-512 machine)."""
    return os.environ.get("BATON_CPU_TARGET", "").strip() or "native"


_logged = threading.Event()


def log_once(chosen: str = "") -> None:
    """Log the machine's capabilities, and what they chose, once per process."""
    if not _logged.is_set():
        _logged.set()
        log.info("CPU: %s%s", cpu().describe(), f"; {chosen}" if chosen else "")
