"""The native CPU kernels against float64 ground truth and the torch reference.

Same case list as the Triton tests: every block size, GQA ratios 1/3/8, fp32/bf16, one-token
sequences, contexts ending on a block boundary, sliding windows, NaN in every unused cache slot
and invalid block-table padding (the kernel must never read past a sequence's length).

Every test runs once per kernel build this CPU can run (the ``kernel_target`` id: ``native``,
``x86-64-v3`` for the AVX2 + FMA paths, ``x86-64`` for the portable vector code that aarch64
also compiles), so each CPU kind's path is pinned by the same tests wherever they run.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from baton_serve.kernels import backend, cpu_ops
from baton_serve.kernels import reference as ref

_OPS = ("paged_decode_attention", "paged_prefill_attention", "rms_norm", "fused_add_rms_norm", "rotary_embedding",
        "silu_and_mul", "write_kv_cache", "argmax_rows")
pytestmark = [pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler to build the native kernels"),
              pytest.mark.usefixtures("kernel_target")]


@pytest.fixture
def native_only(monkeypatch) -> None:
    """Fail the test if ``cpu_ops`` hands the call to the reference instead of running natively."""
    def refuse(*args, **kwargs):
        raise AssertionError("fell back to the reference")

    monkeypatch.setattr(cpu_ops, "reference", SimpleNamespace(**{op: refuse for op in _OPS}))


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


# --- decode attention: long contexts and the vector kernel's specialisations -------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim,window", [(64, None), (128, None), (64, 700)])
def test_decode_long_contexts(kt, native_only, dtype, block_size: int, head_dim: int,
                              window: int | None) -> None:
    """Three 2000-token sequences (one ending mid-block): many blocks, many prefetches ahead."""
    b = kt.make_paged_batch(7, [2000, 1999, 2000 - block_size - 3], [1, 1, 1], 9, 3, head_dim,
                            block_size, dtype)
    got = cpu_ops.paged_decode_attention(*_args(b), window)
    assert got.shape == b.query.shape and got.dtype == dtype
    kt.assert_close(got, kt.naive_paged_attention(b, window), dtype, "vs float64")
    kt.assert_close(got, ref.paged_decode_attention(*_args(b), window), dtype, "vs reference")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [48, 80, 96, 256])  # generic-D vector path, or portable
@pytest.mark.parametrize("ratio", [1, 5, 16])  # query heads per KV head: 1..4 per tile and 4 full tiles
def test_decode_head_dims_and_group_sizes(kt, native_only, dtype, head_dim: int, ratio: int) -> None:
    b = kt.make_paged_batch(head_dim + ratio, [1, 37, 130], [1, 1, 1], 2 * ratio, 2, head_dim, 8, dtype)
    got = cpu_ops.paged_decode_attention(*_args(b))
    kt.assert_close(got, kt.naive_paged_attention(b, None), dtype, "vs float64")


def test_decode_rounds_an_fp32_query_to_a_bf16_cache_like_the_reference(kt) -> None:
    b = kt.make_paged_batch(5, [40, 3], [1, 1], 6, 2, 64, 16, torch.bfloat16)
    q32 = b.query.float() + 1e-3 * torch.randn(b.query.shape, generator=torch.Generator().manual_seed(0))
    args = (q32, *_args(b)[1:])
    got = cpu_ops.paged_decode_attention(*args)
    assert got.dtype == torch.float32
    kt.assert_close(got, ref.paged_decode_attention(*args), torch.bfloat16, "vs reference")


def test_decode_bf16_in_and_out_is_the_fp32_path_rounded(kt, native_only) -> None:
    """bf16 queries go to the kernel as they are and come back rounded there: bit for bit what
    the fp32 call followed by torch's rounding gives."""
    b = kt.make_paged_batch(7, [90, 3, 33, 16, 1], [1] * 5, 9, 3, 64, 16, torch.bfloat16)
    got = cpu_ops.paged_decode_attention(*_args(b))
    want = cpu_ops.paged_decode_attention(b.query.float(), *_args(b)[1:]).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


