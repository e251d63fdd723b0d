"""Triton paged decode/prefill attention against the torch reference and float64 ground truth.

Runs under the Triton interpreter on CPU, or compiled on CUDA when present (see conftest). Every
output and scratch buffer the launchers allocate starts as NaN, unused cache slots hold NaN and
block-table padding is invalid, so unwritten outputs and reads outside a context both fail.
"""

from __future__ import annotations

import pytest
import torch
from baton_serve.kernels import reference as ref


def _decode_args(b) -> tuple:
    return b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.scale


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode(triton_ops, kt, device, decode_case, num_splits: int) -> None:
    b = decode_case.batch()
    window = decode_case.sliding_window
    with kt.poisoned():
        got = triton_ops.paged_decode_attention(*_decode_args(b.to(device)), window, None, num_splits)
    assert got.shape == b.query.shape and got.dtype == b.query.dtype
    kt.assert_close(got, kt.naive_paged_attention(b, window), b.query.dtype, "vs float64")
    kt.assert_close(got, ref.paged_decode_attention(*_decode_args(b), window), b.query.dtype, "vs reference")


def test_decode_auto_split_long_context(triton_ops, kt, device) -> None:
    """One sequence, one kv head, long context: the heuristic must pick split-K on its own."""
    from baton_serve.kernels.triton_decode import _auto_splits

    b = kt.make_paged_batch(7, [1100], [1], 3, 1, 16, 32, torch.float32).to(device)
    assert _auto_splits(b.query, 1, b.block_tables.shape[1] * 32) > 1
    assert _auto_splits(b.query.expand(1024, -1, -1), 8, 4096) == 1  # enough sequences: one pass
    with kt.poisoned():
        got = triton_ops.paged_decode_attention(*_decode_args(b))
    kt.assert_close(got, kt.naive_paged_attention(b, None), torch.float32, "auto split")


def test_decode_more_splits_than_tiles(triton_ops, kt, device) -> None:
    """Splits that get no keys must merge as weight 0, not NaN."""
    b = kt.make_paged_batch(8, [3, 70], [1, 1], 2, 1, 16, 8, torch.bfloat16)
    with kt.poisoned():
        got = triton_ops.paged_decode_attention(*_decode_args(b.to(device)), 50, None, 9)
    kt.assert_close(got, kt.naive_paged_attention(b, 50), torch.bfloat16, "9 splits")


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_empty_sequence_gives_zeros(triton_ops, kt, device, num_splits: int) -> None:
    """Padding sequences (seq_len 0, e.g. a padded CUDA-graph batch) yield zeros, not NaN."""
    b = kt.make_paged_batch(11, [0, 9], [1, 1], 2, 1, 16, 8, torch.float32)
    with kt.poisoned():
        got = triton_ops.paged_decode_attention(*_decode_args(b.to(device)), None, None, num_splits)
    assert torch.equal(got[0].cpu(), torch.zeros(2, 16))
    kt.assert_close(got[1:], kt.naive_paged_attention(b, None)[1:], torch.float32, "non-empty")


def _prefill_args(b, window: int | None) -> tuple:
    return b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, b.scale, window


def test_prefill(triton_ops, kt, device, prefill_case) -> None:
    b = prefill_case.batch()
    window = prefill_case.sliding_window
    args = _prefill_args(b, window)
    with kt.poisoned():
        got = triton_ops.paged_prefill_attention(*_prefill_args(b.to(device), window))
    assert got.shape == b.query.shape and got.dtype == b.query.dtype
    kt.assert_close(got, kt.naive_paged_attention(b, window), b.query.dtype, "vs float64")
    kt.assert_close(got, ref.paged_prefill_attention(*args), b.query.dtype, "vs reference")


def test_strided_query_views(triton_ops, kt, device) -> None:
    """Queries sliced out of a fused qkv projection are strided views; results must not change."""
    want = kt.naive_paged_attention(kt.make_paged_batch(9, [9, 40], [9, 1], 6, 2, 16, 16, torch.float32),
                                    None)
    b = kt.make_paged_batch(9, [9, 40], [9, 1], 6, 2, 16, 16, torch.float32).to(device)
    qkv = torch.randn(b.query.shape[0], 10, 16, device=device)
    qkv[:, :6] = b.query
    q = qkv[:, :6]
    assert not q.is_contiguous()
    with kt.poisoned():
        got = triton_ops.paged_prefill_attention(q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens,
                                                 b.query_start_loc, b.scale)
    kt.assert_close(got, want, torch.float32, "prefill view")
    last = (b.query_start_loc[1:] - 1).long()
    with kt.poisoned():
        got = triton_ops.paged_decode_attention(q[last], b.k_cache, b.v_cache, b.block_tables,
                                                b.seq_lens, b.scale)
    kt.assert_close(got, want[last.cpu()], torch.float32, "decode view")
