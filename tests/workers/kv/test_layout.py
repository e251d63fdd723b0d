"""One allocation per KV cache: per-layer views for the kernels, one stacked view for block moves
across every layer, and the same bytes moved whichever path a copy takes."""

from __future__ import annotations

import pytest
import torch
from baton_serve.workers.kv.layout import allocate_kv, split_layers, stacked
from baton_serve.workers.kv.shared import allocate_shared
from baton_serve.workers.kv.transfer import KVTransferEngine

LAYERS, SHAPE = 3, (10, 4, 2, 8)  # [blocks, block_size, kv_heads, head_dim]


def _fill(caches, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for k, v in caches:
        k.copy_(torch.randn(k.shape, generator=g).to(k.device))
        v.copy_(torch.randn(v.shape, generator=g).to(v.device))


def _separate(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


def test_the_stacked_view_is_the_layers_in_order_and_shares_their_memory() -> None:
    caches = allocate_kv(LAYERS, SHAPE, torch.bfloat16)
    stack = stacked(caches)
    assert stack is not None and stack.shape == (2 * LAYERS,) + SHAPE
    stack[3, 7].fill_(5)  # V of layer 1, block 7
    assert (caches[1][1][7] == 5).all() and not caches[1][0].any() and not caches[2][0].any()
    assert all(k.is_contiguous() and v.is_contiguous() for k, v in caches)


def test_caches_that_are_not_one_allocation_in_order_have_no_stacked_view() -> None:
    caches = allocate_kv(LAYERS, SHAPE, torch.float32)
    assert stacked(_separate(caches)) is None
    tail = stacked(caches[1:])  # layers 1 and 2: still consecutive, a view of the allocation's end
    assert tail is not None and tail.data_ptr() == caches[1][0].data_ptr() and tail.shape[0] == 4
    assert stacked([(caches[0][1], caches[0][0])]) is None  # V before K
    assert stacked(caches[::-1]) is None
    assert stacked([]) is None
    flat = torch.zeros(2 * LAYERS * 10 * 4 * 2 * 8)
    assert stacked(split_layers(flat, LAYERS, SHAPE)) is not None


def test_a_copy_across_every_layer_at_once_moves_what_the_per_layer_copy_moves() -> None:
    source, _ = allocate_shared(LAYERS, SHAPE, torch.bfloat16)  # a peer's mapped cache is stacked too
    _fill(source, 3)
    src, dst = [9, 0, 4, 3], [2, 8, 5, 0]
    fast, slow = allocate_kv(LAYERS, SHAPE, torch.bfloat16), [(torch.zeros(SHAPE, dtype=torch.bfloat16),
                                                               torch.zeros(SHAPE, dtype=torch.bfloat16))
                                                              for _ in range(LAYERS)]
    fast_engine, slow_engine = KVTransferEngine(fast, 4, "cpu"), KVTransferEngine(slow, 4, "cpu")
    assert fast_engine._stack is not None and slow_engine._stack is None
    assert fast_engine.copy_blocks_from(source, src, dst) == slow_engine.copy_blocks_from(_separate(source), src, dst)
    for (k, v), (sk, sv), (ek, ev) in zip(fast, slow, source):
        assert torch.equal(k, sk) and torch.equal(v, sv)
        assert torch.equal(k[dst], ek[src]) and torch.equal(v[dst], ev[src])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_a_whole_shipment_gathers_and_scatters_the_same_either_way(device: str) -> None:
    caches = allocate_kv(LAYERS, SHAPE, torch.float16, device)
    _fill(caches, 5)
    fast, slow = KVTransferEngine(caches, 4, device), KVTransferEngine(_separate(caches), 4, device)
    ids = torch.tensor([7, 1, 3], device=device)
    buf = fast._gather_all(ids)
    assert buf.shape == fast.buffer_shape(3) and torch.equal(buf, slow._gather_all(ids))
    into_fast = allocate_kv(LAYERS, SHAPE, torch.float16, device)
    into_slow = _separate(allocate_kv(LAYERS, SHAPE, torch.float16, device))
    dst = torch.tensor([0, 9, 2], device=device)
    KVTransferEngine(into_fast, 4, device)._scatter_all(dst, buf)
    KVTransferEngine(into_slow, 4, device)._scatter_all(dst, buf)
    for (k, v), (sk, sv), (ck, cv) in zip(into_fast, into_slow, caches):
        assert torch.equal(k, sk) and torch.equal(v, sv)
        assert torch.equal(k[dst], ck[ids]) and torch.equal(v[dst], cv[ids])