# --- prefill attention (fp32 and bf16 caches run natively; the rest is the reference) ------------

def _pargs(b) -> tuple:
    return b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, b.scale


def test_prefill_matches_float64_and_reference(kt, prefill_case) -> None:
    b = prefill_case.batch()
    window = prefill_case.sliding_window
    got = cpu_ops.paged_prefill_attention(*_pargs(b), window)
    assert got.shape == b.query.shape and got.dtype == b.query.dtype
    assert torch.isfinite(got).all()
    kt.assert_close(got, kt.naive_paged_attention(b, window), b.query.dtype, "vs float64")
    kt.assert_close(got, ref.paged_prefill_attention(*_pargs(b), window), b.query.dtype, "vs reference")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim,ratio", [(64, 3), (128, 1), (32, 4), (96, 2)])
@pytest.mark.parametrize("window", [None, 1, 37, 300])
def test_prefill_native(kt, native_only, dtype, block_size: int, head_dim: int, ratio: int,
                        window: int | None) -> None:
    """Fresh prompts and chunks after cached context; chunks longer than a task's 64 rows, rows
    not a multiple of 4, contexts ending mid-block, and windows inside and across key tiles."""
    # (context before the chunk, chunk length)
    parts = [(0, 1), (0, 7), (0, 130), (block_size * 3, 1), (45, 66), (200, 201), (5, 64)]
    b = kt.make_paged_batch(block_size + head_dim + (window or 0), [c + q for c, q in parts],
                            [q for _, q in parts], 2 * ratio, 2, head_dim, block_size, dtype)
    got = cpu_ops.paged_prefill_attention(*_pargs(b), window)
    assert got.dtype == dtype and torch.isfinite(got).all()
    kt.assert_close(got, kt.naive_paged_attention(b, window), dtype, "vs float64")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_long_context_chunk(kt, native_only, dtype) -> None:
    """A 512-token chunk after 1500 cached tokens: many tasks and a 2000-key sweep per row."""
    b = kt.make_paged_batch(11, [2012], [512], 9, 3, 64, 16, dtype)
    got = cpu_ops.paged_prefill_attention(*_pargs(b), None)
    kt.assert_close(got, kt.naive_paged_attention(b, None), dtype, "vs float64")


def test_prefill_fp16_and_odd_head_dims_use_the_reference(kt) -> None:
    b = kt.make_paged_batch(4, [30, 9], [30, 4], 4, 2, 36, 16, torch.bfloat16)
    got = cpu_ops.paged_prefill_attention(*_pargs(b), None)
    assert torch.equal(got, ref.paged_prefill_attention(*_pargs(b), None))  # d=36: the reference itself
    b = kt.make_paged_batch(4, [30, 9], [30, 4], 4, 2, 64, 16, torch.float16)
    got = cpu_ops.paged_prefill_attention(*_pargs(b), None)
    assert torch.equal(got, ref.paged_prefill_attention(*_pargs(b), None))  # fp16: the reference itself


# --- fused element-wise ops ---------------------------------------------------------------------

_DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
_TOKENS = pytest.mark.parametrize("tokens", [1, 3, 64, 257])


