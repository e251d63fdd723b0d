"""The batch-invariant linear kernel: a row's bits never depend on the rows beside it. Run once
per kernel build this CPU can run (``kernel_target``: native, x86-64-v3, x86-64), so the AVX512_BF16,
AVX-512, AVX2 and portable paths are each held to it wherever they can execute."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from baton_serve.kernels import cpu_ops, invariant_linear
from baton_serve.kernels.deterministic import DeterministicModeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="native CPU kernels unavailable")

DTYPES = (torch.bfloat16, torch.float32)


def _weights(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.05).to(dtype)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 100), k=st.integers(1, 160), m=st.integers(2, 140), dtype=st.sampled_from(DTYPES),
       threads=st.sampled_from([1, 2]), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_row_alone_equals_row_in_any_batch(kernel_target, n: int, k: int, m: int, dtype: torch.dtype, threads: int,
                                           bias: bool, seed: int) -> None:
    w = _weights(n, k, dtype, seed)
    b = _weights(1, n, dtype, seed + 1)[0] if bias else None
    x = _weights(m, k, dtype, seed + 2) * 20
    packed = invariant_linear.pack(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batched = invariant_linear.linear(x, packed, b)
        alone = torch.cat([invariant_linear.linear(x[i:i + 1], packed, b) for i in range(m)])
        shifted = invariant_linear.linear(torch.cat([x[m // 2:], x[:m // 2]]), packed, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(batched, alone)  # bitwise, every row
    assert torch.equal(shifted, torch.cat([batched[m // 2:], batched[:m // 2]]))  # any position in the batch


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (577, 70), (64, 384)])
def test_matches_float64_within_the_summation_bound(kernel_target, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    k, n = shape
    w = _weights(n, k, dtype, 0)
    x = _weights(37, k, dtype, 1) * 20
    exact = x.double() @ w.double().T
    ours = invariant_linear.linear(x, invariant_linear.pack(w)).double()
    # fp32 accumulation of K products (each exact for bf16): |error| <= K u sum |x w|, plus the
    # output's own rounding (half an ulp of bf16 or fp32)
    bound = k * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    bound += exact.abs() * (2.0**-8 if dtype == torch.bfloat16 else 2.0**-24)
    assert ((ours - exact).abs() <= bound + 1e-30).all()
    assert ((F.linear(x, w).double() - exact).abs() <= bound + 1e-30).all()  # the bound is not loose for us alone


def test_more_rows_than_a_task_and_wider_than_a_panel(kernel_target) -> None:
    w = _weights(200, 96, torch.bfloat16, 3)
    x = _weights(300, 96, torch.bfloat16, 4) * 20
    packed = invariant_linear.pack(w)
    full = invariant_linear.linear(x, packed)
    for m in (1, 63, 64, 65, 129):
        assert torch.equal(invariant_linear.linear(x[:m], packed), full[:m])


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_round_trip_and_views(dtype: torch.dtype) -> None:
    w = _weights(45, 33, dtype, 5)
    packed = invariant_linear.pack(w)
    assert torch.equal(packed.dense(), w)
    x = _weights(6, 66, dtype, 6)
    strided = x[:, ::2]  # not contiguous: copied
    assert torch.equal(invariant_linear.linear(strided, packed), invariant_linear.linear(strided.contiguous(), packed))
    three_d = invariant_linear.linear(x[:, :33].reshape(2, 3, 33), packed)
    assert three_d.shape == (2, 3, 45)
    assert torch.equal(three_d.reshape(6, 45), invariant_linear.linear(x[:, :33], packed))
    assert invariant_linear.linear(x[:0, :33], packed).shape == (0, 45)


def test_other_input_dtype_is_cast_and_back() -> None:
    w = _weights(16, 32, torch.bfloat16, 7)
    x = _weights(3, 32, torch.float32, 8)
    out = invariant_linear.linear(x, invariant_linear.pack(w))
    assert out.dtype == torch.float32
    assert torch.equal(out, invariant_linear.linear(x.to(torch.bfloat16), invariant_linear.pack(w)).float())


def test_refuses_what_it_cannot_run() -> None:
    with pytest.raises(DeterministicModeError, match="bf16 and fp32"):
        invariant_linear.pack(torch.zeros(4, 4, dtype=torch.float16))
    packed = invariant_linear.pack(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="8"):
        invariant_linear.linear(torch.zeros(2, 7), packed)


QUANT = [("int8", 0), ("int8", 32), ("int4", 32), ("int4", 64)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(QUANT), n=st.integers(1, 70), k_groups=st.integers(1, 5), m=st.integers(2, 40),
       dtype=st.sampled_from(DTYPES), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_quantised_rows_alone_equal_rows_in_any_batch(kernel_target, case, n: int, k_groups: int, m: int,
                                                     dtype: torch.dtype, bias: bool, seed: int) -> None:
    """int8 and int4 with ``invariant``: one kernel (the GEMM) for every row count, so a decode row
    and the same row inside a prefill agree bit for bit (without it, the dot tiles below 12 rows
    and the GEMM above sum in different orders)."""
    from baton_serve.kernels import quant_linear as ql

    method, group = case
    k = k_groups * 64
    w = _weights(n, k, torch.float32, seed)
    b = _weights(1, n, dtype, seed + 1)[0] if bias else None
    x = _weights(m, k, dtype, seed + 2) * 20
    if method == "int8":
        q, s = ql.quantize_int8(w, group)
        run = lambda rows: ql.linear_int8(rows, q, s, b, invariant=True)  # noqa: E731
    else:
        q, s, mins = ql.quantize_int4(w, group)
        run = lambda rows: ql.linear_int4(rows, q, s, mins, group, b, invariant=True)  # noqa: E731
    batched = run(x)
    assert torch.equal(batched, torch.cat([run(x[i:i + 1]) for i in range(m)]))
    reference = (ql.linear_int8_reference(x, q, s, b) if method == "int8"
                 else ql.linear_int4_reference(x, q, s, mins, group, b))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert torch.allclose(batched.float(), reference.float(), rtol=tol, atol=tol * float(reference.abs().max()))


def test_quantised_invariant_refuses_the_reference() -> None:
    from baton_serve.kernels import quant_linear as ql

    q, s = ql.quantize_int8(torch.randn(8, 64), 0)
    with pytest.raises(DeterministicModeError, match="int8"):
        ql.linear_int8(torch.randn(2, 64, dtype=torch.float16), q, s, invariant=True)  # fp16: reference only
