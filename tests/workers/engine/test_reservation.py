"""Admission reservation ledger: capacity, idempotent release, sum invariant."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engine.reservation import ReservationLedger
from workers.errors import KVCacheError


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