@_DTYPES
@_TOKENS
@pytest.mark.parametrize("hidden", [64, 576, 100])  # 100: a vector body and a scalar tail
def test_rms_norm(kt, native_only, dtype, tokens: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(tokens * hidden)
    x = (torch.randn(tokens, hidden, generator=gen) * 3).to(dtype)
    weight = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(dtype)
    with kt.poisoned():
        got = cpu_ops.rms_norm(x, weight, 1e-6)
    want = ref.rms_norm(x, weight, 1e-6)
    assert got.shape == want.shape and got.dtype == want.dtype
    kt.assert_close(got, kt.naive_rms_norm(x, weight, 1e-6), dtype, "vs float64")
    kt.assert_close(got, want, dtype, "vs reference")


@_DTYPES
@_TOKENS
@pytest.mark.parametrize("hidden", [64, 576])
def test_fused_add_rms_norm(kt, native_only, dtype, tokens: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    residual = (4 * torch.randn(tokens, hidden, generator=gen)).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    x0, r0 = x.clone(), residual.clone()
    with kt.poisoned():
        out, new_residual = cpu_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(x, x0) and torch.equal(residual, r0)  # pure, like the reference
    want_out, want_res = ref.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert out.dtype == want_out.dtype == new_residual.dtype and out.shape == want_out.shape
    assert torch.equal(new_residual, want_res)  # x + residual rounded once to the dtype: exact
    # The norm is of the rounded residual (one rounding per comparison on top of it).
    kt.assert_close(out, kt.naive_rms_norm(want_res, weight, 1e-5), dtype, "norm vs float64")
    kt.assert_close(out, want_out, dtype, "norm vs reference")


def test_bf16_rounding_of_special_values_matches_torch(native_only) -> None:
    """Ties to even, overflow to inf, NaN and subnormal sums: bit for bit what torch's add gives."""
    x = torch.tensor([1.0, 1.0, 3e38, float("inf"), float("nan"), 1e-39, -2e-39, 0.0] * 4).to(torch.bfloat16)
    r = torch.tensor([2**-8, 3 * 2**-8, 3e38, float("-inf"), 1.0, 1e-39, 1e-40, -0.0] * 4).to(torch.bfloat16)
    ones = torch.ones(32, dtype=torch.bfloat16)
    _, got = cpu_ops.fused_add_rms_norm(x.view(1, -1), r.view(1, -1), ones, 1e-6)
    want = (x + r).view(1, -1)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()].view(torch.int16), want[~want.isnan()].view(torch.int16))


@_DTYPES
@_TOKENS
@pytest.mark.parametrize("head_dim,ratio", [(64, 3), (128, 1), (64, 1)])
def test_rotary_embedding(kt, native_only, dtype, tokens: int, head_dim: int, ratio: int) -> None:
    gen = torch.Generator().manual_seed(tokens + head_dim + ratio)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    table = ref.build_cos_sin_cache(head_dim, 4096, inv_freq)
    positions = torch.randint(0, 4001, (tokens,), generator=gen)
    hkv = 2
    hq = ratio * hkv
    # q and k as strided views of one fused qkv projection, the way the model produces them.
    qkv = torch.randn(tokens, hq + 2 * hkv, head_dim, generator=gen).to(dtype)
    q, k = qkv[:, :hq], qkv[:, hq:hq + hkv]
    with kt.poisoned():
        got_q, got_k = cpu_ops.rotary_embedding(positions, q, k, table, True)
    want_q, want_k = ref.rotary_embedding(positions, q, k, table, True)
    for got, want, x, name in ((got_q, want_q, q, "query"), (got_k, want_k, k, "key")):
        assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
        kt.assert_close(got, kt.naive_rotary(positions, x, table, True), dtype, f"{name} vs float64")
        kt.assert_close(got, want, dtype, f"{name} vs reference")


