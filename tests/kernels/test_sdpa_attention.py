"""The SDPA prefill candidate: same answers as the float64 loops on fresh prompts, chunks after
cached context, windows and GQA, mixed in one batch."""

from __future__ import annotations

import pytest
import torch
from baton_serve.kernels import reference, sdpa_attention


def _args(b) -> tuple:
    return b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, b.scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim,ratio", [(64, 3), (32, 1), (16, 4)])
@pytest.mark.parametrize("window", [None, 5, 40])
def test_sdpa_prefill_matches_float64(kt, dtype, head_dim: int, ratio: int, window: int | None) -> None:
    # (cached context before the chunk, chunk length): fresh prompts and continued chunks together
    parts = [(0, 1), (0, 37), (16, 1), (45, 20), (0, 130), (7, 64)]
    b = kt.make_paged_batch(head_dim + ratio, [c + q for c, q in parts], [q for _, q in parts], 2 * ratio, 2,
                            head_dim, 16, dtype)
    got = sdpa_attention.paged_prefill_attention(*_args(b), window)
    assert got.shape == b.query.shape and got.dtype == dtype
    kt.assert_close(got, kt.naive_paged_attention(b, window), dtype, "vs float64")
    kt.assert_close(got, reference.paged_prefill_attention(*_args(b), window), dtype, "vs reference")


def test_sdpa_prefill_skips_empty_chunks(kt) -> None:
    b = kt.make_paged_batch(3, [10, 12], [10, 0], 4, 2, 32, 16, torch.float32)
    got = sdpa_attention.paged_prefill_attention(*_args(b), None)
    kt.assert_close(got, kt.naive_paged_attention(b, None), torch.float32, "vs float64")
