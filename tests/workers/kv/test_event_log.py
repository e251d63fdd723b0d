"""The worker's numbered KV event log: incremental reads, resyncs on a gap or a new epoch, and a
mirror of the cached set that matches the block pool's."""

from __future__ import annotations

from baton_serve.workers.blocks.manager import BlockManager
from baton_serve.workers.kv.event_log import CLEARED, REMOVED, STORED, KVEventLog


def _manager(log: KVEventLog, num_blocks: int = 8) -> BlockManager:
    return BlockManager(num_blocks, 2, event_sink=log)


def _run(bm: BlockManager, seq: str, tokens: list[int]) -> None:
    cached = bm.find_cached_prefix(seq, tokens)
    assert bm.allocate(seq, tokens, cached, len(tokens) - cached, num_cached_tokens=cached)
    bm.commit_computed(seq, tokens, len(tokens))


def test_events_are_numbered_and_read_incrementally() -> None:
    log = KVEventLog()
    bm = _manager(log)
    first = log.since(None, 0)
    assert first.resync and first.reason == "epoch" and first.hashes == [] and first.seq == 0
    _run(bm, "a", [1, 2, 3, 4, 5])  # two full blocks
    batch = log.since(first.epoch, first.seq)
    assert not batch.resync and [(s, k, len(h)) for s, k, h in batch.events] == [(1, STORED, 2)]
    assert log.since(batch.epoch, batch.seq).events == []  # nothing new
    bm.free("a")
    bm.reset_prefix_cache()
    later = log.since(batch.epoch, batch.seq)
    assert [(s, k) for s, k, _ in later.events] == [(2, CLEARED)] and later.seq == 2
    assert log.cached() == set()


def test_eviction_is_a_removed_event_and_the_mirror_follows_the_pool() -> None:
    log = KVEventLog()
    bm = _manager(log, num_blocks=4)
    _run(bm, "a", [1, 2, 3, 4])
    bm.free("a")
    _run(bm, "b", [9, 9, 8, 8, 7, 7, 6])  # needs all 4 blocks: evicts a's
    kinds = [k for _, k, _ in log.since(log.epoch, 0).events]
    assert kinds == [STORED, REMOVED, STORED]
    assert log.cached() == set(bm.pool._cached)


def test_a_reader_too_far_behind_or_of_another_epoch_gets_a_resync() -> None:
    log = KVEventLog(capacity=2)
    bm = _manager(log, num_blocks=16)
    for i in range(4):
        _run(bm, f"s{i}", [i, i, 100 + i])
    assert log.seq == 4
    behind = log.since(log.epoch, 1)  # events 2 (and 1) are gone: only 3 and 4 are kept
    assert behind.resync and behind.reason == "gap" and set(behind.hashes) == set(bm.pool._cached)
    assert not log.since(log.epoch, 2).resync  # 3 and 4 are still there
    other = log.since("a-previous-engine", 4)
    assert other.resync and other.reason == "epoch" and other.seq == 4
    ahead = log.since(log.epoch, 99)  # a cursor from the future is from another engine's life
    assert ahead.resync


def test_a_new_log_is_a_new_epoch() -> None:
    assert KVEventLog().epoch != KVEventLog().epoch
