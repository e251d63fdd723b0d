"""The torch reference kernels against naive float64 implementations (no Triton needed).

Attention runs on the shared randomised cases (block sizes 8/16/32, GQA 1/3/8, fp32/bf16/fp16,
one-token sequences, block-boundary contexts, sliding windows) whose unused cache slots hold NaN
and whose block tables are padded with invalid ids, plus hypothesis-drawn shapes.
"""

from __future__ import annotations

import pytest
import torch
from baton_serve.kernels import reference as ref
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

DTYPES = [torch.float32, torch.bfloat16]


def test_decode_matches_naive(decode_case, kt) -> None:
    b = decode_case.batch()
    got = ref.paged_decode_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.scale,
                                     decode_case.sliding_window)
    kt.assert_close(got, kt.naive_paged_attention(b, decode_case.sliding_window), b.query.dtype, "decode")


def test_decode_hint_and_num_splits_do_not_change_result(kt) -> None:
    b = kt.make_paged_batch(3, [5, 17, 32], [1, 1, 1], 4, 2, 16, 16, torch.float32)
    args = (b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.scale)
    base = ref.paged_decode_attention(*args)
    torch.testing.assert_close(ref.paged_decode_attention(*args, None, 40, num_splits=4), base)


def test_prefill_matches_naive(prefill_case, kt) -> None:
    b = prefill_case.batch()
    got = ref.paged_prefill_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens,
                                      b.query_start_loc, b.scale, prefill_case.sliding_window)
    kt.assert_close(got, kt.naive_paged_attention(b, prefill_case.sliding_window), b.query.dtype, "prefill")


@st.composite
def _paged_shapes(draw: st.DrawFn) -> dict:
    block_size = draw(st.sampled_from([8, 16, 32]))
    num_seqs = draw(st.integers(1, 4))
    ctx = draw(st.lists(st.one_of(st.integers(0, 70), st.integers(0, 4).map(lambda m: m * block_size)),
                        min_size=num_seqs, max_size=num_seqs))
    q = draw(st.lists(st.integers(1, 12), min_size=num_seqs, max_size=num_seqs))
    return dict(
        seed=draw(st.integers(0, 2**16)), block_size=block_size,
        ratio=draw(st.sampled_from([1, 3, 8])), num_kv_heads=draw(st.integers(1, 2)),
        head_dim=draw(st.sampled_from([8, 12, 16])), dtype=draw(st.sampled_from(DTYPES)),
        seq_lens=[c + n for c, n in zip(ctx, q)], q_lens=q,
        window=draw(st.one_of(st.none(), st.integers(1, 80))),
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_paged_shapes())
def test_attention_random_shapes(kt, shapes: dict) -> None:
    s = shapes
    b = kt.make_paged_batch(s["seed"], s["seq_lens"], s["q_lens"], s["ratio"] * s["num_kv_heads"],
                            s["num_kv_heads"], s["head_dim"], s["block_size"], s["dtype"])
    want = kt.naive_paged_attention(b, s["window"])
    got = ref.paged_prefill_attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens,
                                      b.query_start_loc, b.scale, s["window"])
    kt.assert_close(got, want, s["dtype"], "prefill")
    # The last query of every chunk is exactly a decode query.
    last = (b.query_start_loc[1:] - 1).long()
    got = ref.paged_decode_attention(b.query[last], b.k_cache, b.v_cache, b.block_tables, b.seq_lens,
                                     b.scale, s["window"])
    kt.assert_close(got, want[last], s["dtype"], "decode")


