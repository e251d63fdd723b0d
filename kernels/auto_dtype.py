"""``dtype = "auto"``: bf16 only where the CPU computes it natively, otherwise fp32.

Where bf16 is emulated (an AVX2-only CPU) torch's bf16 matmul ran at ~14 GFLOP/s against ~118 in
fp32 on 2 threads: an 8x slower prefill. The CPU flags decide first (AVX512_BF16, AMX, Arm BF16);
where they allow bf16, a one-off matmul microbenchmark at model-like shapes confirms that bf16 is
not slower than fp32 on this machine and torch build, and its verdict is cached per machine.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from baton_serve.kernels import capabilities

log = logging.getLogger("baton.kernels")
DTYPES = ("float32", "bfloat16", "float16")
# (rows, out, in): a decode batch and a prefill chunk through a 576 -> 1536 projection
_SHAPES = ((16, 1536, 576), (256, 1536, 576))


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a worker runs in and why (logged once at start)."""

    dtype: str
    reason: str
    fp32_ms: float | None = None  # the microbenchmark, where one ran
    bf16_ms: float | None = None


def _cache_file(threads: int) -> Path:
    info = capabilities.cpu()
    key = "\0".join([info.arch, info.model_name, *sorted(info.flags), torch.__version__, str(threads)])
    root = os.environ.get("BATON_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "baton")
    return Path(root) / "capabilities" / f"dtype_{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _pairs(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(m, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype))
            for m, n, k in _SHAPES]


def _one_pass(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    started = time.perf_counter()
    for x, w in pairs:
        torch.nn.functional.linear(x, w)
    return (time.perf_counter() - started) * 1e3


def measure(repeats: int = 7) -> tuple[float, float]:
    """(fp32 ms, bf16 ms): the fastest of ``repeats`` passes over ``_SHAPES`` in each dtype.

    The dtypes take turns pass by pass and the minimum counts: another process on the cores
    (a test run, a second worker starting) slows passes, never speeds one up, so it must not
    land on one dtype's passes only. One verdict taken under load (a 2-thread oneDNN pass with
    a core taken is 10x slower) was cached as fp32 on a machine where bf16 is 4x faster.
    """
    fp32, bf16 = _pairs(torch.float32), _pairs(torch.bfloat16)
    _one_pass(fp32), _one_pass(bf16)  # warm-up: oneDNN builds its kernels on the first call
    times: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(repeats):
        times[0].append(_one_pass(fp32))
        times[1].append(_one_pass(bf16))
    return min(times[0]), min(times[1])


def _read(path: Path) -> DtypeChoice | None:
    try:
        return DtypeChoice(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _benchmarked_choice() -> DtypeChoice:
    path = _cache_file(torch.get_num_threads())
    cached = _read(path)
    if cached is not None:
        return cached
    path.parent.mkdir(parents=True, exist_ok=True)
    # Workers starting together on one machine must agree (they exchange KV): the first measures,
    # the others wait on the lock and read its verdict.
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cached = _read(path)
        return cached if cached is not None else _measure_and_store(path)


def _measure_and_store(path: Path) -> DtypeChoice:
    fp32_ms, bf16_ms = measure()
    if bf16_ms <= fp32_ms:
        choice = DtypeChoice("bfloat16", f"native bf16 ({_native_what()}); bf16 matmuls {bf16_ms:.2f} ms vs "
                             f"fp32 {fp32_ms:.2f} ms", fp32_ms, bf16_ms)
    else:
        choice = DtypeChoice("float32", f"the CPU has {_native_what()} but torch's bf16 matmuls were slower "
                             f"here ({bf16_ms:.2f} ms vs fp32 {fp32_ms:.2f} ms)", fp32_ms, bf16_ms)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump(asdict(choice), f)
    os.replace(f.name, path)  # atomic: workers starting together each read a whole file
    return choice


def _native_what() -> str:
    flags = capabilities.cpu().flags
    return ", ".join(name for name, flag in (("AMX", "amx_bf16"), ("AVX512_BF16", "avx512_bf16"), ("Arm BF16", "bf16"))
                     if flag in flags) or "bf16"


def resolve_dtype(requested: str, device: str = "cpu") -> DtypeChoice:
    """The concrete dtype for ``requested`` ("auto" or one of ``DTYPES``) on ``device``."""
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {', '.join(DTYPES)}, got {requested!r}")
        return DtypeChoice(requested, "set explicitly")
    if device == "cuda":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return DtypeChoice("bfloat16", "CUDA device with bf16")
        return DtypeChoice("float16", "CUDA device without bf16")
    info = capabilities.cpu()
    if not info.native_bf16:
        return DtypeChoice("float32", f"no native bf16 on this CPU ({info.isa_level}): bf16 would be emulated")
    return _benchmarked_choice()
