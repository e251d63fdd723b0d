"""The native CPU decode-attention kernel against float64 ground truth and the torch reference.

Same case list as the Triton tests: every block size, GQA ratios 1/3/8, fp32/bf16, one-token
sequences, contexts ending on a block boundary, sliding windows, NaN in every unused cache slot
and invalid block-table padding (the kernel must never read past a sequence's length).
"""

from __future__ import annotations

import pytest
import torch

from kernels import backend, cpu_ops
from kernels import reference as ref

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler to build the native kernels")


def _args(b) -> tuple:
    return b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.scale


def test_decode_matches_float64_and_reference(kt, decode_case) -> None:
    b = decode_case.batch()
    window = decode_case.sliding_window
    if b.k_cache.dtype not in (torch.float32, torch.bfloat16):
        pytest.skip("fp16 caches use the reference")
    got = cpu_ops.paged_decode_attention(*_args(b), window)
    assert got.shape == b.query.shape and got.dtype == b.query.dtype
    assert torch.isfinite(got).all()
    kt.assert_close(got, kt.naive_paged_attention(b, window), b.query.dtype, "vs float64")
    kt.assert_close(got, ref.paged_decode_attention(*_args(b), window), b.query.dtype, "vs reference")


def test_backend_picks_native_on_cpu(monkeypatch) -> None:
    monkeypatch.delenv("BATON_KERNEL_BACKEND", raising=False)
    assert backend.select("paged_decode_attention", torch.device("cpu")) is cpu_ops.paged_decode_attention
    monkeypatch.setenv("BATON_KERNEL_BACKEND", "torch")
    assert backend.select("paged_decode_attention", torch.device("cpu")) is ref.paged_decode_attention


def test_unsupported_dtype_falls_back_to_reference(kt) -> None:
    b = kt.make_paged_batch(3, [5, 17], [1, 1], 4, 2, 8, 16, torch.float16)
    got = cpu_ops.paged_decode_attention(*_args(b))
    kt.assert_close(got, kt.naive_paged_attention(b, None), torch.float16, "fp16 fallback")


def test_loading_the_library_keeps_ieee_subnormals() -> None:
    """A shared object built with -ffast-math would switch on flush-to-zero process-wide."""
    import numpy as np

    assert cpu_ops.library() is not None
    tiny = np.float32(1e-38) * np.float32(1e-3)  # a subnormal result
    assert tiny != 0.0
