"""The router's prefix index against the workers' own block managers.

The property: after any sequence of allocate / free (eviction) / cache clear / worker restart,
with the router reading the events at random moments through a log small enough to overflow,
the index answers every longest-prefix query exactly as the worker's ``find_cached_prefix`` does.
"""

from __future__ import annotations

from baton_serve.router.prefix_index import PrefixIndex
from baton_serve.workers.blocks.manager import BlockManager
from baton_serve.workers.blocks.prefix_hash import CacheNamespace, block_hashes
from baton_serve.workers.kv.event_log import KVEventLog
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

BS = 2
NS = CacheNamespace(model="m", weights_hash="w", block_size=BS)
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=9)  # a tiny alphabet: prefixes collide
SALTS = st.sampled_from([None, "tenant-a"])


def _hashes(tokens: list[int], salt: str | None) -> list[bytes]:
    return block_hashes(NS.root_hash(salt), tokens, BS, stop=len(tokens) - 1)


class _Worker:
    """One worker's cache: a block manager whose events go to a numbered log."""

    def __init__(self, capacity: int) -> None:
        self.log = KVEventLog(capacity=capacity)
        self.bm = BlockManager(5, BS, namespace=NS, event_sink=self.log)
        self.live: list[str] = []
        self.n = 0

    def longest(self, tokens: list[int], salt: str | None) -> int:
        qid = f"query-{self.n}"
        self.n += 1
        blocks = self.bm.find_cached_prefix(qid, tokens, salt) // BS
        self.bm.free(qid)
        return blocks


class IndexMirrorsWorkers(RuleBasedStateMachine):
    @initialize(capacity=st.sampled_from([1, 3, 64]))
    def start(self, capacity: int) -> None:
        self.capacity = capacity
        self.workers = {"w0": _Worker(capacity), "w1": _Worker(capacity)}
        self.index = PrefixIndex(ttl_s=1e9)
        self.seq = 0
        self.prompts: list[tuple[list[int], str | None]] = []  # queried again: their chains matter

    @rule(w=st.sampled_from(["w0", "w1"]), tokens=TOKENS, salt=SALTS, keep=st.booleans())
    def allocate(self, w: str, tokens: list[int], salt: str | None, keep: bool) -> None:
        """A request runs its prompt; ``keep``: it is still running (else it finished, its blocks
        stay cached until evicted)."""
        worker = self.workers[w]
        sid = f"s{self.seq}"
        self.seq += 1
        self.prompts.append((tokens, salt))
        cached = worker.bm.find_cached_prefix(sid, tokens, salt)
        if worker.bm.allocate(sid, tokens, cached, len(tokens) - cached, num_cached_tokens=cached, salt=salt):
            worker.bm.commit_computed(sid, tokens, len(tokens))
            if keep:
                worker.live.append(sid)
            else:
                worker.bm.free(sid)
        else:
            worker.bm.free(sid)

    @rule(w=st.sampled_from(["w0", "w1"]), data=st.data())
    def free(self, w: str, data: st.DataObject) -> None:
        worker = self.workers[w]
        if worker.live:
            worker.bm.free(worker.live.pop(data.draw(st.integers(0, len(worker.live) - 1))))

    @rule(w=st.sampled_from(["w0", "w1"]))
    def clear(self, w: str) -> None:
        self.workers[w].bm.reset_prefix_cache()

    @rule(w=st.sampled_from(["w0", "w1"]))
    def restart(self, w: str) -> None:
        self.workers[w] = _Worker(self.capacity)  # a new process: empty cache, new epoch

    @rule(w=st.sampled_from(["w0", "w1"]))
    def sync(self, w: str) -> None:
        self._sync(w)

    def _sync(self, w: str) -> None:
        log = self.workers[w].log
        for _ in range(2):  # a refused gap resyncs on the next read
            if self.index.apply(w, log.since(*self.index.cursor(w))) != "gap":
                return
        raise AssertionError("a resync did not follow a gap")

    @rule(tokens=TOKENS, salt=SALTS, data=st.data())
    def query(self, tokens: list[int], salt: str | None, data: st.DataObject) -> None:
        extra = data.draw(st.lists(st.integers(0, 2), max_size=3))
        for w in self.workers:
            self._sync(w)
        # the drawn prompt, and every recent one continued by a few tokens
        for toks, salt_ in [(tokens, salt)] + [(p + extra, s) for p, s in self.prompts[-12:]]:
            got = self.index.match(list(self.workers), _hashes(toks, salt_))
            want = {w: worker.longest(toks, salt_) for w, worker in self.workers.items()}
            assert got == want, (toks, salt_)


