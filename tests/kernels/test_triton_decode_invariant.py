"""Triton decode with a fixed split size (``split_keys``): a sequence's output is bitwise the same
whatever the other sequences of the batch, though their lengths change how many splits the grid
has. Under the interpreter on CPU, compiled on a GPU (the ``device`` fixture)."""

from __future__ import annotations

import pytest
import torch

triton_decode = pytest.importorskip("baton_serve.kernels.triton_decode")

BS, HQ, HKV, D = 16, 4, 2, 32


def _batch(lens: list[int], device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    per = max((n + BS - 1) // BS for n in lens)
    k = torch.randn(len(lens) * per, BS, HKV, D, generator=g)
    v = torch.randn(len(lens) * per, BS, HKV, D, generator=g)
    q = torch.randn(len(lens), HQ, D, generator=g)
    tables = torch.arange(len(lens) * per, dtype=torch.int32).view(len(lens), per)
    return [t.to(device) for t in (q, k, v, tables, torch.tensor(lens, dtype=torch.int32))]


def _decode(q, k, v, tables, lens, **kw):
    return triton_decode.paged_decode_attention(q, k, v, tables, lens, D**-0.5, **kw)


def test_fixed_split_output_does_not_depend_on_the_batch(device) -> None:
    q, k, v, tables, lens = _batch([200], device)
    alone = _decode(q, k, v, tables, lens, split_keys=64)
    for others in ([900], [70, 1500], [1000, 30, 2000]):
        qb, kb, vb, tb, lb = _batch([200] + others, device, seed=1)
        # the first sequence carries the same data in every batch
        per_b = tb.shape[1]
        kb, vb = kb.clone(), vb.clone()
        kb[:per_b].zero_()
        vb[:per_b].zero_()
        kb[:tables.shape[1]], vb[:tables.shape[1]] = k, v
        qb[0] = q[0]
        tb[0, :tables.shape[1]] = tables[0]
        got = _decode(qb, kb, vb, tb, lb, split_keys=64)[0]
        assert torch.equal(got, alone[0]), others


def test_fixed_split_matches_the_reference(device) -> None:
    from baton_serve.kernels import reference

    q, k, v, tables, lens = _batch([200, 700, 1], device, seed=2)
    got = _decode(q, k, v, tables, lens, split_keys=128)
    want = reference.paged_decode_attention(q.cpu(), k.cpu(), v.cpu(), tables.cpu(), lens.cpu(), D**-0.5)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="multiple of 64"):
        _decode(q, k, v, tables, lens, split_keys=100)