def test_write_kv_cache_skips_negative_slots() -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 6, 4, 2, 8, generator=gen).unbind(0)
    key, value = torch.randn(2, 5, 2, 8, generator=gen).unbind(0)
    slots = torch.tensor([3, -1, 23, 0, -5])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k[slot // 4, slot % 4], want_v[slot // 4, slot % 4] = key[t], value[t]
    ref.write_kv_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_block_gather_scatter_copy() -> None:
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(7, 4, 2, 8, generator=gen)
    ids = torch.tensor([5, 0, 3])
    got = ref.gather_kv_blocks(cache, ids)
    assert torch.equal(got, torch.stack([cache[i] for i in ids.tolist()]))

    buffer = torch.randn(3, 4, 2, 8, generator=gen)
    want = cache.clone()
    for j, i in enumerate(ids.tolist()):
        want[i] = buffer[j]
    ref.scatter_kv_blocks(cache, ids, buffer)
    assert torch.equal(cache, want)

    src, dst = torch.tensor([5, 1]), torch.tensor([2, 6])
    want = cache.clone()
    want[2], want[6] = cache[5], cache[1]
    ref.copy_blocks(cache, src, dst)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 48), (7, 100)])
def test_norms(kt, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(len(shape))
    x, residual = (torch.randn(*shape, generator=gen).to(dtype) for _ in range(2))
    weight = torch.randn(shape[-1], generator=gen).to(dtype)
    kt.assert_close(ref.rms_norm(x, weight, 1e-5), kt.naive_rms_norm(x, weight, 1e-5), dtype, "rms_norm")
    out, new_residual = ref.fused_add_rms_norm(x, residual, weight, 1e-5)
    summed = x.double() + residual.double()
    kt.assert_close(new_residual, summed, dtype, "residual")
    kt.assert_close(out, kt.naive_rms_norm(new_residual, weight, 1e-5), dtype, "fused norm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [32, 16])  # 16 of 32: partial rotary, the rest passes through
def test_rotary(kt, dtype: torch.dtype, is_neox: bool, rot_dim: int) -> None:
    gen = torch.Generator().manual_seed(rot_dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    table = ref.build_cos_sin_cache(rot_dim, 64, inv_freq)
    positions = torch.randint(0, 64, (9,), generator=gen)
    angles = positions.double()[:, None] * inv_freq[None, :]
    want_table = torch.cat((angles.cos(), angles.sin()), -1)
    torch.testing.assert_close(table[positions].double(), want_table, atol=1e-5, rtol=0)
    q = torch.randn(9, 6, 32, generator=gen).to(dtype)
    k = torch.randn(9, 2, 32, generator=gen).to(dtype)
    got_q, got_k = ref.rotary_embedding(positions, q, k, table, is_neox)
    kt.assert_close(got_q, kt.naive_rotary(positions, q, table, is_neox), dtype, "query")
    kt.assert_close(got_k, kt.naive_rotary(positions, k, table, is_neox), dtype, "key")
    assert torch.equal(got_q[..., rot_dim:], q[..., rot_dim:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(kt, dtype: torch.dtype) -> None:
    x = torch.randn(4, 3, 2 * 37, generator=torch.Generator().manual_seed(2)).to(dtype)
    kt.assert_close(ref.silu_and_mul(x), kt.naive_silu_and_mul(x), dtype, "silu_and_mul")


def test_decode_cases_cover_the_edges(decode_case) -> None:
    """Guard the shared case generator: the edge cases the kernels are specified for exist."""
    c = decode_case
    assert 1 in c.seq_lens and any(n % c.block_size == 0 for n in c.seq_lens)
    assert any(n % 2 for n in c.seq_lens) and max(c.seq_lens) > 128  # several 64-key tiles


def test_prefill_cases_cover_the_edges(prefill_case) -> None:
    c = prefill_case
    context = [n - q for n, q in zip(c.seq_lens, c.q_lens)]
    assert any(n == 0 for n in context)  # a whole prompt in one chunk
    assert any(q == 1 and n > 0 for n, q in zip(context, c.q_lens))  # one-token chunk
    assert any(n > 0 and n % c.block_size == 0 for n in context)  # context ends on a block edge
    assert max(c.q_lens) > 64  # several query tiles
