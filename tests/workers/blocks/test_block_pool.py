"""BlockPool: free-queue order, refcounts, hash map, LRU eviction and events."""

from __future__ import annotations

import pytest
from baton_serve.workers.blocks.pool import BlockPool, CacheEntry
from baton_serve.workers.errors import KVCacheError, OutOfBlocksError
from baton_serve.workers.kv.events import AllBlocksCleared, BlockRemoved, BlockStored


def h(i: int) -> bytes:
    return bytes([i]) * 16


def entry(block_id: int, i: int, parent: int | None) -> CacheEntry:
    return CacheEntry(block_id, h(i), None if parent is None else h(parent), [i] * 2)


def make(n: int = 6) -> tuple[BlockPool, list]:
    events: list = []
    return BlockPool(n, events.append), events


def test_allocation_order_is_head_first_and_frees_go_to_tail() -> None:
    pool, _ = make()
    assert pool.allocate(3) == [0, 1, 2]
    pool.release([1, 0])
    assert pool.free_queue() == [3, 4, 5, 1, 0]
    assert pool.allocate(4) == [3, 4, 5, 1]
    assert pool.num_free == 1 and pool.ref_count(1) == 1 and pool.ref_count(2) == 1


def test_refcounted_block_is_free_only_after_last_release() -> None:
    pool, _ = make()
    [b] = pool.allocate(1)
    pool.acquire([b])
    pool.release([b])
    assert not pool.is_free(b) and pool.ref_count(b) == 1
    pool.release([b])
    assert pool.is_free(b) and pool.free_queue()[-1] == b


def test_release_of_a_free_block_raises_and_changes_nothing() -> None:
    pool, _ = make()
    a, b = pool.allocate(2)
    with pytest.raises(KVCacheError):
        pool.release([a, 5])
    assert pool.ref_count(a) == 1 and pool.num_free == 4


def test_over_allocation_raises_and_changes_nothing() -> None:
    pool, _ = make()
    pool.allocate(4)
    before = pool.free_queue()
    with pytest.raises(OutOfBlocksError):
        pool.allocate(3)
    assert pool.free_queue() == before


def test_cached_blocks_are_evicted_in_lru_order_with_events() -> None:
    pool, events = make(4)
    ids = pool.allocate(4)
    assert pool.cache_blocks([entry(0, 10, None), entry(1, 11, 10), entry(2, 12, 11)], 2) == 3
    assert events == [BlockStored([h(10), h(11), h(12)], None, [10, 10, 11, 11, 12, 12], 2)]
    pool.release(ids[::-1])  # tail block first -> evicted first
    assert pool.free_queue() == [3, 2, 1, 0]
    assert pool.lookup(h(11)) == 1  # still hittable while unreferenced
    events.clear()
    assert pool.allocate(2) == [3, 2]  # block 3 was never cached: no event for it
    assert events == [BlockRemoved([h(12)])]
    assert pool.num_evicted == 1  # the never-cached block is no eviction
    assert pool.lookup(h(12)) is None and pool.blocks[2].block_hash is None
    assert pool.allocate(2) == [1, 0]
    assert events[-1] == BlockRemoved([h(11), h(10)])
    assert pool.num_cached == 0 and pool.num_evicted == 3


def test_acquire_revives_a_cached_free_block_out_of_the_queue() -> None:
    pool, _ = make(3)
    ids = pool.allocate(3)
    pool.cache_blocks([entry(1, 7, None)], 2)
    pool.release(ids)
    pool.acquire([pool.lookup(h(7))])
    assert pool.free_queue() == [0, 2] and pool.ref_count(1) == 1
    assert pool.allocate(2) == [0, 2]
    assert pool.lookup(h(7)) == 1  # a referenced block is never evicted


def test_duplicate_hash_keeps_existing_mapping() -> None:
    pool, events = make()
    pool.allocate(3)
    pool.cache_blocks([entry(0, 5, None)], 2)
    events.clear()
    assert pool.cache_blocks([entry(1, 5, None), entry(2, 6, 5)], 2) == 1
    assert pool.lookup(h(5)) == 0 and pool.blocks[1].block_hash is None
    assert events == [BlockStored([h(6)], h(5), [6, 6], 2)]
    # Re-offering an already cached block is a no-op.
    assert pool.cache_blocks([entry(2, 6, 5)], 2) == 0 and len(events) == 1


def test_stored_events_split_at_chain_breaks() -> None:
    pool, events = make()
    pool.allocate(3)
    pool.cache_blocks([entry(0, 1, None), entry(1, 2, 1), entry(2, 9, 8)], 2)
    assert [e.block_hashes for e in events] == [[h(1), h(2)], [h(9)]]
    assert events[1].parent_hash == h(8)


def test_clear_cache_forgets_all_hashes() -> None:
    pool, events = make()
    ids = pool.allocate(2)
    pool.cache_blocks([entry(0, 1, None), entry(1, 2, 1)], 2)
    pool.release([ids[1]])
    pool.clear_cache()
    assert events[-1] == AllBlocksCleared()
    assert pool.lookup(h(1)) is None and pool.lookup(h(2)) is None and pool.num_cached == 0
    assert pool.ref_count(0) == 1 and pool.num_free == 5
    events.clear()
    pool.allocate(5)
    assert events == []  # nothing left to evict
    assert pool.num_evicted == 0  # a clear is not an eviction
