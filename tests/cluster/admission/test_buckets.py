"""Token buckets: refill, burst cap, debt, and the wait they report."""

from __future__ import annotations

from baton_serve.cluster.admission.buckets import TokenBucket
from hypothesis import given
from hypothesis import strategies as st


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_take_refill_and_retry_after():
    c = Clock()
    b = TokenBucket(rate=2.0, burst=3.0, clock=c)
    assert all(b.try_take() for _ in range(3)) and not b.try_take()
    assert b.seconds_until() == 0.5
    c.t = 0.5
    assert b.try_take() and not b.try_take()
    c.t = 100.0
    assert b.level == 3.0  # never above the burst


def test_charge_goes_into_debt_and_refund_caps_at_burst():
    c = Clock()
    b = TokenBucket(rate=10.0, burst=100.0, clock=c)
    b.charge(250)
    assert b.level == -150 and b.seconds_until(0.0) == 15.0
    b.refund(1000)
    assert b.level == 100.0


@given(st.lists(st.tuples(st.floats(0, 5), st.floats(0.1, 20)), max_size=60))
def test_never_more_than_rate_times_time_plus_burst(steps):
    c = Clock()
    b = TokenBucket(rate=3.0, burst=7.0, clock=c)
    taken = 0.0
    for dt, amount in steps:
        c.t += dt
        if b.try_take(amount):
            taken += amount
        assert -1e-9 <= b.level <= 7.0 + 1e-9
    assert taken <= 7.0 + 3.0 * c.t + 1e-6
