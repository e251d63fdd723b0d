"""W8A8 linear: per-row activation quantisation within half a step, and products within the bound
that rounding implies of the weight-only int8 result."""

from __future__ import annotations

import pytest
import torch
from baton_serve.kernels import quant_linear, w8a8_linear
from hypothesis import given, settings
from hypothesis import strategies as st


def _weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return quant_linear.quantize_int8(torch.randn(n, k, generator=gen) * 0.05)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(1, 70), st.floats(1e-3, 1e3), st.integers(0, 2**31 - 1))
def test_rows_quantise_within_half_a_step(m: int, k: int, magnitude: float, seed: int) -> None:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * magnitude
    q, s = w8a8_linear.quantize_rows(x)
    assert q.dtype == torch.int8 and s.shape == (m,)
    assert (q.abs() <= 127).all() and (q.abs().amax(-1) == 127).all()  # the largest value maps to +-127
    assert ((q.float() * s[:, None] - x).abs() <= s[:, None] * 0.5 * (1 + 1e-5)).all()


def test_a_zero_row_stays_zero() -> None:
    q, s = w8a8_linear.quantize_rows(torch.zeros(2, 8))
    assert (q == 0).all() and (s == 1).all()


@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_products_within_the_rounding_bound_of_weight_only_int8(m: int, with_bias: bool) -> None:
    n, k = 96, 160
    q, scales = _weights(n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n) if with_bias else None
    got = w8a8_linear.linear(x, w8a8_linear.pack(q), scales, bias)
    ref = quant_linear.linear_int8_reference(x, q, scales, bias)
    _, s = w8a8_linear.quantize_rows(x)
    # each activation is off by at most s/2: |out - ref| <= s/2 * sum_k |w[n, k]|, plus fp32 rounding
    bound = s[:, None] * 0.5 * (q.float().abs() * scales[:, None]).sum(-1)[None, :] + 1e-4
    assert got.shape == (m, n) and ((got - ref).abs() <= bound).all()
    assert ((got - ref).abs() > 0).any()  # the activations really were rounded


def test_leading_dims_bf16_and_empty_rows() -> None:
    q, scales = _weights(64, 32)
    packed = w8a8_linear.pack(q)
    x = torch.randn(2, 3, 32).bfloat16()
    got = w8a8_linear.linear(x, packed, scales)
    assert got.shape == (2, 3, 64) and got.dtype == torch.bfloat16
    flat = w8a8_linear.linear(x.reshape(6, 32), packed, scales)
    assert torch.equal(got.reshape(6, 64), flat)
    assert w8a8_linear.linear(torch.empty(0, 32), packed, scales).shape == (0, 64)


def test_bad_shapes_and_dtypes_are_typed_errors() -> None:
    q, scales = _weights(16, 32)
    with pytest.raises(ValueError, match="takes 32"):
        w8a8_linear.linear(torch.randn(2, 31), w8a8_linear.pack(q), scales)
    with pytest.raises(ValueError, match="int8"):
        w8a8_linear.pack(q.float())


def test_a_rows_result_does_not_depend_on_its_batch() -> None:
    """int32 sums are exact in any order and the rest is per element: bitwise batch-invariant."""
    q, scales = _weights(3072, 576)
    packed = w8a8_linear.pack(q)
    x = torch.randn(2100, 576, generator=torch.Generator().manual_seed(3)).bfloat16()  # row-blocked above 341
    whole = w8a8_linear.linear(x, packed, scales)
    for rows in ([0], [5, 6, 7], list(range(300, 340)), [2099]):
        assert torch.equal(w8a8_linear.linear(x[rows], packed, scales), whole[rows])
