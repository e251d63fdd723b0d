"""Triton cache-movement kernels against the reference and explicit per-slot loops.

In-place ops run on random caches; every slot the op must not touch has to keep its exact
previous bits. Freshly allocated outputs start poisoned (NaN) so unwritten elements fail.
"""

from __future__ import annotations

import pytest
import torch
from baton_serve.kernels import reference as ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _cache(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_write_kv_cache(triton_ops, device, dtype: torch.dtype, block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, heads, dim = 5, 3, 24  # head dim not a power of two: masked tail
    k_cache = _cache(gen, (num_blocks, block_size, heads, dim), dtype)
    v_cache = _cache(gen, (num_blocks, block_size, heads, dim), dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:11]
    slots[[1, 6]] = -1  # padding tokens
    slots[2] = block_size - 1  # last slot of a block
    slots[3] = num_blocks * block_size - 1  # last slot of the cache
    key, value = _cache(gen, (11, heads, dim), dtype), _cache(gen, (11, heads, dim), dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k[slot // block_size, slot % block_size] = key[t]
            want_v[slot // block_size, slot % block_size] = value[t]
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref.write_kv_cache(key, value, ref_k, ref_v, slots)
    got_k, got_v = k_cache.to(device), v_cache.to(device)
    triton_ops.write_kv_cache(key.to(device), value.to(device), got_k, got_v, slots.to(device))
    # Same dtype in and out: a pure copy, so exact equality everywhere (touched or not).
    for got, want, other in ((got_k.cpu(), want_k, ref_k), (got_v.cpu(), want_v, ref_v)):
        assert torch.equal(got, want)
        assert torch.equal(got, other)


def test_write_kv_cache_converts_dtype_and_strided_input(triton_ops, kt, device) -> None:
    """fp32 K/V (strided views of a fused qkv buffer) stored into a bf16 cache."""
    gen = torch.Generator().manual_seed(5)
    k_cache = _cache(gen, (4, 16, 2, 32), torch.bfloat16)
    v_cache = _cache(gen, (4, 16, 2, 32), torch.bfloat16)
    qkv = torch.randn(6, 8, 32, generator=gen)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([0, 17, -1, 63, 40, 5])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    ref.write_kv_cache(key, value, want_k, want_v, slots)
    qkv_d = qkv.to(device)
    got_k, got_v = k_cache.to(device), v_cache.to(device)
    triton_ops.write_kv_cache(qkv_d[:, 4:6], qkv_d[:, 6:8], got_k, got_v, slots.to(device))
    written = torch.zeros(4 * 16, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    for got, want in ((got_k.cpu(), want_k), (got_v.cpu(), want_v)):
        flat_got, flat_want = got.view(64, 2, 32), want.view(64, 2, 32)
        assert torch.equal(flat_got[~written], flat_want[~written])  # untouched: exact bits
        kt.assert_close(flat_got[written], flat_want[written], torch.bfloat16, "converted slots")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_gather_kv_blocks(triton_ops, kt, device, dtype: torch.dtype, block_size: int) -> None:
    gen = torch.Generator().manual_seed(10 + block_size)
    cache = _cache(gen, (9, block_size, 2, 20), dtype)
    ids = torch.tensor([7, 0, 3, 8, 3], dtype=torch.int32)  # a repeated block is fine for a gather
    with kt.poisoned():
        got = triton_ops.gather_kv_blocks(cache.to(device), ids.to(device)).cpu()
    assert got.shape == (5, block_size, 2, 20) and got.is_contiguous()
    assert torch.equal(got, torch.stack([cache[i] for i in ids.tolist()]))
    assert torch.equal(got, ref.gather_kv_blocks(cache, ids))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_scatter_kv_blocks(triton_ops, device, dtype: torch.dtype, block_size: int) -> None:
    gen = torch.Generator().manual_seed(20 + block_size)
    cache = _cache(gen, (9, block_size, 2, 20), dtype)
    ids = torch.tensor([4, 8, 0])
    buffer = _cache(gen, (3, block_size, 2, 20), dtype)
    want = cache.clone()
    for j, i in enumerate(ids.tolist()):
        want[i] = buffer[j]
    ref_cache = cache.clone()
    ref.scatter_kv_blocks(ref_cache, ids, buffer)
    got = cache.to(device)
    triton_ops.scatter_kv_blocks(got, ids.to(device), buffer.to(device))
    assert torch.equal(got.cpu(), want) and torch.equal(got.cpu(), ref_cache)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_copy_blocks(triton_ops, device, dtype: torch.dtype, block_size: int) -> None:
    gen = torch.Generator().manual_seed(30 + block_size)
    cache = _cache(gen, (10, block_size, 3, 16), dtype)
    src = torch.tensor([1, 1, 6], dtype=torch.int64)  # one source forked twice (copy-on-write)
    dst = torch.tensor([7, 2, 9], dtype=torch.int64)
    want = cache.clone()
    for s, d in zip(src.tolist(), dst.tolist()):
        want[d] = cache[s]
    ref_cache = cache.clone()
    ref.copy_blocks(ref_cache, src, dst)
    got = cache.to(device)
    triton_ops.copy_blocks(got, src.to(device), dst.to(device))
    assert torch.equal(got.cpu(), want) and torch.equal(got.cpu(), ref_cache)


def test_block_ops_on_a_layer_slice(triton_ops, device) -> None:
    """A cache that is one layer of a bigger allocation: block stride differs from block size."""
    gen = torch.Generator().manual_seed(40)
    before = torch.randn(6, 2, 8, 2, 16, generator=gen)  # [blocks, layers, bs, H, D]
    full = before.to(device)
    cache = full[:, 1]
    assert not cache.is_contiguous()
    ids = lambda *i: torch.tensor(i, device=device)  # noqa: E731
    got = triton_ops.gather_kv_blocks(cache, ids(5, 2))
    assert torch.equal(got.cpu(), before[[5, 2], 1])
    triton_ops.copy_blocks(cache, ids(0), ids(3))
    triton_ops.scatter_kv_blocks(cache, ids(4), got[:1])
    want = before.clone()
    want[3, 1] = before[0, 1]
    want[4, 1] = before[5, 1]
    assert torch.equal(full.cpu(), want)  # layer 0 and untouched blocks keep their bits


def test_empty_inputs_are_no_ops(triton_ops, device) -> None:
    cache = torch.randn(3, 8, 1, 16, device=device)
    before = cache.clone()
    none = torch.empty(0, dtype=torch.int64, device=device)
    kv = torch.empty(0, 1, 16, device=device)
    triton_ops.write_kv_cache(kv, kv, cache, cache, none)
    triton_ops.copy_blocks(cache, none, none)
    triton_ops.scatter_kv_blocks(cache, none, torch.empty(0, 8, 1, 16, device=device))
    assert triton_ops.gather_kv_blocks(cache, none).shape == (0, 8, 1, 16)
    assert torch.equal(cache, before)
