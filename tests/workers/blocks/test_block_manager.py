"""BlockManager: exact block ids, prefix hits and isolation, fork + copy-on-write, free."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest
from baton_serve.workers.blocks.manager import BlockManager
from baton_serve.workers.blocks.prefix_hash import CacheNamespace, block_hashes
from baton_serve.workers.errors import KVCacheError
from baton_serve.workers.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

BS = 4


def make(num_blocks: int = 10, **kw) -> tuple[BlockManager, list]:
    events: list = []
    return BlockManager(num_blocks, BS, event_sink=events.append, **kw), events


def run_prompt(bm: BlockManager, sid: str, toks: list[int], salt: str | None = None) -> int:
    """Schedule a whole prompt, 'compute' it and publish its blocks; returns the cache hit."""
    cached = bm.find_cached_prefix(sid, toks, salt)
    assert bm.allocate(sid, toks, cached, len(toks) - cached, cached, salt)
    bm.commit_computed(sid, toks, len(toks))
    return cached


def test_exact_ids_and_lru_eviction_of_later_blocks_first() -> None:
    bm, events = make(10)
    a, b, c = list(range(10)), [50 + i for i in range(6)], [70 + i for i in range(4)]
    run_prompt(bm, "a", a)
    run_prompt(bm, "b", b)
    run_prompt(bm, "c", c)
    assert (bm.block_table("a"), bm.block_table("b"), bm.block_table("c")) == ([0, 1, 2], [3, 4], [5])
    assert bm.free("b") == 2 and bm.free("a") == 3
    assert bm.pool.free_queue() == [6, 7, 8, 9, 4, 3, 2, 1, 0]
    assert bm.num_free_blocks == 9 and bm.usage == pytest.approx(0.1)
    events.clear()
    assert bm.allocate("d", [1] * 24, 0, 24)  # 6 blocks: 4 never-cached, then b's blocks
    assert bm.block_table("d") == [6, 7, 8, 9, 4, 3]
    hb = block_hashes(bm.namespace.root_hash(), b, BS)
    assert events == [BlockRemoved([hb[0]])]  # block 4 held b's partial tail: never cached
    events.clear()
    assert bm.allocate("e", [2] * 8, 0, 8)
    ha = block_hashes(bm.namespace.root_hash(), a, BS)
    assert bm.block_table("e") == [2, 1]
    assert events == [BlockRemoved([ha[1]])]  # a's second block goes before its first
    assert bm.find_cached_prefix("a2", a) == 4  # a's first block survived


def test_shared_prefix_uses_same_physical_blocks() -> None:
    bm, events = make(10)
    p = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    run_prompt(bm, "a", p)
    assert [type(e) for e in events] == [BlockStored]  # two full blocks, one event
    assert events[0].block_hashes == block_hashes(bm.namespace.root_hash(), p, BS)
    assert bm.find_cached_prefix("b", p[:8] + [99, 98, 97]) == 8
    assert bm.allocate("b", p[:8] + [99, 98, 97], 8, 3, 8)
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2] == [0, 1]
    assert bm.block_table("b")[2] == 3  # a's partial block 2 is never shared
    assert [bm.pool.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    assert (bm.num_cached_queries, bm.num_cached_hits) == (10 + 11, 8)


def test_partial_block_and_last_token_never_count_as_cached() -> None:
    bm, _ = make(10)
    run_prompt(bm, "a", list(range(10)))
    assert bm.find_cached_prefix("x", list(range(10))) == 8  # block 2 is partial, not cached
    assert bm.find_cached_prefix("y", list(range(8))) == 4  # exactly 2 blocks: last token recomputed
    assert bm.find_cached_prefix("z", list(range(5))) == 4
    assert bm.find_cached_prefix("w", list(range(4))) == 0
    assert bm.find_cached_prefix("v", []) == 0


def test_salt_isolates_tenants() -> None:
    bm, _ = make(10)
    p = list(range(9))
    run_prompt(bm, "a", p, salt="tenant-a")
    assert bm.find_cached_prefix("b", p, salt="tenant-b") == 0
    assert bm.find_cached_prefix("c", p) == 0  # the shared namespace is a separate chain too
    assert bm.find_cached_prefix("d", p, salt="tenant-a") == 8


@pytest.mark.parametrize(
    "change", [{"model": "m2"}, {"tokenizer_hash": "t2"}, {"chat_template_hash": "c2"}, {"kv_dtype": "fp8"}]
)
def test_different_namespace_never_produces_the_same_hashes(change: dict) -> None:
    # Each engine owns one namespace, so isolation shows in what it publishes to the router.
    base = CacheNamespace(model="m", weights_hash="w", block_size=BS)
    other = CacheNamespace(**{**base.__dict__, **change})
    published = []
    for ns in (base, other):
        events: list = []
        bm = BlockManager(10, BS, namespace=ns, event_sink=events.append)
        run_prompt(bm, "a", list(range(9)))
        published.append({h for e in events for h in e.block_hashes})
    assert len(published[0]) == 2 and not published[0] & published[1]


def test_same_tokens_not_at_the_start_never_hit() -> None:
    bm, _ = make(10)
    run_prompt(bm, "a", [1, 1, 1, 1, 2, 2, 2, 2, 3])
    assert bm.find_cached_prefix("b", [2, 2, 2, 2, 3]) == 0
    assert bm.find_cached_prefix("c", [7, 7, 7, 7, 2, 2, 2, 2, 3]) == 0
    assert bm.find_cached_prefix("d", [1, 1, 1, 1, 9, 2, 2, 2, 3]) == 4


def test_fork_copy_on_write_of_partial_tail() -> None:
    bm, _ = make(10)
    p = [1, 2, 3, 4, 5, 6]
    run_prompt(bm, "p", p)  # blocks [0, 1]; block 1 half full
    bm.fork("p", "c1")
    bm.fork("p", "c2")
    assert [bm.pool.ref_count(i) for i in (0, 1)] == [3, 3]
    assert bm.allocate("c1", p + [7], 6, 1)
    assert bm.allocate("c2", p + [8], 6, 1)
    assert bm.allocate("p", p + [9], 6, 1)  # the last holder writes in place
    assert (bm.block_table("c1"), bm.block_table("c2"), bm.block_table("p")) == ([0, 2], [0, 3], [0, 1])
    assert bm.take_pending_copies() == [(1, 2), (1, 3)]
    assert bm.take_pending_copies() == []
    assert [bm.pool.ref_count(i) for i in range(4)] == [3, 1, 1, 1]
    assert bm.free("p") + bm.free("c1") + bm.free("c2") == 6
    assert bm.num_free_blocks == 10 and all(bm.pool.ref_count(i) == 0 for i in range(10))


def test_fork_with_full_tail_needs_no_copy() -> None:
    bm, _ = make(10)
    p = list(range(8))
    run_prompt(bm, "p", p)
    bm.fork("p", "c")
    assert bm.allocate("c", p + [1], 8, 1)
    assert bm.block_table("c") == [0, 1, 2] and bm.take_pending_copies() == []
    assert bm.pool.ref_count(1) == 2


def test_copy_into_a_freed_block_is_dropped() -> None:
    bm, _ = make(10)
    run_prompt(bm, "p", [1, 2])
    bm.fork("p", "c")
    assert bm.allocate("c", [1, 2, 3], 2, 1)
    bm.fork("c", "g")  # g also needs c's pending copy
    bm.free("c")
    assert bm.take_pending_copies() == [(0, 1)]
    assert bm.allocate("g", [1, 2, 3, 4, 5], 3, 2)
    bm.free("g")
    assert bm.take_pending_copies() == []


def test_a_copy_from_a_block_still_waiting_for_its_own_copy_reads_that_copys_source() -> None:
    """Fork, copy on write, fork the copy, copy on write again, then free the middle holder: the
    second copy must not depend on the first, which is dropped with its freed destination."""
    bm, _ = make(10)
    run_prompt(bm, "p", [1])  # block 0 holds position 0
    bm.fork("p", "c")
    assert bm.allocate("c", [1, 1], 1, 1)  # c's tail: block 1, to be copied from block 0
    bm.fork("c", "g")
    assert bm.allocate("g", [1, 1], 1, 1)  # g's tail: block 2, whose contents block 1 has not yet
    bm.free("c")  # block 1 is free: its copy is dropped
    assert bm.block_table("g") == [2]
    assert bm.take_pending_copies() == [(0, 2)]


def test_fork_misuse_raises() -> None:
    bm, _ = make(10)
    with pytest.raises(KVCacheError):
        bm.fork("nobody", "c")
    run_prompt(bm, "p", [1, 2, 3])
    with pytest.raises(KVCacheError):
        bm.fork("p", "p")
    assert bm.pool.ref_count(0) == 1


def test_free_is_idempotent() -> None:
    bm, _ = make(10)
    run_prompt(bm, "a", list(range(9)))
    assert bm.free("a") == 3
    assert bm.free("a") == 0
    assert bm.free("unknown") == 0
    assert bm.num_free_blocks == 10
    bm.find_cached_prefix("m", [1, 2, 3])
    assert bm.free("m") == 0 and "m" not in bm
    with pytest.raises(KVCacheError):
        bm.block_table("a")


def test_failed_allocate_changes_nothing() -> None:
    bm, events = make(4)
    run_prompt(bm, "a", list(range(9)))  # 3 blocks, 2 cached
    bm.free("a")
    events.clear()
    before = (bm.pool.free_queue(), [(b.ref_cnt, b.block_hash) for b in bm.pool.blocks])
    cached = bm.find_cached_prefix("b", list(range(8)) + [0] * 12)
    assert cached == 8
    assert not bm.allocate("b", list(range(8)) + [0] * 12, 8, 12, 8)  # needs 2 hits + 3 new > 4
    assert "b" not in bm and events == []
    assert before == (bm.pool.free_queue(), [(b.ref_cnt, b.block_hash) for b in bm.pool.blocks])
    run_prompt(bm, "c", [5, 6])
    assert not bm.allocate("c", [5, 6] + [0] * 20, 2, 20)
    assert bm.block_table("c") == [3]  # head of the queue: the never-used block


def test_stale_prefix_hit_raises_instead_of_corrupting() -> None:
    bm, _ = make(3)
    run_prompt(bm, "a", list(range(9)))
    bm.free("a")
    assert bm.find_cached_prefix("b", list(range(9))) == 8
    assert bm.allocate("x", [7] * 12, 0, 12)  # evicts everything b was going to reuse
    with pytest.raises(KVCacheError):
        bm.allocate("b", list(range(9)), 8, 1, 8)
    assert "b" not in bm and bm.num_free_blocks == 0


def test_duplicate_blocks_are_not_cached_twice() -> None:
    bm, events = make(10)
    p = list(range(9))
    for sid in ("a", "b"):  # both miss, both compute the same prompt
        assert bm.find_cached_prefix(sid, p) == 0
        assert bm.allocate(sid, p, 0, 9)
    bm.commit_computed("a", p, 9)
    bm.commit_computed("b", p, 9)
    assert len(events) == 1 and bm.pool.num_cached == 2
    assert bm.find_cached_prefix("c", p) == 8
    assert bm.allocate("c", p, 8, 1, 8) and bm.block_table("c")[:2] == bm.block_table("a")[:2]


def test_decode_commits_blocks_as_they_fill() -> None:
    bm, events = make(10)
    toks = [1, 2, 3]
    run_prompt(bm, "a", toks)
    assert events == []
    for t in (4, 5, 6):
        toks.append(t)
        assert bm.allocate("a", toks, len(toks) - 1, 1)
        bm.commit_computed("a", toks, len(toks))
    assert bm.block_table("a") == [0, 1]
    assert [e.token_ids for e in events] == [[1, 2, 3, 4]]
    with pytest.raises(KVCacheError):
        bm.allocate("a", toks, 2, 1)  # would rewrite a published block


def test_reset_prefix_cache() -> None:
    bm, events = make(10)
    run_prompt(bm, "a", list(range(9)))
    run_prompt(bm, "b", [9] * 9)
    bm.free("b")
    assert bm.reset_prefix_cache()
    assert events[-1] == AllBlocksCleared()
    assert bm.find_cached_prefix("x", list(range(9))) == 0
    assert bm.find_cached_prefix("y", [9] * 9) == 0
    assert bm.num_free_blocks == 7 and bm.block_table("a") == [0, 1, 2]


def test_prefix_caching_disabled() -> None:
    bm, events = make(10, enable_prefix_caching=False)
    run_prompt(bm, "a", list(range(9)))
    assert bm.find_cached_prefix("b", list(range(9))) == 0 and events == []
    with pytest.raises(KVCacheError):
        bm.allocate("b", list(range(9)), 8, 1, 8)


def test_decode_steps_for_256_sequences_grow_tables_exactly() -> None:
    """256 decoding sequences, one token per step (the engine's hot path): tables grow by one
    block exactly at block boundaries, and free + used blocks always add up.
    Its speed is measured by benchmarks/engine_throughput.py, not here."""
    rng = random.Random(0)
    bs, n_seqs, steps = 16, 256, 40
    bm = BlockManager(n_seqs * 40, bs)
    toks = {f"s{i}": [rng.randrange(32000) for _ in range(500)] for i in range(n_seqs)}
    for sid, t in toks.items():
        cached = bm.find_cached_prefix(sid, t)
        assert bm.allocate(sid, t, cached, len(t) - cached, cached)
        bm.commit_computed(sid, t, len(t))
    for _ in range(steps):
        for sid, t in toks.items():
            t.append(7)
            assert bm.allocate(sid, t, len(t) - 1, 1)
            bm.commit_computed(sid, t, len(t))
            assert len(bm.block_table(sid)) == (len(t) + bs - 1) // bs
    used = sum(len(bm.block_table(sid)) for sid in toks)
    assert bm.num_free_blocks == bm.num_blocks - used


# ---------------------------------------------------------------------------------------
# Stateful model check. A fake KV store records, per physical slot, the (salt, token
# prefix) whose KV was written there; every computed position of every live sequence
# must read back its own prefix. That catches wrong cache hits, missing copy-on-write
# and copies into the wrong block, not just bookkeeping drift.

NB = 10


@dataclass
class _Seq:
    tokens: list[int]
    salt: str | None
    computed: int
    target: int  # positions < target have blocks and are (being) computed


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.events: list = []
        self.bm = BlockManager(NB, BS, event_sink=self.events.append)
        self.seqs: dict[str, _Seq] = {}
        self.kv: dict[int, dict[int, tuple]] = {}
        self.mirror: set[bytes] = set()  # what a router learns from the events
        self.prompts: list[tuple[list[int], str | None]] = []
        self.freed: list[tuple[list[int], str | None]] = []
        self.n = 0

    def snapshot(self) -> tuple:
        pool = self.bm.pool
        return (
            pool.free_queue(),
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            {s: self.bm.block_table(s) for s in self.seqs},
            list(self.bm._pending_copies),
            len(self.events),
        )

    def pick(self, data, pred=lambda s: True) -> str:
        return data.draw(st.sampled_from(sorted(s for s, q in self.seqs.items() if pred(q))))

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=18), salt=st.sampled_from([None, "t"]))
    def new_seq(self, tokens: list[int], salt: str | None) -> None:
        sid, self.n = f"s{self.n}", self.n + 1
        self.prompts.append((tokens, salt))
        cached = self.bm.find_cached_prefix(sid, tokens, salt)
        assert cached % BS == 0 and 0 <= cached <= len(tokens) - 1
        before = self.snapshot()
        if self.bm.allocate(sid, tokens, cached, len(tokens) - cached, cached, salt):
            self.seqs[sid] = _Seq(list(tokens), salt, cached, len(tokens))
        else:
            assert self.snapshot() == before and sid not in self.bm
            assert self.bm.free(sid) == 0

    @precondition(lambda self: self.prompts)
    @rule(data=st.data(), suffix=st.lists(st.integers(0, 2), max_size=6))
    def resubmit(self, data, suffix: list[int]) -> None:
        # Reuse (part of) an earlier prompt so that prefix hits are common, not luck.
        tokens, salt = data.draw(st.sampled_from(self.prompts))
        cut = data.draw(st.integers(0, len(tokens)))
        self.new_seq(tokens[:cut] + suffix or [0], salt)

    @rule(data=st.data(), leave=st.integers(0, 3))
    def fill(self, data, leave: int) -> None:
        # Memory pressure: a long sequence takes all but `leave` free blocks (the most
        # recently freed, often cached), then maybe a resubmit competes for those few.
        n = self.bm.num_free_blocks - leave
        if n > 0:
            self.new_seq([3] * (n * BS), None)
        if self.freed and data.draw(st.booleans()):
            tokens, salt = self.freed[-1]  # its blocks sit at the free-queue tail
            cut = data.draw(st.one_of(st.just(len(tokens)), st.integers(0, len(tokens))))
            self.new_seq(tokens[:cut] + [0], salt)

    @precondition(lambda self: any(q.target == q.computed for q in self.seqs.values()))
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), max_size=6))
    def schedule(self, data, extra: list[int]) -> None:
        sid = self.pick(data, lambda q: q.target == q.computed)
        q = self.seqs[sid]
        q.tokens += extra
        if len(q.tokens) == q.computed:
            return
        before = self.snapshot()
        if self.bm.allocate(sid, q.tokens, q.computed, len(q.tokens) - q.computed):
            q.target = len(q.tokens)
        else:
            assert self.snapshot() == before

    @precondition(lambda self: any(q.target > q.computed for q in self.seqs.values()))
    @rule(data=st.data())
    def forward(self, data) -> None:
        sid = self.pick(data, lambda q: q.target > q.computed)
        for src, dst in self.bm.take_pending_copies():  # the runner copies before any write
            self.kv[dst] = dict(self.kv.get(src, {}))
        q, table = self.seqs[sid], self.bm.block_table(sid)
        for pos in range(q.computed, q.target):
            self.kv.setdefault(table[pos // BS], {})[pos % BS] = (q.salt, tuple(q.tokens[: pos + 1]))
        q.computed = q.target
        self.bm.commit_computed(sid, q.tokens, q.computed)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = self.pick(data)
        child, self.n = f"s{self.n}", self.n + 1
        self.bm.fork(parent, child)
        p = self.seqs[parent]
        self.seqs[child] = _Seq(list(p.tokens), p.salt, p.computed, p.computed)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data) -> None:
        sid = self.pick(data)
        n = len(self.bm.block_table(sid))
        q = self.seqs.pop(sid)
        self.freed.append((q.tokens[: q.computed], q.salt))
        assert self.bm.free(sid) == n
        assert self.bm.free(sid) == 0

    @rule()
    def reset(self) -> None:
        assert self.bm.reset_prefix_cache()

    @invariant()
    def consistent(self) -> None:
        for e in self.events:
            if isinstance(e, BlockStored):
                assert not self.mirror & set(e.block_hashes)
                self.mirror |= set(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= self.mirror
                self.mirror -= set(e.block_hashes)
            else:
                self.mirror.clear()
        self.events.clear()
        bm, pool = self.bm, self.bm.pool
        tables = {s: bm.block_table(s) for s in self.seqs}
        held = Counter(b for t in tables.values() for b in t)
        for b in range(NB):
            assert pool.ref_count(b) == held[b] and pool.is_free(b) == (held[b] == 0)
        assert bm.num_free_blocks + len(held) == NB
        hashed = {b.block_hash: b.block_id for b in pool.blocks if b.block_hash is not None}
        assert pool.num_cached == len(hashed) and all(pool.lookup(h) == b for h, b in hashed.items())
        assert set(hashed) == self.mirror
        view = dict(self.kv)
        for src, dst in bm._pending_copies:
            view[dst] = dict(view.get(src, {}))
        for sid, q in self.seqs.items():
            table = tables[sid]
            assert len(set(table)) == len(table) and len(table) * BS >= q.target
            for pos in range(q.computed):
                assert view[table[pos // BS]][pos % BS] == (q.salt, tuple(q.tokens[: pos + 1])), (sid, pos)

    def teardown(self) -> None:
        for sid in list(self.seqs):
            self.bm.free(sid)
        assert self.bm.num_free_blocks == NB and self.bm.usage == 0.0
        assert all(b.ref_cnt == 0 for b in self.bm.pool.blocks)
        assert self.bm.take_pending_copies() == []


BlockManagerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestBlockManagerStateful = BlockManagerMachine.TestCase


def test_privatising_an_unwritten_shared_block_copies_nothing() -> None:
    bm, _ = make(10)
    p = [1, 2, 3, 4, 5, 6]
    assert bm.allocate("p", p, 0, 6)  # blocks [0, 1] allocated, nothing computed yet
    bm.fork("p", "c")
    assert bm.allocate("c", p, 0, 6)
    assert bm.block_table("c") == [2, 3] and bm.take_pending_copies() == []
    assert bm.pool.ref_count(0) == bm.pool.ref_count(1) == 1
