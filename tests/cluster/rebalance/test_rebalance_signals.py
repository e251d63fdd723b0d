"""The window the rebalancer reads: each pool's latency at the attainment quantile over its SLO,
its load over its targets, and the request shape, over the last ``window_s`` seconds only."""

from __future__ import annotations

import math

import pytest
from baton_serve.cluster.rebalance.signals import RequestSample, SignalWindow, Targets, WorkerSample, quantile

ROLES = {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}


def _req(at: float, ttft: float | None = 0.5, tpot: float | None = 0.05, prompt: int = 100, cached: int = 0,
         out: int = 10) -> RequestSample:
    return RequestSample(at, prompt, cached, out, ttft, tpot)


def test_quantile_interpolates_between_order_statistics():
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([0.0, 10.0], 0.9) == pytest.approx(9.0)
    assert quantile([4.0], 0.99) == 4.0
    assert math.isnan(quantile([], 0.5))


def test_each_pool_answers_for_its_own_slo_at_the_attainment_quantile():
    w = SignalWindow(60.0, Targets(ttft_s=1.0, tpot_s=0.1, attainment=0.9))
    for i in range(10):  # TTFTs 0.2 .. 2.0 s; TPOTs 0.01 .. 0.1 s
        w.add_request(_req(float(i), ttft=0.2 * (i + 1), tpot=0.01 * (i + 1)))
    s = w.signals(10.0, ROLES)
    pre, dec = s.pools["prefill"], s.pools["decode"]
    assert pre.latency_s == pytest.approx(quantile([0.2 * (i + 1) for i in range(10)], 0.9))
    assert pre.latency_pressure == pytest.approx(pre.latency_s / 1.0)
    assert pre.attainment == pytest.approx(0.5)  # 0.2 .. 1.0 within 1 s
    assert dec.latency_pressure == pytest.approx(dec.latency_s / 0.1)
    assert dec.attainment == pytest.approx(1.0)
    assert (pre.workers, dec.workers) == (1, 2)


def test_load_is_prefills_busy_time_and_the_decode_pools_kv_room():
    w = SignalWindow(60.0, Targets(utilization=0.8, kv_high=0.9))
    w.add_poll(WorkerSample(1.0, "prefill-0", "prefill", 0.4, 0.99, 0, 0))  # a full prefill cache is no shortage
    w.add_poll(WorkerSample(1.0, "decode-0", "decode", 1.0, 0.45, 0, 3))  # stepping all the time, half full
    w.add_poll(WorkerSample(1.0, "decode-1", "decode", 1.0, 0.45, 1, 3))
    s = w.signals(2.0, ROLES)
    assert s.pools["prefill"].load_pressure == pytest.approx(0.4 / 0.8)
    assert s.pools["decode"].load_pressure == pytest.approx(0.45 / 0.9)
    assert s.pools["decode"].busy_fraction == pytest.approx(1.0)
    assert s.pools["decode"].waiting == pytest.approx(0.5)
    assert s.pools["decode"].projected(1) == pytest.approx(2 * 0.45 / 0.9)
    assert s.pools["decode"].projected(0) == math.inf


def test_samples_older_than_the_window_drop_out():
    w = SignalWindow(10.0)
    w.add_request(_req(0.0, prompt=5000))
    w.add_poll(WorkerSample(0.0, "prefill-0", "prefill", 1.0, 0.0, 9, 0))
    for i in range(4):
        w.add_request(_req(20.0 + i, prompt=100, cached=40, out=7))
    s = w.signals(25.0, ROLES)
    assert s.requests == 4 and s.arrival_rate == pytest.approx(0.4)
    assert (s.prompt_p50, s.prompt_p90, s.uncached_p90, s.output_p90) == (100, 100, 60, 7)
    assert s.pools["prefill"].busy_fraction == 0.0


def test_a_workers_polls_from_its_old_role_do_not_count_for_its_new_one():
    w = SignalWindow(60.0)
    w.add_poll(WorkerSample(1.0, "decode-1", "prefill", 1.0, 0.0, 5, 0))  # before its flip to decode
    w.add_poll(WorkerSample(2.0, "decode-1", "decode", 0.1, 0.1, 0, 1))
    s = w.signals(3.0, ROLES)
    assert s.pools["decode"].busy_fraction == pytest.approx(0.1)
    assert s.pools["prefill"].busy_fraction == 0.0


