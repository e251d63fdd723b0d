"""``benchmarks/gpu_check.py`` runs end to end: its CPU smoke mode under the Triton interpreter,
its no-CUDA skip path, and (GPU only) its real-size correctness checks on compiled kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from baton_serve.kernels import backend

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # keep the shared CPU cores for others
    env.pop("TRITON_INTERPRET", None)  # conftest sets it; the script decides for itself
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=SCRIPT.parents[1])


def test_interpret_smoke(triton_ops, tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    proc = _run("--interpret-smoke", "--out", str(out), timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["mode"] == "interpret-smoke" and result["all_ok"]
    prefixes = {op: op for op in backend._OPS}
    prefixes.update(paged_decode_attention="decode", paged_prefill_attention="prefill")
    for op, prefix in prefixes.items():  # every public kernel is checked by the script
        assert any(name.startswith(prefix) for name in result["checks"]), op
    for name in ("decode_splitsNone", "decode_long_splitsNone", "prefill", "device_copy", "rms_norm"):
        assert result["timings"][name]["triton_ms"] > 0, name
    assert "fraction_of_copy_bw" in result["timings"]["decode_splitsNone"]
    assert "tflop_per_s" in result["timings"]["prefill"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip path only exists without CUDA")
def test_skips_cleanly_without_cuda(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    proc = _run("--out", str(out), timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped" in proc.stdout
    assert not out.exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled, real sizes)")
def test_real_sizes_on_gpu(tmp_path: Path) -> None:
    """Compiled kernels vs the reference at 64 x 4k context, 32/8 heads, d128, bf16, block 16."""
    out = tmp_path / "gpu_check.json"
    proc = _run("--checks-only", "--out", str(out), timeout=300)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["mode"] == "cuda" and result["all_ok"], result["checks"]
