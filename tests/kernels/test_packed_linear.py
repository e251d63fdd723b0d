"""Packed bf16 linear: the same numbers as ``F.linear``, and plain fallbacks where it does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import packed_linear
from workers.model.layers import ColumnParallelLinear, ParallelContext, RowParallelLinear

needs_packing = pytest.mark.skipif(packed_linear.pack(torch.zeros(8, 8, dtype=torch.bfloat16)) is None,
                                   reason="this CPU/torch has no oneDNN bf16 linear")


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_matches_f_linear_bit_for_bit(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if with_bias else None
    x = torch.randn(rows, 80, generator=g).bfloat16()
    packed = packed_linear.pack(w)
    assert packed is not None
    out = packed_linear.linear(x, w, packed, b)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    assert torch.equal(out, F.linear(x, w, b))


@needs_packing
def test_non_contiguous_input_rows():
    w = torch.randn(32, 16).bfloat16()
    x = torch.randn(5, 32).bfloat16()[:, :16]
    assert torch.equal(packed_linear.linear(x, w, packed_linear.pack(w)), F.linear(x, w))


def test_no_packing_outside_bf16_cpu(monkeypatch):
    assert packed_linear.pack(torch.randn(8, 8)) is None  # fp32 keeps the exact plain path
    monkeypatch.setenv("BATON_PACKED_LINEAR", "0")
    assert packed_linear.pack(torch.randn(8, 8).bfloat16()) is None
    monkeypatch.setenv("BATON_PACKED_LINEAR", "1")
    monkeypatch.setenv("BATON_KERNEL_BACKEND", "torch")
    assert packed_linear.pack(torch.randn(8, 8).bfloat16()) is None
    w = torch.randn(4, 8)
    x = torch.randn(2, 8)
    assert torch.equal(packed_linear.linear(x, w, None), F.linear(x, w))


@needs_packing
def test_parallel_linear_layers_use_the_packed_weight():
    ctx = ParallelContext()
    col = ColumnParallelLinear(24, [16, 8], bias=True, ctx=ctx, dtype=torch.bfloat16)
    row = RowParallelLinear(24, 12, bias=False, ctx=ctx, dtype=torch.bfloat16)
    for layer in (col, row):
        for p in layer.parameters():
            p.data.copy_(torch.randn_like(p, dtype=torch.float32).bfloat16())
    x = torch.randn(6, 24).bfloat16()
    plain = (col(x), row(x))
    col.pack_weights()
    row.pack_weights()
    assert col.packed is not None and row.packed is not None
    assert torch.equal(col(x), plain[0]) and torch.equal(row(x), plain[1])