@_DTYPES
@_TOKENS
@pytest.mark.parametrize("inter", [37, 64, 1536])
def test_silu_and_mul(kt, native_only, dtype, tokens: int, inter: int) -> None:
    x = (torch.randn(tokens, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4).to(dtype)
    with kt.poisoned():
        got = cpu_ops.silu_and_mul(x)
    want = ref.silu_and_mul(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    kt.assert_close(got, kt.naive_silu_and_mul(x), dtype, "vs float64")
    kt.assert_close(got, want, dtype, "vs reference")


def test_elementwise_keep_leading_dims(kt, native_only) -> None:
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    w = torch.ones(128, dtype=torch.bfloat16)
    kt.assert_close(cpu_ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), torch.bfloat16, "rms 3-d")
    assert cpu_ops.silu_and_mul(x).shape == (2, 3, 64)
    kt.assert_close(cpu_ops.silu_and_mul(x), ref.silu_and_mul(x), torch.bfloat16, "silu 3-d")


def test_mixed_weight_dtype_is_native(kt, native_only) -> None:
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    w = torch.randn(64, generator=torch.Generator().manual_seed(3))  # fp32 weight, bf16 activations
    got = cpu_ops.rms_norm(x, w, 1e-6)
    assert got.dtype == torch.bfloat16
    kt.assert_close(got, ref.rms_norm(x, w, 1e-6), torch.bfloat16, "fp32 weight")


def test_unhandled_inputs_fall_back_and_match(kt) -> None:
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(6, 160, generator=gen)
    w = torch.randn(48, generator=gen)
    view = base[:, :48]  # rows not adjacent: non-contiguous
    kt.assert_close(cpu_ops.rms_norm(view, w, 1e-6), kt.naive_rms_norm(view, w, 1e-6), torch.float32, "view")
    kt.assert_close(cpu_ops.silu_and_mul(base[:, :74]), kt.naive_silu_and_mul(base[:, :74]), torch.float32,
                    "silu view")
    half = base[:, :48].half()
    kt.assert_close(cpu_ops.rms_norm(half, w.half(), 1e-6), ref.rms_norm(half, w.half(), 1e-6), torch.float16,
                    "fp16")
    res32 = base[:, 48:96].contiguous()
    for got, want in zip(cpu_ops.fused_add_rms_norm(half.contiguous(), res32, w, 1e-6),
                         ref.fused_add_rms_norm(half.contiguous(), res32, w, 1e-6)):
        assert got.dtype == want.dtype  # promoted like the reference
        kt.assert_close(got, want, torch.float16, "mixed dtypes")
    # RoPE: GPT-J layout, a partial rotary dim, and heads that are not contiguous.
    table = ref.build_cos_sin_cache(32, 64, 1.0 / (10000 ** (torch.arange(0, 32, 2).double() / 32)))
    pos = torch.randint(0, 64, (6,), generator=gen)
    q, k = base[:, :128].reshape(6, 4, 32), base[:, 128:].reshape(6, 1, 32)
    partial = (base[:, :96].reshape(6, 2, 48), base[:, 96:144].reshape(6, 1, 48))
    strided_dim = base[:, :128].reshape(6, 32, 4).transpose(1, 2)
    for args in ((pos, q, k, table, False), (pos, *partial, table, True), (pos, strided_dim, k, table, True)):
        for got, want in zip(cpu_ops.rotary_embedding(*args), ref.rotary_embedding(*args)):
            kt.assert_close(got, want, torch.float32, "rope fallback")


def test_rotary_position_past_the_table_raises_like_the_reference() -> None:
    table = torch.zeros(16, 64)
    q, k = torch.zeros(2, 3, 64), torch.zeros(2, 1, 64)
    with pytest.raises((IndexError, RuntimeError)):
        cpu_ops.rotary_embedding(torch.tensor([3, 16]), q, k, table)


def test_backend_picks_native_elementwise_on_cpu(monkeypatch) -> None:
    monkeypatch.delenv("BATON_KERNEL_BACKEND", raising=False)
    for op in ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul"):
        assert backend.select(op, torch.device("cpu")) is getattr(cpu_ops, op)


# --- KV cache write and row argmax -------------------------------------------------------------

@_DTYPES
@pytest.mark.parametrize("tokens", [1, 5, 700])  # 700: split over threads
def test_write_kv_cache_matches_reference(native_only, dtype, tokens: int) -> None:
    """Values as a strided view of a fused QKV output (as the model passes them), negative slots skipped."""
    gen = torch.Generator().manual_seed(tokens)
    blocks, bs, hkv, d = 64, 16, 3, 64
    qkv = torch.randn(tokens, (9 + 2 * hkv) * d, generator=gen).to(dtype)
    key = qkv[:, 9 * d:(9 + hkv) * d].contiguous().view(tokens, hkv, d)
    value = qkv[:, (9 + hkv) * d:].view(tokens, hkv, d)
    assert tokens == 1 or value.stride(0) == qkv.shape[1]  # rows of the fused output, not copied
    slots = torch.randperm(blocks * bs, generator=gen)[:tokens]
    slots[::4] = -1
    start = torch.randn(blocks, bs, hkv, d, generator=gen).to(dtype)
    got_k, got_v, want_k, want_v = start.clone(), start.clone(), start.clone(), start.clone()
    cpu_ops.write_kv_cache(key, value, got_k, got_v, slots)
    ref.write_kv_cache(key, value, want_k, want_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert torch.equal(got_v.view(-1, hkv, d)[slots[slots >= 0]], value[slots >= 0])


def test_write_kv_cache_edge_inputs_behave_like_the_reference() -> None:
    cache = torch.zeros(4, 8, 2, 16)
    k = torch.ones(3, 2, 16)
    with pytest.raises((IndexError, RuntimeError)):  # a slot past the cache: the reference's error
        cpu_ops.write_kv_cache(k, k, cache, cache.clone(), torch.tensor([0, 1, 32]))
    # an fp32 key into a bf16 cache converts like the reference (through it)
    got, want = torch.zeros(4, 8, 2, 16, dtype=torch.bfloat16), torch.zeros(4, 8, 2, 16, dtype=torch.bfloat16)
    x = torch.randn(3, 2, 16)
    slots = torch.tensor([5, 0, 31], dtype=torch.int32)
    cpu_ops.write_kv_cache(x, x, got, got.clone(), slots)
    ref.write_kv_cache(x, x, want, want.clone(), slots)
    assert torch.equal(got, want)


def test_write_kv_cache_takes_int32_slots_natively(native_only) -> None:
    got, want = torch.zeros(4, 8, 2, 16), torch.zeros(4, 8, 2, 16)
    x = torch.randn(3, 2, 16)
    slots = torch.tensor([5, 0, 31], dtype=torch.int32)
    cpu_ops.write_kv_cache(x, x, got, got.clone(), slots)
    ref.write_kv_cache(x, x, want, want.clone(), slots)
    assert torch.equal(got, want)


@pytest.mark.parametrize("rows,cols", [(1, 49152), (33, 1000), (4, 17), (2, 1)])
def test_argmax_rows_matches_torch(native_only, rows: int, cols: int) -> None:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols))
    assert torch.equal(cpu_ops.argmax_rows(x), x.argmax(-1))


