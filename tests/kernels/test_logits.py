"""Upcasting bf16 logits: the native pass gives exactly the torch definition's fp32 values and
near-max candidates, ties included, and hands rows with too many ties back to torch."""

from __future__ import annotations

import pytest
import torch
from baton_serve.kernels import cpu_ops
from baton_serve.kernels.logits import upcast_with_candidates, upcast_with_candidates_torch

native = pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler for the native kernels")
pytestmark = pytest.mark.usefixtures("kernel_target")  # every build this CPU runs (see conftest)


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=g) * 4).bfloat16()
    for r in range(rows):  # plant near-ties at the top: the max, one ulp below, two below, three below
        top = x[r].float().max()
        cols = torch.randperm(vocab, generator=g)[:4]
        ulp = 2.0 ** (torch.floor(torch.log2(top.abs().clamp_min(1e-3))) - 7)
        x[r, cols] = torch.stack([top, top - ulp, top - 2 * ulp, top - 3 * ulp]).bfloat16()
    return x


@native
@pytest.mark.parametrize("rows,vocab", [(1, 49152), (7, 1000), (33, 4099), (3, 15)])
def test_native_matches_torch_exactly(rows: int, vocab: int) -> None:
    x = _logits(rows, vocab, rows + vocab)
    got = cpu_ops.logits_candidates(x, 2.0)
    assert got is not None
    want = upcast_with_candidates_torch(x, 2.0)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert len(got[1]) >= rows * 3  # the max and the two planted within 2 ulps, per row


@native
def test_many_ties_fall_back_to_torch() -> None:
    x = torch.zeros(2, 300, dtype=torch.bfloat16)  # every entry ties with the max
    assert cpu_ops.logits_candidates(x, 2.0) is None
    out, rows, cols = upcast_with_candidates(x, 2.0)
    assert out.dtype == torch.float32 and len(rows) == 600 and len(cols) == 600


def test_fp16_and_forced_torch_use_the_definition(monkeypatch) -> None:
    x = _logits(2, 100, 0).half()
    assert cpu_ops.logits_candidates(x, 2.0) is None
    out, rows, cols = upcast_with_candidates(x, 2.0)
    want = upcast_with_candidates_torch(x, 2.0)
    assert torch.equal(out, want[0]) and torch.equal(rows, want[1]) and torch.equal(cols, want[2])
    monkeypatch.setenv("BATON_KERNEL_BACKEND", "torch")
    y = _logits(2, 100, 1)
    got = upcast_with_candidates(y, 2.0)
    want = upcast_with_candidates_torch(y, 2.0)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
