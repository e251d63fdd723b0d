"""Triton rms_norm / fused_add_rms_norm / rotary_embedding / silu_and_mul against the reference
and float64 math, with every launcher-allocated output poisoned (NaN) before the call."""

from __future__ import annotations

import pytest
import torch
from baton_serve.kernels import reference as ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 48), (7, 100), (2, 1000)])
def test_rms_norm(triton_ops, kt, device, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    weight = torch.randn(shape[-1], generator=gen).to(dtype)
    with kt.poisoned():
        got = triton_ops.rms_norm(x.to(device), weight.to(device), 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    kt.assert_close(got, kt.naive_rms_norm(x, weight, 1e-6), dtype, "vs float64")
    kt.assert_close(got, ref.rms_norm(x, weight, 1e-6), dtype, "vs reference")


@pytest.mark.parametrize(
    "x_dtype,res_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
     (torch.bfloat16, torch.float32)],  # bf16 activations with an fp32 residual stream
    ids=["fp32", "bf16", "fp16", "bf16+fp32"],
)
@pytest.mark.parametrize("shape", [(4, 48), (2, 3, 100)])
def test_fused_add_rms_norm(triton_ops, kt, device, x_dtype, res_dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(shape[-1] + 1)
    x = torch.randn(*shape, generator=gen).to(x_dtype)
    residual = torch.randn(*shape, generator=gen).to(res_dtype)
    weight = torch.randn(shape[-1], generator=gen).to(x_dtype)
    x_d, res_d = x.to(device), residual.to(device)
    with kt.poisoned():
        out, new_residual = triton_ops.fused_add_rms_norm(x_d, res_d, weight.to(device), 1e-5)
    assert torch.equal(x_d.cpu(), x) and torch.equal(res_d.cpu(), residual)  # pure, like the reference
    out, new_residual = out.cpu(), new_residual.cpu()
    want_out, want_res = ref.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert out.dtype == want_out.dtype and new_residual.dtype == want_res.dtype
    kt.assert_close(new_residual, x.double() + residual.double(), want_res.dtype, "residual vs float64")
    kt.assert_close(new_residual, want_res, want_res.dtype, "residual vs reference")
    # The norm is of the stored (rounded) residual; judging it on our own residual keeps one
    # rounding per comparison, so the dtype tolerance applies unchanged.
    kt.assert_close(out, kt.naive_rms_norm(new_residual, weight, 1e-5), want_out.dtype, "norm vs float64")
    kt.assert_close(out, ref.rms_norm(new_residual, weight, 1e-5), want_out.dtype, "norm vs reference")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("head_dim,rot_dim", [(32, 32), (32, 16), (40, 24)])
def test_rotary_embedding(triton_ops, kt, device, dtype, is_neox: bool, head_dim: int, rot_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim + rot_dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    table = ref.build_cos_sin_cache(rot_dim, 200, inv_freq)
    tokens = 7
    positions = torch.randint(0, 200, (tokens,), generator=gen)
    # q and k as strided views of one fused qkv projection, the way the model produces them.
    qkv = torch.randn(tokens, 6 + 2 * 2, head_dim, generator=gen).to(dtype)
    q, k = qkv[:, :6], qkv[:, 6:8]
    qkv_d = qkv.to(device)
    with kt.poisoned():
        got_q, got_k = triton_ops.rotary_embedding(positions.to(device), qkv_d[:, :6], qkv_d[:, 6:8],
                                                   table.to(device), is_neox)
    got_q, got_k = got_q.cpu(), got_k.cpu()
    want_q, want_k = ref.rotary_embedding(positions, q, k, table, is_neox)
    for got, want, x, name in ((got_q, want_q, q, "query"), (got_k, want_k, k, "key")):
        assert got.shape == x.shape and got.dtype == dtype
        kt.assert_close(got, kt.naive_rotary(positions, x, table, is_neox), dtype, f"{name} vs float64")
        kt.assert_close(got, want, dtype, f"{name} vs reference")
        assert torch.equal(got[..., rot_dim:], x[..., rot_dim:])  # pass-through dims: exact copy


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(5, 2 * 37), (2, 3, 2 * 64), (3, 2 * 1500)])
def test_silu_and_mul(triton_ops, kt, device, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(shape[-1])) * 4).to(dtype)
    with kt.poisoned():
        got = triton_ops.silu_and_mul(x.to(device))
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
    kt.assert_close(got, kt.naive_silu_and_mul(x), dtype, "vs float64")
    kt.assert_close(got, ref.silu_and_mul(x), dtype, "vs reference")


def test_row_views(triton_ops, kt, device) -> None:
    """Inputs whose rows are not adjacent in memory (a column slice) still normalise per row."""
    base = torch.randn(6, 80, generator=torch.Generator().manual_seed(3))
    x, weight = base[:, :48], torch.ones(48)
    base_d = base.to(device)
    with kt.poisoned():
        got = triton_ops.rms_norm(base_d[:, :48], weight.to(device), 1e-6)
        act = triton_ops.silu_and_mul(base_d[:, :74])
    kt.assert_close(got, kt.naive_rms_norm(x, weight, 1e-6), torch.float32, "rms_norm view")
    kt.assert_close(act, kt.naive_silu_and_mul(base[:, :74]), torch.float32, "silu view")
