"""A placement charges the workers' loads once and takes off exactly what it charged, whatever
order its first token, its samples' tokens and its end come in (the counts routing prices by)."""

from __future__ import annotations

from baton_serve.cluster.front.placement import Placement
from baton_serve.cluster.front.workers import WorkerRef
from baton_serve.router.routing import Decision
from baton_serve.workers.engine.outputs import TokenDelta
from hypothesis import given, settings
from hypothesis import strategies as st


def _zero(*workers: WorkerRef) -> bool:
    return all((w.load.outstanding, w.load.local_pending_prefill, w.load.local_pending_requests,
                w.load.local_decode_left) == (0, 0, 0, 0) for w in workers)


def test_open_charges_prompt_less_its_hit_and_outputs_on_the_decode_worker():
    p, d = WorkerRef("prefill-0", "prefill", None), WorkerRef("decode-0", "decode", None)
    placed = Placement.open(Decision(p, d, "prefix", matched_blocks=2), [], prompt_len=40, resumed_len=0,
                            outputs_left=2 * 10, max_tokens=10, block_size=8)
    assert (p.load.outstanding, p.load.local_pending_prefill, p.load.local_pending_requests) == (1, 24, 1)
    assert (d.load.outstanding, d.load.local_decode_left, p.load.local_decode_left) == (1, 20, 0)
    placed.first_token()
    assert p.load.local_pending_prefill == 0 and p.load.local_pending_requests == 0
    placed.produced(TokenDelta("r", 0, [5]), [5])
    placed.produced(TokenDelta("r", 1, [6, 7], finish_reason="stop"), [6, 7])  # ends early: its rest goes too
    assert d.load.local_decode_left == 20 - 1 - 10
    placed.close()
    assert _zero(p, d)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 3), max_tokens=st.integers(1, 12), matched=st.integers(0, 4), colocated=st.booleans(),
       events=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 4), st.booleans()), max_size=20),
       first=st.booleans())
def test_every_placement_takes_off_exactly_what_it_charged(n, max_tokens, matched, colocated, events, first):
    p = WorkerRef("w-0", "colocated" if colocated else "prefill", None)
    d = None if colocated else WorkerRef("decode-0", "decode", None)
    placed = Placement.open(Decision(p, d, "load", matched_blocks=matched), [], 40, 0, n * max_tokens,
                            max_tokens, 8)
    emitted: dict[int, list[int]] = {}
    if first:
        placed.first_token()
    for index, tokens, ends in events:
        if index >= n:
            continue
        emitted.setdefault(index, []).extend([1] * tokens)
        placed.produced(TokenDelta("r", index, [1] * tokens, finish_reason="length" if ends else None),
                        emitted[index])
        assert placed.decode_left >= 0 and placed.decoding.load.local_decode_left >= 0
    placed.close()
    assert _zero(p, *([d] if d else []))