def test_a_colocated_pool_answers_for_the_slo_further_off():
    w = SignalWindow(60.0, Targets(ttft_s=1.0, tpot_s=0.1, attainment=0.5))
    for i in range(3):
        w.add_request(_req(float(i), ttft=0.5, tpot=0.3))
    s = w.signals(5.0, {"colocated-0": "colocated"})
    assert s.pools["colocated"].latency_pressure == pytest.approx(3.0)  # TPOT 0.3 s over 0.1 s
    assert s.pools["colocated"].latency_s == pytest.approx(0.3)


def test_a_pool_without_requests_has_no_latency_part():
    s = SignalWindow(60.0).signals(1.0, ROLES)
    assert s.requests == 0 and s.pools["prefill"].latency_pressure is None
    assert s.pools["prefill"].pressure == 0.0


def test_a_window_must_be_positive():
    with pytest.raises(ValueError, match="window_s"):
        SignalWindow(0.0)


def test_a_decode_pools_own_prefill_is_not_decode_demand():
    # the two decode workers spend half their 0.9 busy time on prompts they prefill themselves:
    # of the slow TPOT only the decode share (0.45 of 0.9) is the decode pool's; the prefill
    # pool's signals are its own
    w = SignalWindow(60.0, Targets(ttft_s=1.0, tpot_s=0.1, utilization=0.8, kv_high=0.9))
    w.add_poll(WorkerSample(1.0, "prefill-0", "prefill", 0.6, 0.1, 2, 1))
    for d in ("decode-0", "decode-1"):
        w.add_poll(WorkerSample(1.0, d, "decode", 0.9, 0.3, 0, 4, prefill_fraction=0.45))
    for i in range(10):
        w.add_request(_req(float(i), ttft=0.5, tpot=0.3))
    s = w.signals(10.0, ROLES)
    pre, dec = s.pools["prefill"], s.pools["decode"]
    assert pre.load_pressure == pytest.approx(0.6 / 0.8) and pre.latency_pressure == pytest.approx(0.5)
    assert dec.local_prefill == pytest.approx(0.45)
    assert dec.latency_pressure == pytest.approx(3.0 * 0.5)  # TPOT 0.3 s over 0.1 s, half of it decode's
    assert dec.load_pressure == pytest.approx(0.3 / 0.9)  # KV room is unchanged


def test_without_local_prefill_the_decode_pool_keeps_its_latency():
    w = SignalWindow(60.0, Targets(utilization=0.8))
    w.add_poll(WorkerSample(1.0, "prefill-0", "prefill", 0.6, 0.1, 0, 1))
    w.add_poll(WorkerSample(1.0, "decode-0", "decode", 0.9, 0.3, 0, 4))
    for i in range(10):
        w.add_request(_req(float(i), tpot=0.3))
    assert w.signals(10.0, ROLES).pools["decode"].latency_pressure == pytest.approx(3.0)


def test_a_prompt_prefilled_on_its_decode_worker_counts_against_the_decode_pool():
    # short prompts kept on overloaded decode workers wait 4 s for their first token there; the
    # prefill pool's own prompts are fast: the decode pool is short, not the prefill pool
    w = SignalWindow(60.0, Targets(ttft_s=1.0, tpot_s=0.1, attainment=0.9))
    for i in range(10):
        w.add_request(RequestSample(float(i), 2000, 0, 16, 0.3, 0.05, "prefill"))
        w.add_request(RequestSample(float(i), 64, 0, 256, 4.0, 0.05, "decode"))
    s = w.signals(10.0, ROLES)
    assert s.pools["prefill"].latency_pressure == pytest.approx(0.3)
    assert s.pools["decode"].latency_pressure == pytest.approx(4.0)
    assert s.pools["decode"].latency_s == pytest.approx(4.0) and s.pools["decode"].attainment == 0.0
