"""Physical KV blocks: reference counts, the free queue, and the hash -> block map.

One free queue holds every block whose refcount is 0, whether never used or still
holding cached KV (evictable). Allocation pops from the head; freed blocks are
appended to the tail, so the head is always the least recently freed block and
popping a cached block evicts it (LRU). The queue is an ``OrderedDict`` so that
pop-head, push-tail and remove-from-middle (a cache hit revives a free block) are
all O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from baton_serve.workers.errors import KVCacheError, OutOfBlocksError
from baton_serve.workers.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


@dataclass(slots=True)
class KVBlock:
    """One physical block. ``block_hash`` is set only while the block is in the prefix cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


@dataclass(frozen=True)
class CacheEntry:
    """A full, computed block offered to the prefix cache (see ``BlockPool.cache_blocks``)."""

    block_id: int
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: Sequence[int]


class BlockPool:
    """Owns every physical block; the only place refcounts and cache hashes change.

    Callers check ``num_free`` before ``allocate``; this class raises rather than
    half-allocating. Events go to ``event_sink`` synchronously, in the order the
    cache changed.
    """

    def __init__(self, num_blocks: int, event_sink: Callable[[KVEvent], None] | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._sink = event_sink
        self.num_evicted = 0  # cached blocks popped for reuse, since start

    @property
    def num_free(self) -> int:
        """Blocks with refcount 0 (never used, freed, or cached-but-unreferenced)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks currently hittable through the prefix cache (referenced or not)."""
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_cnt

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def free_queue(self) -> list[int]:
        """Free block ids from head (next to be allocated) to tail; for tests and debugging."""
        return list(self._free)

    def lookup(self, block_hash: bytes) -> int | None:
        """Block holding ``block_hash``, or None. Does not touch LRU order."""
        return self._cached.get(block_hash)

    def allocate(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the head of the free queue, each with refcount 1.

        Popped blocks that were cached lose their hash; one ``BlockRemoved`` event lists
        them in eviction order. Raises ``OutOfBlocksError`` (changing nothing) if fewer
        than ``n`` blocks are free.
        """
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} KV blocks, only {len(self._free)} free")
        out: list[int] = []
        evicted: list[bytes] = []
        for _ in range(n):
            block_id, _none = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block_id)
        if evicted:
            self.num_evicted += len(evicted)
            self._emit(BlockRemoved(evicted))
        return out

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block; a free (cached) block leaves the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the given order.

        A block reaching 0 is appended to the free-queue tail (keeping its hash, so it
        stays hittable until evicted): pass the blocks that should be evicted first
        first. Raises ``KVCacheError``, changing nothing, if any block is already free.
        """
        block_ids = list(block_ids)
        for block_id in block_ids:
            if self.blocks[block_id].ref_cnt <= 0:
                raise KVCacheError(f"double free of KV block {block_id}")
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    def cache_blocks(self, entries: Sequence[CacheEntry], block_size: int) -> int:
        """Make full, computed blocks hittable; returns how many were newly cached.

        A hash already mapped (to this or another block) keeps its existing mapping:
        the duplicate block stays uncached and is recycled plainly when freed. Each
        run of chain-consecutive newly cached blocks yields one ``BlockStored``.
        """
        stored = 0
        run: list[CacheEntry] = []
        for entry in entries:
            block = self.blocks[entry.block_id]
            if entry.block_hash in self._cached or block.block_hash is not None:
                self._flush_stored(run, block_size)
                continue
            block.block_hash = entry.block_hash
            self._cached[entry.block_hash] = entry.block_id
            stored += 1
            if run and run[-1].block_hash != entry.parent_hash:
                self._flush_stored(run, block_size)
            run.append(entry)
        self._flush_stored(run, block_size)
        return stored

    def clear_cache(self) -> None:
        """Forget every cached hash, referenced blocks included; emits ``AllBlocksCleared``.

        Referenced blocks keep their contents for their current holders but are never
        hit again, so the router's "nothing is cached" view after the event is exact.
        """
        for block_id in self._cached.values():
            self.blocks[block_id].block_hash = None
        self._cached.clear()
        self._emit(AllBlocksCleared())

    def _flush_stored(self, run: list[CacheEntry], block_size: int) -> None:
        if not run:
            return
        tokens: list[int] = []
        for entry in run:
            tokens.extend(entry.token_ids)
        self._emit(BlockStored([e.block_hash for e in run], run[0].parent_hash, tokens, block_size))
        run.clear()

    def _emit(self, event: KVEvent) -> None:
        if self._sink is not None:
            self._sink(event)
