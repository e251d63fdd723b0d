"""A stream's rules without a front: deltas in position order per sample, hand-over to the decode
worker, where a migrated sample resumes, and ends that came twice."""

from __future__ import annotations

from baton_serve.cluster.front.streams import Stream
from baton_serve.workers.engine.outputs import TokenDelta


def _stream(n: int = 1) -> Stream:
    s = Stream(None, n, {"prefill-0", "decode-0"}, "r~1", n=n, prefill_id="prefill-0", decode_id="decode-0")
    s.placed_n = n
    return s


def test_a_decode_workers_tokens_wait_for_the_prefill_workers_first_one():
    s = _stream()
    later = TokenDelta("r~1", 0, [12, 13], position=1)
    assert s.in_order(later, "decode-0") == []
    first = TokenDelta("r~1", 0, [11], position=0, kv_ready=True)
    assert s.in_order(first, "prefill-0") == [(first, "prefill-0"), (later, "decode-0")]
    assert s.in_order(TokenDelta("r~1", 0, [12], position=1), "decode-0") == []  # a repeat
    assert s.next_position == {0: 3}


def test_the_prefill_worker_leaves_the_placement_once_every_sample_reached_the_decode_worker():
    s = _stream(n=2)
    d0, d1 = TokenDelta("r~1", 0, [3], position=1), TokenDelta("r~1", 1, [4], position=1)
    assert not s.hands_over(TokenDelta("r~1", 0, [1], position=0), "prefill-0")
    assert s.hands_over(d0, "decode-0")
    s.handed_over(0)
    assert s.prefill_id == "prefill-0"
    assert s.hands_over(TokenDelta("r~1", 1, [], finish_reason="stop"), "prefill-0")  # ended before the hop
    s.handed_over(1)
    assert s.prefill_id is None and s.workers == {"decode-0"}
    assert not s.hands_over(d1, "decode-0")  # nothing left to hand over


def test_a_migration_resumes_from_the_longest_unfinished_output_and_restarts_the_order():
    s = _stream(n=3)
    assert s.take(TokenDelta("r", 0, [1, 2, 3]))
    assert s.take(TokenDelta("r", 1, [4], finish_reason="stop"))
    assert s.take(TokenDelta("r", 2, [5, 6]))
    assert not s.take(TokenDelta("r", 1, [], finish_reason="abort"))  # it had ended here already
    assert s.unfinished() == [0, 2] and s.resume_tokens() == [1, 2, 3]
    s.restart_order()
    assert s.next_position == {0: 3, 1: 1, 2: 2} and s.early == {}
