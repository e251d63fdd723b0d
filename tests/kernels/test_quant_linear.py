"""Weight-only int8 / int4 linear layers: the quantisers' error bounds and packing layout, and the
native kernels against the torch reference.

Every test runs once per kernel build this CPU can run (the ``kernel_target`` id: ``native``,
``x86-64-v3`` for AVX2 + FMA, ``x86-64`` for the portable 4-lane code that aarch64 also compiles).
Row counts cover each native kernel: dot tiles (per-channel int8 M < 12, group-wise int8 M < 10,
int4 M < 5), int4's fp32-row tiles (5 <= M < 12) and the GEMM (from there), with tails in rows and
output channels (odd N). int8 runs per output channel (``group_size`` 0, scales ``[N]``) and per
group of 32 / 64 / 128 (scales ``[N, K / g]``) wherever K allows.
"""

from __future__ import annotations

import pytest
import torch
from baton_serve.kernels import cpu_ops
from baton_serve.kernels import quant_linear as ql
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.usefixtures("kernel_target")

needs_native = pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler to build the native kernels")
_DTYPES = [torch.float32, torch.bfloat16]
_IDS = ["fp32", "bf16"]


@pytest.fixture
def native_only(monkeypatch) -> None:
    """Fail the test if a linear layer hands the call to the torch reference."""
    def refuse(*args, **kwargs):
        raise AssertionError("fell back to the reference")

    monkeypatch.setattr(ql, "linear_int8_reference", refuse)
    monkeypatch.setattr(ql, "linear_int4_reference", refuse)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Rows of different scales, a few outliers, like trained weights."""
    g = _gen(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.1
    w[torch.rand(n, k, generator=g) < 0.01] *= 8
    return w


def assert_matches(got: torch.Tensor, x: torch.Tensor, want32: torch.Tensor, msg: str = "",
                   rounded_w: torch.Tensor | None = None) -> None:
    """``got`` (x's dtype) against the fp32 result: fp32 within accumulation-order error relative
    to the output's scale; bf16 rounded once from it (half a bf16 ulp, plus that error).
    ``rounded_w`` (the dequantised fp32 weight) where the kernel may round each weight to bf16
    (the bf16 GEMM on AVX512_BF16): plus half a bf16 ulp of every product, 2^-9 sum |x w|."""
    assert got.dtype == x.dtype and got.shape == want32.shape, msg
    assert not got.isnan().any(), msg
    scale = want32.abs().max().item() or 1.0
    err = (got.double() - want32.double()).abs()
    bound = 1e-5 * scale + 1e-5 * want32.double().abs()
    if x.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * want32.double().abs()
    if rounded_w is not None:
        bound = bound + 2.0**-9 * (x.double().abs().reshape(-1, x.shape[-1]) @ rounded_w.double().abs().T
                                   ).reshape(want32.shape)
    worst = (err - bound).max().item()
    assert worst <= 0, f"{msg}: max error {err.max().item():.3g} exceeds the bound by {worst:.3g} (scale {scale:.3g})"


_REF8, _REF4 = ql.linear_int8_reference, ql.linear_int4_reference  # as they are before native_only


def _ref8(x, q, s, b):
    """The reference in fp32 (x's values, bias's values), before rounding to x's dtype."""
    return _REF8(x.float(), q, s, None if b is None else b.float())


def _ref4(x, q, s, m, g, b):
    return _REF4(x.float(), q, s, m, g, None if b is None else b.float())


def _bf16_weights(kernel_target: tuple[str, str], x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """``w`` where this build's bf16 GEMM may round dequantised weights to bf16 (bf16 activations
    on an AVX512_BF16 build; per-channel int8 keeps q exact and passes None), else None."""
    return w if x.dtype == torch.bfloat16 and "AVX512BF16" in kernel_target[1] else None


INT8_GROUPS = (0, *ql.GROUP_SIZES)  # 0: per output channel
_G8_IDS = ["chan", "g32", "g64", "g128"]


def _int8_groups_of(k: int) -> list[int]:
    """The int8 layouts a K allows: per channel always, each group size dividing K."""
    return [g for g in INT8_GROUPS if not g or not k % g]


# --- quantisation ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", _DTYPES, ids=_IDS)
def test_int8_round_trip_within_half_a_scale(dtype) -> None:
    w = _weight(37, 77, 0).to(dtype)
    w[5] = 0  # an all-zero row
    q, s = ql.quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == (37, 77) and s.dtype == torch.float32 and s.shape == (37,)
    assert q.abs().max() <= 127 and (q[:, :].abs().amax(1)[torch.arange(37) != 5] == 127).all()
    assert (q[5] == 0).all() and s[5] == 1
    assert torch.equal(s[torch.arange(37) != 5], w.float().abs().amax(1)[torch.arange(37) != 5] / 127)
    back = ql.dequantize_int8(q, s)
    err = (back - w.float()).abs()
    assert (err <= s[:, None] / 2 + 2e-7 * w.float().abs()).all()  # + an ulp or so of rounding
    assert (back[5] == 0).all()
    assert ql.dequantize_int8(q, s, torch.bfloat16).dtype == torch.bfloat16
    q2, s2 = ql.quantize_int8(w)  # deterministic
    assert torch.equal(q, q2) and torch.equal(s, s2)
    q0, s0 = ql.quantize_int8(w, 0)  # group_size 0 is the per-channel default
    assert torch.equal(q, q0) and torch.equal(s, s0)


@pytest.mark.parametrize("dtype", _DTYPES, ids=_IDS)
@pytest.mark.parametrize("group_size", ql.GROUP_SIZES)
def test_int8_groups_round_trip_within_half_a_scale(dtype, group_size: int) -> None:
    n, k = 37, 384
    groups = k // group_size
    w = _weight(n, k, 100 + group_size).to(dtype)
    w[3, group_size:2 * group_size] = 0  # an all-zero group: scale 1, q 0
    w[4] = 0  # an all-zero row
    w[6, :group_size] *= 1e-3  # a group much smaller than the rest of its row: its own scale
    q, s = ql.quantize_int8(w, group_size)
    assert q.dtype == torch.int8 and q.shape == (n, k) and s.dtype == torch.float32 and s.shape == (n, groups)
    assert s.is_contiguous() and q.is_contiguous()
    wg = w.float().reshape(n, groups, group_size)
    amax = wg.abs().amax(-1)
    assert torch.equal(s, torch.where(amax > 0, amax / 127, torch.ones_like(amax)))
    qg = q.reshape(n, groups, group_size)
    assert qg.abs().max() <= 127 and (qg.abs().amax(-1)[amax > 0] == 127).all()
    assert s[3, 1] == 1 and (qg[3, 1] == 0).all() and (s[4] == 1).all() and (q[4] == 0).all()
    back = ql.dequantize_int8(q, s)
    assert back.shape == (n, k) and back.dtype == torch.float32
    err = (back - w.float()).abs().reshape(n, groups, group_size)
    assert (err <= s[..., None] / 2 + 2e-7 * wg.abs()).all()  # per group, + an ulp or so of rounding
    assert (back[3, group_size:2 * group_size] == 0).all() and (back[4] == 0).all()
    assert torch.equal(back, (q.float().reshape(n, groups, group_size) * s[..., None]).reshape(n, k))
    assert ql.dequantize_int8(q, s, torch.bfloat16).dtype == torch.bfloat16
    # finer scales than per channel: the small group keeps its precision
    qc, sc = ql.quantize_int8(w)
    err_c = (ql.dequantize_int8(qc, sc) - w.float()).abs()
    assert err.reshape(n, k)[6, :group_size].max() < err_c[6, :group_size].max() / 10
    q2, s2 = ql.quantize_int8(w, group_size)  # deterministic
    assert torch.equal(q, q2) and torch.equal(s, s2)


def test_int8_layout_follows_the_scales_shape() -> None:
    """1-D scales are per channel; ``[N, 1]`` is one group of K, the same weights."""
    w = _weight(9, 96, 1)
    q, s = ql.quantize_int8(w)
    assert torch.equal(ql.dequantize_int8(q, s[:, None]), ql.dequantize_int8(q, s))
    qg, sg = ql.quantize_int8(w, 32)
    assert sg.shape == (9, 3)
    assert torch.equal(ql.dequantize_int8(qg, sg), qg.float() * sg.repeat_interleave(32, dim=1))
    with pytest.raises(ValueError, match="do not divide K"):
        ql.dequantize_int8(qg, torch.ones(9, 5))  # 5 groups of 96
    with pytest.raises(ValueError, match="do not divide K"):
        ql.linear_int8(torch.randn(2, 96), qg, torch.ones(9, 5))


@pytest.mark.parametrize("dtype", _DTYPES, ids=_IDS)
@pytest.mark.parametrize("group_size", ql.GROUP_SIZES)
def test_int4_round_trip_within_half_a_scale(dtype, group_size: int) -> None:
    n, k = 37, 256
    w = _weight(n, k, group_size).to(dtype)
    w[3, :group_size] = 0.25  # a constant group: scale 0, dequantises exactly
    w[4] = -1.5  # a constant row
    q, s, m = ql.quantize_int4(w, group_size)
    groups = k // group_size
    assert q.dtype == torch.uint8 and q.shape == (n, k // 2)
    assert s.shape == m.shape == (n, groups) and s.dtype == m.dtype == torch.float32
    back = ql.dequantize_int4(q, s, m, group_size)
    assert back.shape == (n, k)
    err = (back - w.float()).abs().reshape(n, groups, group_size)
    ulps = 2e-7 * (w.float().abs().reshape(n, groups, group_size) + m.abs()[..., None])  # fp32 rounding
    assert (err <= s[..., None] / 2 + ulps).all()
    assert s[3, 0] == 0 and (back[3, :group_size] == 0.25).all()
    assert (back[4] == -1.5).all()
    vals = ql.unpack_int4(q)
    assert vals.max() <= 15
    wg = w.float().reshape(n, groups, group_size)
    assert torch.equal(m, wg.amin(-1)) and torch.allclose(s, (wg.amax(-1) - wg.amin(-1)) / 15)
    q2, s2, m2 = ql.quantize_int4(w, group_size)  # deterministic
    assert torch.equal(q, q2) and torch.equal(s, s2) and torch.equal(m, m2)


def test_int4_packing_layout_by_hand() -> None:
    """Each run of 32 values is 16 bytes: byte i = q[i] | q[i + 16] << 4."""
    lo = torch.arange(16)  # q[0..15]
    hi = 15 - torch.arange(16)  # q[16..31]
    run = torch.cat([lo, hi])
    q = torch.stack([torch.cat([run, run.flip(0)]), torch.full((64,), 9)])  # [2, 64]: two runs a row
    packed = ql.pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 32)
    assert packed[0, :16].tolist() == [i | (15 - i) << 4 for i in range(16)]
    flipped = run.flip(0)  # q[32 + i] = 15 - i (i < 16), q[48 + i] = i
    assert packed[0, 16:].tolist() == [int(flipped[i]) | int(flipped[i + 16]) << 4 for i in range(16)]
    assert packed[1].tolist() == [0x99] * 32
    assert torch.equal(ql.unpack_int4(packed), q.to(torch.uint8))
    # A weight whose groups span exactly 0..15 quantises to those values with scale 1, min 0.
    qw, s, m = ql.quantize_int4(q.float(), 32)
    assert torch.equal(qw[0], packed[0]) and (s[0] == 1).all() and (m[0] == 0).all()
    assert (ql.unpack_int4(qw)[1] == 0).all() and (s[1] == 0).all() and (m[1] == 9).all()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 6), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_int4_pack_unpack_round_trip(n: int, runs: int, seed: int) -> None:
    q = torch.randint(0, 16, (n, 32 * runs), generator=_gen(seed), dtype=torch.uint8)
    packed = ql.pack_int4(q)
    assert packed.shape == (n, 16 * runs)
    assert torch.equal(ql.unpack_int4(packed), q)
    assert torch.equal(ql.pack_int4(ql.unpack_int4(packed)), packed)


def test_quantizers_reject_bad_shapes() -> None:
    with pytest.raises(ValueError):
        ql.quantize_int4(torch.randn(4, 96), 64)  # K not a multiple of the group
    with pytest.raises(ValueError):
        ql.quantize_int4(torch.randn(4, 96), 48)  # not a supported group size
    with pytest.raises(ValueError):
        ql.quantize_int8(torch.randn(4))


@pytest.mark.parametrize("group_size", [16, 48, 96, 256, -32, 1])
def test_int8_rejects_a_group_size_it_does_not_take(group_size: int) -> None:
    with pytest.raises(ValueError, match=f"got {group_size}"):
        ql.quantize_int8(torch.randn(4, 768), group_size)


@pytest.mark.parametrize("group_size,k", [(32, 80), (64, 96), (128, 192)])
def test_int8_rejects_k_not_a_multiple_of_the_group(group_size: int, k: int) -> None:
    with pytest.raises(ValueError, match=f"K = {k} is not a multiple of the group size {group_size}"):
        ql.quantize_int8(torch.randn(4, k), group_size)


# --- native kernels against the reference ------------------------------------------------------

_MS = (1, 2, 3, 7, 11, 17, 64, 300)


_INT8_CASES = [  # (N, K, group size): odd N, K % 32 != 0 per channel, every group size K allows
    (37, 40, 0), (64, 96, 0), (5, 576, 0), (130, 9, 0), (37, 384, 0),
    (64, 96, 32), (5, 576, 32), (37, 384, 32),
    (5, 576, 64), (37, 384, 64), (130, 128, 64),
    (37, 384, 128), (3, 256, 128), (130, 128, 128),
]


@needs_native
@pytest.mark.parametrize("dtype", _DTYPES, ids=_IDS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("n,k,group_size", _INT8_CASES, ids=[f"{n}x{k}-g{g}" for n, k, g in _INT8_CASES])
@pytest.mark.parametrize("m", _MS)
def test_int8_native_matches_reference(native_only, kernel_target, m: int, n: int, k: int, group_size: int,
                                       with_bias: bool, dtype) -> None:
    g = _gen(m * 1000 + n + k + group_size)
    w = _weight(n, k, n + k)
    if group_size:
        w[1 % n, :group_size] = 0  # an all-zero group
    q, s = ql.quantize_int8(w, group_size)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if with_bias else None
    rounded = _bf16_weights(kernel_target, x, ql.dequantize_int8(q, s)) if group_size else None
    assert_matches(ql.linear_int8(x, q, s, b), x, _ref8(x, q, s, b), f"M={m} N={n} K={k} g={group_size}", rounded)


@needs_native
@pytest.mark.parametrize("m", [1, 3, 7, 12, 40])
def test_int8_one_group_of_k_runs_as_per_channel(native_only, m: int) -> None:
    """Scales ``[N, 1]`` (one group of K, any K) take the per-channel kernels, rows narrowed too."""
    n, k = 45, 77
    w = _weight(n, k, 11)
    q, s = ql.quantize_int8(w)
    x = torch.randn(m, k, generator=_gen(m))
    assert_matches(ql.linear_int8(x, q, s[:, None]), x, _ref8(x, q, s, None), "[N, 1] scales")
    s2 = torch.stack([s, s], dim=1)[:, :1]  # rows 2 floats apart
    assert not s2.is_contiguous()
    assert_matches(ql.linear_int8(x, q, s2), x, _ref8(x, q, s, None), "[N, 1] scales, strided rows")


@needs_native
@pytest.mark.parametrize("dtype", _DTYPES, ids=_IDS)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("group_size", ql.GROUP_SIZES)
@pytest.mark.parametrize("m", _MS)
def test_int4_native_matches_reference(native_only, kernel_target, m: int, group_size: int, with_bias: bool,
                                       dtype) -> None:
    n, k = 37, 384
    g = _gen(m * 1000 + group_size)
    w = _weight(n, k, group_size)
    w[2, :group_size] = 0.5  # a constant group
    q, s, mins = ql.quantize_int4(w, group_size)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if with_bias else None
    got = ql.linear_int4(x, q, s, mins, group_size, b)
    rounded = _bf16_weights(kernel_target, x, ql.dequantize_int4(q, s, mins, group_size))
    assert_matches(got, x, _ref4(x, q, s, mins, group_size, b), f"M={m} g={group_size}", rounded)


@needs_native
@pytest.mark.parametrize("dtype", _DTYPES, ids=_IDS)
def test_three_dim_inputs(native_only, kernel_target, dtype) -> None:
    x = torch.randn(3, 7, 96, generator=_gen(1)).to(dtype)
    w = _weight(45, 96, 2)
    for group_size in _int8_groups_of(96):
        q8, s8 = ql.quantize_int8(w, group_size)
        got = ql.linear_int8(x, q8, s8)
        assert got.shape == (3, 7, 45)
        rounded = _bf16_weights(kernel_target, x, ql.dequantize_int8(q8, s8)) if group_size else None
        assert_matches(got, x, _ref8(x, q8, s8, None), f"int8 g={group_size} [B, T, K]", rounded)
    q4, s4, m4 = ql.quantize_int4(w, 32)
    got = ql.linear_int4(x, q4, s4, m4, 32)
    assert got.shape == (3, 7, 45)
    assert_matches(got, x, _ref4(x, q4, s4, m4, 32, None), "int4 [B, T, K]",
                   _bf16_weights(kernel_target, x, ql.dequantize_int4(q4, s4, m4, 32)))


@needs_native
@pytest.mark.parametrize("dtype", _DTYPES, ids=_IDS)
@pytest.mark.parametrize("m", [1, 3, 7, 9, 40])
def test_two_threads(native_only, kernel_target, m: int, dtype) -> None:
    """The OpenMP paths (the conftest runs one thread): enough work to split, N not a multiple
    of any tile or panel."""
    n, k = 301, 512
    w = _weight(n, k, 5)
    x = torch.randn(m, k, generator=_gen(m)).to(dtype)
    b = torch.randn(n, generator=_gen(7)).to(dtype)
    q8 = {g: ql.quantize_int8(w, g) for g in INT8_GROUPS}
    q4, s4, m4 = ql.quantize_int4(w, 64)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got8 = {g: ql.linear_int8(x, *qs, b) for g, qs in q8.items()}
        got4 = ql.linear_int4(x, q4, s4, m4, 64, b)
    finally:
        torch.set_num_threads(threads)
    for g, (q, s) in q8.items():
        rounded = _bf16_weights(kernel_target, x, ql.dequantize_int8(q, s)) if g else None
        assert_matches(got8[g], x, _ref8(x, q, s, b), f"int8 g={g}, 2 threads", rounded)
    assert_matches(got4, x, _ref4(x, q4, s4, m4, 64, b), "int4, 2 threads",
                   _bf16_weights(kernel_target, x, ql.dequantize_int4(q4, s4, m4, 64)))


@needs_native
@pytest.mark.parametrize("m", [1, 4, 9, 20])
def test_weights_narrowed_along_k_run_natively(native_only, m: int) -> None:
    """Tensor parallelism narrows row-parallel weights along K: rows stay contiguous, strided;
    group-wise scales are narrowed on group boundaries."""
    n, k = 21, 256
    w = _weight(n, k, 9)
    x = torch.randn(m, 128, generator=_gen(m))
    q8, s8 = ql.quantize_int8(w)
    q8v = q8[:, 64:192]
    assert not q8v.is_contiguous()
    assert_matches(ql.linear_int8(x, q8v, s8), x, _ref8(x, q8v.contiguous(), s8, None), "int8 view")
    for group_size, start in ((32, 64), (64, 64), (128, 128)):  # the second half, for g = 128
        qg, sg = ql.quantize_int8(w, group_size)
        qgv = qg[:, start:start + 128]
        sgv = sg[:, start // group_size:(start + 128) // group_size]
        assert not qgv.is_contiguous() and (group_size == 128 or not sgv.is_contiguous())
        want = _ref8(x, qgv.contiguous(), sgv.contiguous(), None)
        assert_matches(ql.linear_int8(x, qgv, sgv), x, want, f"int8 g={group_size} view")
        # the slice dequantises to the matching slice of the whole weight
        assert torch.equal(ql.dequantize_int8(qgv, sgv), ql.dequantize_int8(qg, sg)[:, start:start + 128])
        rows, xk = qg[3:17], torch.randn(m, k, generator=_gen(m + 2))  # along N: contiguous rows
        assert_matches(ql.linear_int8(xk, rows, sg[3:17]), xk, _ref8(xk, rows, sg[3:17], None),
                       f"int8 g={group_size} rows")
    q4, s4, m4 = ql.quantize_int4(w, 32)
    q4v, s4v, m4v = q4[:, 32:96], s4[:, 2:6], m4[:, 2:6]
    got = ql.linear_int4(x, q4v, s4v, m4v, 32)
    assert_matches(got, x, _ref4(x, q4v.contiguous(), s4v.contiguous(), m4v.contiguous(), 32, None), "int4 view")
    rows, xk = q8[3:17], torch.randn(m, k, generator=_gen(m + 1))  # narrowed along N: contiguous rows
    assert_matches(ql.linear_int8(xk, rows, s8[3:17]), xk, _ref8(xk, rows, s8[3:17], None), "int8 rows")


# --- what the kernels do not take goes to the reference, with the same result ------------------

def _both(monkeypatch, fn, *args):
    """(result of the wrapper, result of the reference) and whether the reference was called."""
    calls = []
    name = "linear_int8_reference" if fn is ql.linear_int8 else "linear_int4_reference"
    real = getattr(ql, name)

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(ql, name, spy)
    got = fn(*args)
    return got, real(*args), bool(calls)


def test_fp16_input_uses_the_reference(monkeypatch) -> None:
    x = torch.randn(5, 64, generator=_gen(3)).half()
    w = _weight(33, 64, 3)
    for group_size in (0, 32, 64):
        q8, s8 = ql.quantize_int8(w, group_size)
        got, want, fell_back = _both(monkeypatch, ql.linear_int8, x, q8, s8)
        assert fell_back and got.dtype == torch.float16 and torch.equal(got, want)
    q4, s4, m4 = ql.quantize_int4(w, 32)
    got, want, fell_back = _both(monkeypatch, ql.linear_int4, x, q4, s4, m4, 32)
    assert fell_back and got.dtype == torch.float16 and torch.equal(got, want)


@pytest.mark.parametrize("dtype", _DTYPES, ids=_IDS)
def test_non_contiguous_inputs_match_the_reference(monkeypatch, dtype) -> None:
    w = _weight(33, 64, 4)
    xt = torch.randn(64, 6, generator=_gen(4)).to(dtype).t()  # [6, 64], not contiguous
    q8, s8 = ql.quantize_int8(w)
    got, want, _ = _both(monkeypatch, ql.linear_int8, xt, q8, s8)
    assert_matches(got, xt, _ref8(xt, q8, s8, None), "transposed x")
    assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    q8t = q8.t().contiguous().t()  # column-major weight: not row-contiguous
    got, want, fell_back = _both(monkeypatch, ql.linear_int8, xt, q8t, s8)
    assert fell_back and torch.equal(got, want)
    q8g, s8g = ql.quantize_int8(w, 32)
    got, want, fell_back = _both(monkeypatch, ql.linear_int8, xt, q8g, s8g)
    assert not fell_back or not cpu_ops.available()
    assert_matches(got, xt, _ref8(xt, q8g, s8g, None), "transposed x, int8 g=32")
    s8gt = s8g.t().contiguous().t()  # column-major group scales: not row-contiguous
    got, want, fell_back = _both(monkeypatch, ql.linear_int8, xt, q8g, s8gt)
    assert fell_back and torch.equal(got, want)
    q4, s4, m4 = ql.quantize_int4(w, 32)
    got, want, _ = _both(monkeypatch, ql.linear_int4, xt, q4, s4, m4, 32)
    assert_matches(got, xt, _ref4(xt, q4, s4, m4, 32, None), "transposed x, int4")
    s4t = s4.t().contiguous().t()
    got, want, fell_back = _both(monkeypatch, ql.linear_int4, xt, q4, s4t, m4, 32)
    assert fell_back and torch.equal(got, want)


@pytest.mark.parametrize("dtype", _DTYPES, ids=_IDS)
def test_int8_scales_the_kernels_do_not_take_use_the_reference(monkeypatch, dtype) -> None:
    """Groups of 16 or 48 (scales a checkpoint could carry, which quantize_int8 does not make),
    bf16 scales: same result, from the reference."""
    n, k = 33, 96
    w = _weight(n, k, 8).reshape(n, k // 16, 16)
    x = torch.randn(5, k, generator=_gen(8)).to(dtype)
    for groups in (6, 2):  # g = 16, 48
        amax = w.reshape(n, groups, -1).abs().amax(-1)
        s = amax / 127
        q = torch.round(w.reshape(n, groups, -1) / s[..., None]).clamp(-127, 127).to(torch.int8).reshape(n, k)
        got, want, fell_back = _both(monkeypatch, ql.linear_int8, x, q, s)
        assert fell_back and torch.equal(got, want)
        assert_matches(got, x, _ref8(x, q, s, None), f"{groups} groups")
    q, s = ql.quantize_int8(w.reshape(n, k), 32)
    got, want, fell_back = _both(monkeypatch, ql.linear_int8, x, q, s.bfloat16())
    assert fell_back and torch.equal(got, want)


def test_bias_of_another_dtype_and_empty_inputs_use_the_reference(monkeypatch) -> None:
    w = _weight(17, 32, 6)
    q8, s8 = ql.quantize_int8(w)
    x = torch.randn(4, 32, generator=_gen(6)).bfloat16()
    b32 = torch.randn(17, generator=_gen(7))
    got, want, fell_back = _both(monkeypatch, ql.linear_int8, x, q8, s8, b32)
    assert fell_back and got.dtype == torch.bfloat16 and torch.equal(got, want)
    empty = torch.empty(0, 32)
    got = ql.linear_int8(empty, q8, s8)
    assert got.shape == (0, 17)
    q8g, s8g = ql.quantize_int8(w, 32)
    got, want, fell_back = _both(monkeypatch, ql.linear_int8, x, q8g, s8g, b32)
    assert fell_back and got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert ql.linear_int8(torch.empty(3, 0, 32), q8g, s8g).shape == (3, 0, 17)
    q4, s4, m4 = ql.quantize_int4(w, 32)
    assert ql.linear_int4(torch.empty(2, 0, 32), q4, s4, m4, 32).shape == (2, 0, 17)


# --- hypothesis: random shapes through every kernel --------------------------------------------

@needs_native
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.integers(1, 40), n=st.integers(1, 70), groups=st.integers(1, 6), g=st.sampled_from(ql.GROUP_SIZES),
       bf16=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_random_shapes_match_reference(native_only, kernel_target, m, n, groups, g, bf16, seed) -> None:
    k = groups * g
    gen = _gen(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    q4, s4, m4 = ql.quantize_int4(w, g)
    assert_matches(ql.linear_int4(x, q4, s4, m4, g, b), x, _ref4(x, q4, s4, m4, g, b), f"int4 {m}x{n}x{k}",
                   _bf16_weights(kernel_target, x, ql.dequantize_int4(q4, s4, m4, g)))
    q8g, s8g = ql.quantize_int8(w, g)
    assert_matches(ql.linear_int8(x, q8g, s8g, b), x, _ref8(x, q8g, s8g, b), f"int8 g={g} {m}x{n}x{k}",
                   _bf16_weights(kernel_target, x, ql.dequantize_int8(q8g, s8g)))
    k8 = k - seed % 31  # any K for per-channel int8
    q8, s8 = ql.quantize_int8(w[:, :k8])
    assert_matches(ql.linear_int8(x[:, :k8].contiguous(), q8, s8, b), x, _ref8(x[:, :k8], q8, s8, b),
                   f"int8 {m}x{n}x{k8}")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 9), groups=st.integers(1, 5), g=st.sampled_from(INT8_GROUPS),
       seed=st.integers(0, 2**31 - 1))
def test_int8_round_trip_random(n, groups, g, seed) -> None:
    """Any weight: every value within half its scale of the original, the scales amax / 127."""
    k = groups * (g or 40)
    gen = _gen(seed)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 10 ** (seed % 7 - 3)
    w[torch.rand(n, k, generator=gen) < 0.2] = 0
    q, s = ql.quantize_int8(w, g)
    wg = w.reshape(n, -1, g or k)
    sg = s.reshape(n, -1)
    assert sg.shape == wg.shape[:2] == ((n, groups) if g else (n, 1))
    err = (ql.dequantize_int8(q, s) - w).abs().reshape(wg.shape)
    assert (err <= sg[..., None] / 2 + 2e-7 * wg.abs()).all()
    amax = wg.abs().amax(-1)
    assert torch.equal(sg, torch.where(amax > 0, amax / 127, torch.ones_like(amax)))
