"""Per-sequence block tables on top of ``BlockPool``: prefix-cache lookup, allocation,
fork with copy-on-write, and idempotent free.

Contract with the scheduler, per step and sequence:
``find_cached_prefix`` then, immediately, the first ``allocate`` (a lookup result can
go stale once other sequences allocate and evict); later steps call ``allocate`` to
grow the table; after the forward, ``commit_computed`` publishes newly full blocks;
``free`` on every terminal path (safe to repeat). Before each forward the model
runner applies ``take_pending_copies()`` in list order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from baton_serve.workers.blocks.pool import BlockPool, CacheEntry
from baton_serve.workers.blocks.prefix_hash import CacheNamespace, block_hashes
from baton_serve.workers.errors import KVCacheError
from baton_serve.workers.kv.events import KVEvent


@dataclass(slots=True)
class _SeqState:
    """What the manager knows about one sequence.

    ``hashes`` memoises the chain hashes of the sequence's full token blocks (valid as
    long as the sequence only appends tokens). ``num_committed`` leading blocks have
    already been offered to the prefix cache.
    """

    root: bytes
    salt: str | None
    hashes: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    allocated: bool = False
    num_committed: int = 0


class BlockManager:
    """Maps sequences to physical KV blocks; owns the pool and all refcount changes.

    Every mutating method either succeeds completely or raises/returns False having
    changed nothing (apart from hash memos and lookup counters).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        namespace: CacheNamespace | None = None,
        event_sink: Callable[[KVEvent], None] | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        namespace = namespace or CacheNamespace(model="", weights_hash="", block_size=block_size)
        if namespace.block_size != block_size:
            raise ValueError(f"namespace.block_size={namespace.block_size} != block_size={block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.namespace = namespace
        self._pool = BlockPool(num_blocks, event_sink)
        self._seqs: dict[str, _SeqState] = {}
        self._roots: dict[str | None, bytes] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self._queries = 0
        self._hits = 0

    # ----------------------------------------------------------------- queries
    @property
    def pool(self) -> BlockPool:
        """The underlying pool, for inspection; mutate only through this manager."""
        return self._pool

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: never used, freed, or cached but unreferenced."""
        return self._pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences."""
        return 1.0 - self._pool.num_free / self.num_blocks

    @property
    def num_cached_queries(self) -> int:
        """Prompt tokens looked up by ``find_cached_prefix`` (every call counts)."""
        return self._queries

    @property
    def num_cached_hits(self) -> int:
        """Of those, tokens found cached."""
        return self._hits

    @property
    def num_evicted_blocks(self) -> int:
        """Cached blocks evicted to make room, since start (a clear does not count)."""
        return self._pool.num_evicted

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self._pool.num_free

    def __contains__(self, seq_id: object) -> bool:
        st = self._seqs.get(seq_id)  # type: ignore[arg-type]
        return st is not None and st.allocated

    def block_table(self, seq_id: str) -> list[int]:
        """Physical block ids in logical order (a copy the caller may keep)."""
        return list(self._live(seq_id).block_ids)

    def find_cached_prefix(self, seq_id: str, token_ids: Sequence[int], salt: str | None = None) -> int:
        """Number of leading prompt tokens (a multiple of block_size) whose KV is cached.

        Stops at the first missing block, and never covers the last token (its logits
        are needed), so the result is <= (len(token_ids) - 1) rounded down to a block.
        Only updates the sequence's hash memo and the hit/query counters.
        """
        if not self.enable_prefix_caching:
            return 0
        st = self._memo_state(seq_id, salt)
        max_blocks = max((len(token_ids) - 1) // self.block_size, 0)
        self._extend_memo(st, token_ids, max_blocks)
        lookup = self._pool.lookup
        hits = 0
        hashes = st.hashes
        while hits < max_blocks and lookup(hashes[hits]) is not None:
            hits += 1
        self._queries += len(token_ids)
        self._hits += hits * self.block_size
        return hits * self.block_size

    # ---------------------------------------------------------------- mutation
    def allocate(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        num_cached_tokens: int = 0,
        salt: str | None = None,
    ) -> bool:
        """Make the table cover ``num_computed_tokens + num_new_tokens`` positions.

        First call: ``num_cached_tokens`` (from ``find_cached_prefix``, <= num_computed)
        leading blocks are taken from the cache; ``salt`` fixes the sequence's namespace.
        Later calls ignore both. Blocks in the write range that other sequences share are
        replaced by private copies (recorded for ``take_pending_copies``). Returns False,
        changing nothing, when too few blocks are free; may evict cached blocks otherwise.
        """
        if num_computed_tokens < 0 or num_new_tokens < 0:
            raise KVCacheError(f"negative token counts ({num_computed_tokens}, {num_new_tokens})")
        st = self._seqs.get(seq_id)
        if st is not None and st.allocated:
            return self._grow(st, num_computed_tokens, num_new_tokens)
        return self._allocate_first(
            seq_id, st, token_ids, num_computed_tokens, num_new_tokens, num_cached_tokens, salt
        )

    def commit_computed(self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Publish every block that is full and computed (positions < num_computed_tokens).

        ``token_ids`` is prompt + output so far. Hashes already cached elsewhere keep
        their existing block (this one stays uncached). Emits ``BlockStored``.
        """
        st = self._live(seq_id)
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(num_computed_tokens // bs, len(st.block_ids))
        if full <= st.num_committed:
            return
        if len(token_ids) < full * bs:
            raise KVCacheError(f"{seq_id}: {len(token_ids)} token ids for {num_computed_tokens} computed")
        self._extend_memo(st, token_ids, full)
        hashes, table = st.hashes, st.block_ids
        entries = [
            CacheEntry(table[i], hashes[i], hashes[i - 1] if i else None, token_ids[i * bs : (i + 1) * bs])
            for i in range(st.num_committed, full)
        ]
        self._pool.cache_blocks(entries, bs)
        st.num_committed = full

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` all of the parent's blocks (refcount++), for n > 1 sampling.

        The child's later token ids must start with the parent's tokens at fork time.
        Needs no free blocks; writes into shared tail blocks are copied on write.
        """
        parent = self._live(parent_id)
        if child_id in self:
            raise KVCacheError(f"fork target {child_id!r} already has blocks")
        self._pool.acquire(parent.block_ids)
        self._seqs[child_id] = _SeqState(
            parent.root, parent.salt, list(parent.hashes), list(parent.block_ids), True, parent.num_committed
        )

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies to apply, in order, before the next forward; clears them."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def free(self, seq_id: str) -> int:
        """Drop the sequence and one reference per block; returns the table length.

        Idempotent: unknown or already freed sequences return 0. Blocks are released last
        logical block first, so a prefix's later blocks are evicted before its earlier ones.
        """
        st = self._seqs.pop(seq_id, None)
        if st is None or not st.allocated:
            return 0
        self._pool.release(st.block_ids[::-1])
        if self._pending_copies:
            # A copy into a block nobody holds any more would clobber its next owner.
            is_free = self._pool.is_free
            self._pending_copies = [c for c in self._pending_copies if not is_free(c[1])]
        return len(st.block_ids)

    def reset_prefix_cache(self) -> bool:
        """Make every cached block unhittable (referenced ones too); emits AllBlocksCleared.

        Always succeeds and returns True (bool kept for vLLM API parity).
        """
        self._pool.clear_cache()
        return True

    # ----------------------------------------------------------------- helpers
    def _live(self, seq_id: str) -> _SeqState:
        st = self._seqs.get(seq_id)
        if st is None or not st.allocated:
            raise KVCacheError(f"unknown sequence {seq_id!r} (never allocated or already freed)")
        return st

    def _root(self, salt: str | None) -> bytes:
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = self.namespace.root_hash(salt)
        return root

    def _memo_state(self, seq_id: str, salt: str | None) -> _SeqState:
        root = self._root(salt)
        st = self._seqs.get(seq_id)
        if st is None or (st.root != root and not st.allocated):
            st = self._seqs[seq_id] = _SeqState(root, salt)
        elif st.root != root:
            raise KVCacheError(f"{seq_id!r} is allocated under salt {st.salt!r}, not {salt!r}")
        return st

    def _extend_memo(self, st: _SeqState, token_ids: Sequence[int], num_blocks: int) -> None:
        if len(st.hashes) < num_blocks:
            st.hashes += block_hashes(
                st.root, token_ids, self.block_size, prev=st.hashes, stop=num_blocks * self.block_size
            )

    def _allocate_first(
        self,
        seq_id: str,
        st: _SeqState | None,
        token_ids: Sequence[int],
        num_computed: int,
        num_new: int,
        num_cached: int,
        salt: str | None,
    ) -> bool:
        bs = self.block_size
        if num_cached:
            if not self.enable_prefix_caching:
                raise KVCacheError("num_cached_tokens > 0 with prefix caching disabled")
            if num_cached % bs or num_cached > num_computed or num_cached > len(token_ids):
                raise KVCacheError(
                    f"num_cached_tokens={num_cached} must be a multiple of {bs}, <= num_computed_tokens="
                    f"{num_computed} and <= {len(token_ids)} prompt tokens"
                )
        root = self._root(salt)
        if st is None or st.root != root:
            st = _SeqState(root, salt)  # registered below only on success
        num_hit = num_cached // bs
        self._extend_memo(st, token_ids, num_hit)
        pool = self._pool
        hit_ids: list[int] = []
        for h in st.hashes[:num_hit]:
            block_id = pool.lookup(h)
            if block_id is None:
                raise KVCacheError(f"{seq_id!r}: cached prefix was evicted since find_cached_prefix")
            hit_ids.append(block_id)
        num_fresh = max(-(-(num_computed + num_new) // bs) - num_hit, 0)
        # Hit blocks sitting in the free queue stop being free once referenced.
        num_revived = sum(1 for b in hit_ids if pool.ref_count(b) == 0)
        if num_fresh + num_revived > pool.num_free:
            return False
        pool.acquire(hit_ids)
        st.block_ids = hit_ids + pool.allocate(num_fresh)
        st.allocated = True
        st.num_committed = num_hit
        self._seqs[seq_id] = st
        return True

    def _grow(self, st: _SeqState, num_computed: int, num_new: int) -> bool:
        # Hot path: called for every running sequence every step.
        if num_new == 0:
            return True
        bs = self.block_size
        table = st.block_ids
        first = num_computed // bs
        if first < st.num_committed:
            raise KVCacheError(f"write at position {num_computed} would modify a committed (cached) block")
        total = num_computed + num_new
        num_extra = -(-total // bs) - len(table)
        blocks = self._pool.blocks
        shared = [i for i in range(first, min(-(-total // bs), len(table))) if blocks[table[i]].ref_cnt > 1]
        num_alloc = max(num_extra, 0) + len(shared)
        if num_alloc == 0:
            return True
        if num_alloc > self._pool.num_free:
            return False
        new_ids = self._pool.allocate(num_alloc)
        if shared:
            srcs = []
            # A shared block may itself still wait for its copy (a fork of a fork before any
            # forward): copy from where its contents come from, so that this copy does not depend
            # on that one, which ``free`` drops if its destination is released first.
            waiting = {d: s for s, d in self._pending_copies}
            for i, dst in zip(shared, new_ids):
                srcs.append(table[i])
                # Only a block holding already computed positions has contents worth copying.
                if i * bs < num_computed:
                    self._pending_copies.append((waiting.get(table[i], table[i]), dst))
                table[i] = dst
            self._pool.release(srcs)
            new_ids = new_ids[len(shared) :]
        table.extend(new_ids)
        return True