TestIndexMirrorsWorkers = IndexMirrorsWorkers.TestCase
TestIndexMirrorsWorkers.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class _Batch:
    def __init__(self, epoch: str, seq: int, events=(), resync: bool = False, hashes=(), reason: str = ""):
        self.epoch, self.seq, self.events, self.resync = epoch, seq, list(events), resync
        self.hashes, self.reason = list(hashes), reason


def test_a_worker_without_events_goes_stale_and_matches_nothing() -> None:
    index = PrefixIndex(ttl_s=5.0)
    h = [b"a" * 16, b"b" * 16]
    index.apply("w", _Batch("e", 2, resync=True, hashes=h, reason="epoch"), now=100.0)
    assert index.match(["w"], h, now=101.0) == {"w": 2} and not index.is_stale("w")
    assert index.expire(now=104.0) == []
    assert index.expire(now=106.0) == ["w"]
    assert index.is_stale("w") and index.match(["w"], h, now=106.0) == {"w": 0} and index.size("w") == 0
    assert index.cursor("w") == (None, 0)  # the next read is a resync
    index.apply("w", _Batch("e", 3, resync=True, hashes=h[:1], reason="epoch"), now=107.0)
    assert not index.is_stale("w") and index.match(["w"], h, now=107.0) == {"w": 1}


def test_events_that_skip_a_number_are_refused_and_force_a_resync() -> None:
    index = PrefixIndex()
    index.apply("w", _Batch("e", 1, resync=True, hashes=[b"x" * 16]), now=0.0)
    assert index.apply("w", _Batch("e", 5, events=[(4, "stored", [b"y" * 16])]), now=1.0) == "gap"
    assert index.cursor("w") == (None, 0)
    assert index.apply("w", _Batch("other-epoch", 1, events=[(1, "stored", [])]), now=1.0) == "gap"


def test_predictions_count_until_they_expire_or_an_event_replaces_them() -> None:
    index = PrefixIndex(predict_ttl_s=2.0)
    h = [b"a" * 16, b"b" * 16, b"c" * 16]
    index.predict("w", h[:2], now=10.0)
    assert index.match(["w", "unknown"], h, now=11.0) == {"w": 2, "unknown": 0}
    assert index.match(["w"], h, now=12.5) == {"w": 0}  # the prefill never reported them
    index.apply("w", _Batch("e", 0, resync=True), now=12.5)
    index.predict("w", h, now=13.0)
    index.apply("w", _Batch("e", 1, events=[(1, "removed", [h[0]])]), now=13.1)
    assert index.match(["w"], h, now=13.2) == {"w": 0}  # evicted: the prediction is gone too
    assert index.size("w") == 0


def test_a_removed_worker_is_forgotten() -> None:
    index = PrefixIndex()
    index.apply("w", _Batch("e", 1, resync=True, hashes=[b"a" * 16]), now=0.0)
    index.remove("w")
    assert index.match(["w"], [b"a" * 16], now=0.0) == {"w": 0} and index.is_stale("w")


def test_held_counts_reported_blocks_and_unexpired_predictions_once() -> None:
    index = PrefixIndex(predict_ttl_s=2.0)
    h = [bytes([i]) * 16 for i in range(4)]
    assert index.held("w", now=0.0) == 0
    index.apply("w", _Batch("e", 1, resync=True, hashes=h[:2]), now=0.0)
    index.predict("w", h, now=1.0)  # the two reported ones are not predicted again
    assert index.held("w", now=1.5) == 4 and index.size("w") == 2
    index.apply("w", _Batch("e", 2, events=[(2, "stored", [h[2]])]), now=1.6)
    assert index.held("w", now=1.7) == 4  # h[2] moved from predicted to reported
    assert index.held("w", now=3.5) == 3  # h[3]'s prediction expired