def test_argmax_rows_ties_nan_inf_and_strided_rows(native_only) -> None:
    x = torch.full((5, 100), -float("inf"))
    x[1, [7, 40, 99]] = 3.0  # ties: the first index
    x[2, 50] = float("nan")  # NaN wins, as in torch
    x[2, 60] = float("inf")
    x[3, 99] = float("inf")  # in the scalar tail
    x[4, [0, 98]] = 1.0
    assert torch.equal(cpu_ops.argmax_rows(x), x.argmax(-1))
    assert cpu_ops.argmax_rows(x).tolist() == [0, 7, 50, 99, 0]
    wide = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    view = wide[::2, 10:250]  # strided rows: no copy
    assert torch.equal(cpu_ops.argmax_rows(view), view.argmax(-1))


def test_backend_argmax_rows_is_native_on_cpu_unless_torch_is_forced(monkeypatch) -> None:
    monkeypatch.delenv("BATON_KERNEL_BACKEND", raising=False)
    assert backend.select("argmax_rows", torch.device("cpu")) is cpu_ops.argmax_rows
    x = torch.randn(2, 50)
    assert torch.equal(backend.argmax_rows(x), x.argmax(-1))
    monkeypatch.setenv("BATON_KERNEL_BACKEND", "torch")
    assert backend.select("argmax_rows", torch.device("cpu")) is ref.argmax_rows
