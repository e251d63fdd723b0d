"""KV block checksums: equal KV gives equal sums, one flipped bit anywhere that travels does not,
and the empty slots of a request's last block never count."""

from __future__ import annotations

import pytest
import torch
from baton_serve.workers.errors import KVTransferError
from baton_serve.workers.kv.integrity import block_crcs, corrupt_block, verify_blocks
from hypothesis import given, settings
from hypothesis import strategies as st

BS = 4


def _caches(dtype=torch.float32, layers=2, blocks=6):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(blocks, BS, 2, 8, generator=g).to(dtype), torch.randn(blocks, BS, 2, 8, generator=g).to(dtype))
            for _ in range(layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_copies_match_and_one_flipped_byte_does_not(dtype):
    src, dst = _caches(dtype), _caches(dtype)
    for (sk, sv), (dk, dv) in zip(src, dst):  # blocks 0,1,2 of src land in blocks 3,4,5 of dst
        dk[3:6], dv[3:6] = sk[0:3], sv[0:3]
    want = block_crcs(src, [0, 1, 2], num_tokens=11, block_size=BS)
    expected = [(3 + i, i, c) for i, c in enumerate(want)]
    verify_blocks(dst, expected, 11, BS, "r")  # passes
    corrupt_block(dst, 4)
    with pytest.raises(KVTransferError, match=r"1 of 3 block\(s\) \(logical \[1\]\)"):
        verify_blocks(dst, expected, 11, BS, "r")


@settings(max_examples=30, deadline=None)
@given(num_tokens=st.integers(1, 24), layer=st.integers(0, 1), kv=st.integers(0, 1), slot=st.integers(0, BS - 1),
       head=st.integers(0, 1), dim=st.integers(0, 7))
def test_only_slots_holding_kv_count(num_tokens, layer, kv, slot, head, dim):
    caches = _caches()
    blocks = list(range((num_tokens + BS - 1) // BS))
    before = block_crcs(caches, blocks, num_tokens, BS)
    block = min(len(blocks) - 1, 5)
    caches[layer][kv][block, slot, head, dim] += 1.0
    after = block_crcs(caches, blocks, num_tokens, BS)
    holds_kv = block * BS + slot < num_tokens
    assert (after != before) == holds_kv


@pytest.mark.parametrize("heads", [None, (1, 2)])
def test_the_one_gather_sums_what_the_per_layer_loop_summed(heads):
    # the sum is over every layer's K then V at the valid slots, layer by layer: the wire format
    # both ends compute, whatever the code that computes it
    import zlib

    caches = _caches(layers=3)
    if heads is not None:  # a tensor-parallel route's strided head view
        caches = [(k[:, :, heads[0]:heads[1]], v[:, :, heads[0]:heads[1]]) for k, v in caches]
    blocks, num_tokens = [5, 0, 3], 10
    want = []
    for i, b in enumerate(blocks):
        n, crc = min(BS, num_tokens - i * BS), 0
        for k, v in caches:
            for c in (k, v):
                crc = zlib.crc32(c[b, :n].contiguous().view(torch.uint8).numpy().tobytes(), crc)
        want.append(crc)
    assert block_crcs(caches, blocks, num_tokens, BS) == want
