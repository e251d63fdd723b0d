"""Online cost fits from cumulative counters."""

from __future__ import annotations

import random

import pytest
from baton_serve.router.routing import WorkerLoad
from baton_serve.router.routing.rates import MOMENTS, LinearCost, StepFit


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


def _moments(steps: list[tuple[float, float, float]]) -> list[float]:
    """Sum (P, D, seconds) steps into the engine's moments: n, P, D, PP, PD, DD, t, tP, tD."""
    m = [0.0] * MOMENTS
    for p, d, t in steps:
        for i, v in enumerate((1, p, d, p * p, p * d, d * d, t, t * p, t * d)):
            m[i] += v
    return m


def _feed_steps(fit: StepFit, intervals: list[list[tuple[float, float, float]]]) -> None:
    total = [0.0] * MOMENTS
    fit.observe(total)
    for steps in intervals:
        total = [a + b for a, b in zip(total, _moments(steps))]
        fit.observe(total)


def _holder_intervals(seed: int, n: int = 30) -> list[list[tuple[float, float, float]]]:
    """A hot prefix's holder: every second alike, 20 steps of 6-10 decodes, a third of them
    carrying a 32-token prompt tail; 5% timing noise."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        steps = []
        for _ in range(20):
            d = rng.randint(6, 10)
            p = 32 if rng.random() < 0.33 else 0
            steps.append((p, d, (0.03 + 0.0005 * p + 0.002 * d) * rng.uniform(0.95, 1.05)))
        out.append(steps)
    return out


def test_steps_tell_a_holders_prompt_cost_apart_where_its_intervals_cannot() -> None:
    fit = StepFit()
    _feed_steps(fit, _holder_intervals(0))
    assert fit.prefill_fitted and fit.decode_fitted
    assert fit.overhead == pytest.approx(0.03, rel=0.15)
    assert fit.per_prefill_token == pytest.approx(0.0005, rel=0.1)
    assert fit.per_decode_seq == pytest.approx(0.002, rel=0.3)
    # the interval fit of the same seconds, a mixed step split by token share, as the engine reports
    interval = LinearCost()
    steps = tokens = seconds = 0.0
    interval.observe(0, 0, 0)
    for chunk in _holder_intervals(0):
        for p, d, t in chunk:
            if p:
                steps, tokens, seconds = steps + 1, tokens + p, seconds + t * p / (p + d)
        interval.observe(steps, tokens, seconds)
    assert interval.fixed == 0 and interval.per_unit > 1.5 * 0.0005  # the step's overhead lands on the tail


def test_terms_the_steps_never_tell_apart_stay_unfitted() -> None:
    prefill_only = StepFit()  # a prefill worker: no decodes, prompts of unlike lengths
    _feed_steps(prefill_only, [[(p, 0, 0.02 + 0.0004 * p) for p in (1024, 32, 512, 1024)] for _ in range(5)])
    assert prefill_only.prefill_fitted and not prefill_only.decode_fitted
    assert (prefill_only.overhead, prefill_only.per_prefill_token) == (pytest.approx(0.02), pytest.approx(0.0004))
    locked = StepFit()  # every step carries 32 prompt tokens per decode: P and D cannot be told apart
    _feed_steps(locked, [[(32 * d, d, 0.01 + 0.003 * d) for d in (2, 5, 9)] for _ in range(5)])
    assert not (locked.prefill_fitted and locked.decode_fitted)
    idle = StepFit()
    _feed_steps(idle, [[] for _ in range(3)])
    assert not idle.prefill_fitted and not idle.decode_fitted


def test_a_restarted_engine_starts_the_step_fit_anew() -> None:
    fit = StepFit()
    _feed_steps(fit, _holder_intervals(1, 10))
    assert fit.prefill_fitted
    fit.observe(_moments([(0, 4, 0.05)]))  # fewer steps than before: another process
    assert fit._sums == (0.0,) * MOMENTS
    fit.observe(_moments([(0, 4, 0.05)] + [(p, 4, 0.03 + 0.001 * p + 0.008) for p in (32, 512, 1024)]))
    assert fit.per_prefill_token == pytest.approx(0.001) and fit.prefill_fitted


def test_a_worker_load_prices_with_the_step_fit_where_it_has_one() -> None:
    load = WorkerLoad()
    load.update({"num_prefill_steps": 0, "num_prefill_tokens_computed": 0, "prefill_seconds": 0.0,
                 "step_moments": [0.0] * MOMENTS})
    assert load.fit("prefill") is None and load.fit("decode") is None
    steps = [s for chunk in _holder_intervals(2, 8) for s in chunk]
    prefill = [(p, t * p / (p + d)) for p, d, t in steps if p]
    load.update({"num_prefill_steps": len(prefill), "num_prefill_tokens_computed": sum(p for p, _ in prefill),
                 "prefill_seconds": sum(t for _, t in prefill), "step_moments": _moments(steps)})
    assert load.fit("prefill") == (load.step.overhead, load.step.per_prefill_token)
    assert load.fit("decode") == (load.step.overhead, load.step.per_decode_seq)
    # the cost model prices with it where asked to (step_fit), else with the interval fits
    from baton_serve.router.routing.cost_model import CostModel

    worker = type("W", (), {"load": load, "worker_id": "w", "role": "colocated"})()
    b, a = load.step.per_prefill_token, load.step.overhead
    assert CostModel(step_fit=True).prefill_s(worker, 1000, [worker]) == pytest.approx(a + 1000 * b)
    assert CostModel().prefill_s(worker, 1000, [worker]) == pytest.approx(
        load.prefill.fixed + 1000 * load.prefill.per_unit)
    assert load.prefill.per_unit > 1.5 * b  # the interval fit puts the mixed steps' overhead on the tails


def test_a_fit_of_summed_moments_is_the_fit_of_all_their_steps() -> None:
    a, b, both = StepFit(), StepFit(), StepFit()
    _feed_steps(a, _holder_intervals(3, 6))
    _feed_steps(b, _holder_intervals(4, 6))
    _feed_steps(both, [x + y for x, y in zip(_holder_intervals(3, 6), _holder_intervals(4, 6))])
    pooled = StepFit.of_sums([x + y for x, y in zip(a.sums, b.sums)])
    assert (pooled.overhead, pooled.per_prefill_token, pooled.per_decode_seq) == (
        pytest.approx(both.overhead), pytest.approx(both.per_prefill_token), pytest.approx(both.per_decode_seq))
    assert pooled.prefill_fitted == both.prefill_fitted and pooled.decode_fitted == both.decode_fitted
    versions = a.version
    _feed_steps(a, _holder_intervals(5, 1))
    assert a.version > versions  # new steps: a pooled fit of the old sums is out of date


def test_a_fit_of_summed_interval_sums_tells_apart_what_one_worker_s_intervals_cannot() -> None:
    tails, whole = LinearCost(), LinearCost()
    _feed(tails, [(1, 32)] * 10, fixed=0.03, per_unit=0.0014)  # one size: all of it per token
    _feed(whole, [(1, 32), (1, 1056), (2, 64)], fixed=0.03, per_unit=0.0014)
    assert tails.fixed == 0.0 and tails.per_unit > 1.5 * 0.0014
    pooled = LinearCost.of_sums([x + y for x, y in zip(tails.sums, whole.sums)])
    assert pooled.fitted
    assert pooled.fixed == pytest.approx(0.03, rel=1e-6) and pooled.per_unit == pytest.approx(0.0014, rel=1e-6)
    assert not LinearCost.of_sums([0.0] * 5).fitted
    assert LinearCost.of_sums(tails.sums, fallback="fixed").per_unit == 0.0  # a decode fit's fallback
    version = tails.version
    _feed(tails, [(1, 32)], fixed=0.03, per_unit=0.0014)
    assert tails.version > version  # new intervals: a pooled fit of the old sums is out of date
