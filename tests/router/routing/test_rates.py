"""Online cost fits from cumulative counters."""

from __future__ import annotations

import pytest

from router.routing.rates import LinearCost


def _feed(fit: LinearCost, intervals, fixed: float, per_unit: float) -> None:
    count = units = seconds = 0.0
    fit.observe(count, units, seconds)
    for n, u in intervals:
        count, units, seconds = count + n, units + u, seconds + fixed * n + per_unit * u
        fit.observe(count, units, seconds)


def test_recovers_overhead_and_per_unit_cost() -> None:
    fit = LinearCost()
    assert not fit.fitted and fit.units_per_second is None
    _feed(fit, [(1, 100), (4, 120), (2, 900), (8, 64), (3, 3000)], fixed=0.01, per_unit=0.0005)
    assert fit.fitted
    assert fit.fixed == pytest.approx(0.01, rel=1e-6) and fit.per_unit == pytest.approx(0.0005, rel=1e-6)
    assert fit.seconds(1000) == pytest.approx(0.51)
    assert fit.units_per_second == pytest.approx(2000)


def test_alike_intervals_put_everything_per_unit() -> None:
    fit = LinearCost()
    _feed(fit, [(1, 100), (2, 200), (3, 300)], fixed=0.0, per_unit=0.001)  # count and units collinear
    assert fit.fitted and fit.fixed == 0.0 and fit.per_unit == pytest.approx(0.001)


def test_intervals_of_about_one_size_with_noisy_timing_do_not_make_a_rate_up() -> None:
    fit = LinearCost()
    count = units = seconds = 0.0
    fit.observe(count, units, seconds)
    # ~32 prompt tokens a step, 50 ms overhead + 1.4 ms a token, timing off by a few percent
    for i, (n, u) in enumerate([(20, 640), (21, 650), (19, 620), (20, 660), (22, 690), (20, 630)]):
        count, units = count + n, units + u
        seconds += (0.05 * n + 0.0014 * u) * (1.04 if i % 2 else 0.96)
        fit.observe(count, units, seconds)
    # all of it per token: each step's overhead charged to its tokens, not a made-up fast rate
    assert fit.fitted and fit.fixed == 0.0
    assert fit.per_unit == pytest.approx((0.05 * 20 + 0.0014 * 640) / 640, rel=0.1)


def test_a_restarted_worker_starts_a_new_baseline_and_idle_intervals_change_nothing() -> None:
    fit = LinearCost()
    _feed(fit, [(1, 100), (5, 100)], fixed=0.01, per_unit=0.001)
    before = (fit.fixed, fit.per_unit)
    fit.observe(0, 0, 0.0)  # counters went back to zero: a new process
    fit.observe(0, 0, 0.0)  # idle
    assert (fit.fixed, fit.per_unit) == before
    fit.observe(1, 100, 0.5)  # the new process is much slower: the fit follows
    assert fit.per_unit > before[1]


def test_the_fit_follows_a_worker_that_slows_down() -> None:
    fit = LinearCost()
    _feed(fit, [(1, 100 * (i + 1)) for i in range(10)], fixed=0.0, per_unit=0.001)
    count, units, seconds = fit._last
    for i in range(10):
        count, units, seconds = count + 1, units + 100 * (i + 1), seconds + 0.004 * 100 * (i + 1)
        fit.observe(count, units, seconds)
    assert fit.per_unit == pytest.approx(0.004, rel=0.1)
