"""Admission reservation ledger: capacity, idempotent release, sum invariant, shared prefix blocks
held once."""

from __future__ import annotations

import pytest
from baton_serve.workers.engine.reservation import ReservationLedger
from baton_serve.workers.errors import KVCacheError
from hypothesis import given, settings
from hypothesis import strategies as st


def test_capacity_is_respected_and_failure_changes_nothing() -> None:
    led = ReservationLedger(10)
    assert led.reserve("a", 6)
    assert not led.reserve("b", 5)
    assert "b" not in led and led.reserved_blocks == 6 and led.available_blocks == 4
    assert led.reserve("b", 4)
    assert led.available_blocks == 0
    assert led.reserve("c", 0)  # zero-block requests always fit


def test_release_is_idempotent() -> None:
    led = ReservationLedger(10)
    led.reserve("a", 3)
    assert led.release("a") == 3
    assert led.release("a") == 0
    assert led.release("never") == 0
    assert led.reserved_blocks == 0 and "a" not in led


def test_misuse_raises() -> None:
    led = ReservationLedger(10)
    led.reserve("a", 1)
    with pytest.raises(KVCacheError):
        led.reserve("a", 1)
    with pytest.raises(KVCacheError):
        led.reserve("b", -1)
    assert led.reserved_blocks == 1
    with pytest.raises(ValueError):
        ReservationLedger(-1)


ops = st.lists(
    st.tuples(st.sampled_from(["reserve", "release"]), st.sampled_from("abcdef"), st.integers(0, 8)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(0, 20), ops=ops)
def test_reserved_equals_sum_of_live_reservations(capacity: int, ops: list) -> None:
    led = ReservationLedger(capacity)
    model: dict[str, int] = {}
    for op, rid, n in ops:
        if op == "reserve":
            if rid in model:
                with pytest.raises(KVCacheError):
                    led.reserve(rid, n)
            else:
                fits = sum(model.values()) + n <= capacity
                assert led.reserve(rid, n) == fits
                if fits:
                    model[rid] = n
        else:
            assert led.release(rid) == model.pop(rid, 0)
        assert led.reserved_blocks == sum(model.values()) <= capacity
        assert led.available_blocks == capacity - led.reserved_blocks
        assert all((r in led) == (r in model) for r in "abcdef")


def test_shared_blocks_are_held_once_and_freed_with_the_last_holder() -> None:
    led = ReservationLedger(10)
    assert led.reserve("a", 5, shared=[b"p0", b"p1", b"p2"])
    assert led.charge(5, [b"p0", b"p1", b"p2"]) == 2 and led.shared_blocks([b"p0", b"p9"]) == 1
    assert led.reserve("b", 5, shared=[b"p0", b"p1", b"p2"])  # 5 + 2 of 10: it fits
    assert led.reserved_blocks == 7
    assert not led.reserve("c", 4, shared=[b"q0"])  # nothing of it is held: 4 more do not fit
    assert led.release("a") == 5 and led.reserved_blocks == 5
    assert led.release("b") == 5 and led.reserved_blocks == 0
    with pytest.raises(KVCacheError):
        led.reserve("d", 1, shared=[b"p0", b"p1"])  # more shared blocks than blocks


shared_ops = st.lists(
    st.tuples(st.sampled_from(["reserve", "release"]), st.sampled_from("abcdef"), st.integers(0, 8),
              st.lists(st.sampled_from([b"h0", b"h1", b"h2", b"h3"]), max_size=4)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(0, 20), ops=shared_ops, forced=st.booleans())
def test_reserved_counts_each_live_shared_block_once(capacity: int, ops: list, forced: bool) -> None:
    """Against a model: reserved = every live reservation's own blocks + the distinct shared
    blocks live reservations name; a reservation that is not forced never passes capacity."""
    led = ReservationLedger(capacity)
    model: dict[str, tuple[int, set[bytes]]] = {}

    def reserved(m: dict[str, tuple[int, set[bytes]]]) -> int:
        return sum(n - len(s) for n, s in m.values()) + len(set().union(*(s for _, s in m.values())))

    for op, rid, n, hashes in ops:
        distinct = set(hashes)
        n = max(n, len(distinct))
        if op == "reserve" and rid not in model:
            after = reserved({**model, rid: (n, distinct)})
            fits = after <= capacity
            assert led.charge(n, hashes) == after - reserved(model)
            assert led.reserve(rid, n, force=forced, shared=hashes) == (fits or forced)
            if fits or forced:
                model[rid] = (n, distinct)
        elif op == "release":
            assert led.release(rid) == model.pop(rid, (0, set()))[0]
        assert led.reserved_blocks == reserved(model)
        assert forced or led.reserved_blocks <= capacity
        assert len(led) == len(model)
