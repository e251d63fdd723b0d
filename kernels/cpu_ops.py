"""Native CPU kernels (C + OpenMP, loaded with ctypes), built once per machine with the system
compiler. The torch reference stays the ground truth; when no compiler is available the
backend silently keeps using it.

Decode attention dominates a CPU decode step at batch sizes that matter (the KV read is several
times the weights): the reference gathers every sequence's blocks into a padded copy, this kernel
reads each K/V row once, in place, and skips the padding.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("baton.kernels")
_SOURCE = Path(__file__).with_name("cpu") / "paged_attention.c"
# No -ffast-math: linking it into a shared object sets flush-to-zero for the whole process.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
          "-fassociative-math", "-fno-signed-zeros", "-ffp-contract=fast",
          "-shared", "-fPIC"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed = False


def _cache_dir() -> Path:
    root = os.environ.get("BATON_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "baton")
    return Path(root) / "kernels"


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler found")
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join([cc, *_FLAGS]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"baton_cpu_{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            subprocess.run([cc, *_FLAGS, "-o", str(out), str(_SOURCE), "-lm"], check=True,
                           capture_output=True, text=True)
            os.replace(out, target)  # atomic: concurrent builders each install a complete file
    lib = ctypes.CDLL(str(target))
    for name in ("paged_decode_bf16", "paged_decode_f32"):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled kernels, building them on first use; None when that is not possible here."""
    global _lib, _failed
    if _lib is not None or _failed:
        return _lib
    with _lock:
        if _lib is None and not _failed:
            try:
                _lib = _build()
            except Exception as exc:  # no compiler, or it failed: fall back to the reference
                _failed = True
                detail = getattr(exc, "stderr", "") or exc
                log.warning("native CPU kernels unavailable, using the torch reference: %s", detail)
    return _lib


def available() -> bool:
    return library() is not None


_KERNELS = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}


def supports(k_cache: torch.Tensor) -> bool:
    return (k_cache.device.type == "cpu" and k_cache.dtype in _KERNELS and k_cache.is_contiguous()
            and k_cache.shape[1] <= 128 and k_cache.shape[3] <= 256 and available())


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Same contract as ``kernels.reference.paged_decode_attention``; fp32 accumulation."""
    from kernels import reference

    num_seqs, hq, d = query.shape
    hkv = k_cache.shape[2]
    if not supports(k_cache) or hq % hkv or hq // hkv > 16 or num_seqs == 0:
        return reference.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale,
                                                sliding_window, max_seq_len, num_splits)
    lib = library()
    q = query.float().contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty((num_seqs, hq, d), dtype=torch.float32)
    getattr(lib, _KERNELS[k_cache.dtype])(
        q.data_ptr(), k_cache.data_ptr(), v_cache.contiguous().data_ptr(), tables.data_ptr(),
        lens.data_ptr(), out.data_ptr(), num_seqs, hq, hkv, d, k_cache.shape[1], tables.shape[1],
        float(scale), int(sliding_window or 0), torch.get_num_threads())
    return out.to(query.dtype)
