"""Each request's latency where it was served: TTFT where its first token was made, TPOT where its
last was, read by cursor (the controller's rebalancer pulls what is new)."""

from __future__ import annotations

import pytest
from baton_serve.workers.engine.config import EngineConfig, SchedulerConfig
from baton_serve.workers.engine.core import EngineCore
from baton_serve.workers.engine.latency_log import LatencyLog
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.workers.engine.test_simulated_core import NS, _Clock, _params


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 50), st.integers(1, 20), st.lists(st.integers(0, 60), max_size=8))
def test_a_reader_gets_each_kept_sample_once_in_order(total, maxlen, cursors):
    log = LatencyLog(maxlen=maxlen)
    for i in range(total):
        log.add("ttft", i * 0.1, 10, 0, 1)
    for c in cursors:
        seq, new = log.since(c)
        assert seq == total
        assert [s.seq for s in new] == list(range(max(c, total - maxlen) + 1, total + 1))
    assert log.since(total) == (total, [])


def _core(clock: _Clock) -> EngineCore:
    cfg = EngineConfig(block_size=8, scheduler=SchedulerConfig(max_num_batched_tokens=64))
    return EngineCore.for_simulation(cfg, 64, [2], vocab_size=1000, max_model_len=256, forward=clock.forward,
                                     token_id=7, namespace=NS, clock=lambda: clock.now, timer=lambda: clock.now)


def test_ttft_at_the_first_token_and_tpot_at_the_last_on_the_clock_the_engine_runs_on():
    clock = _Clock()
    core = _core(clock)
    arrival = clock.now
    core.add_request("r", list(range(1, 21)), _params(10), arrival_time=arrival)
    times = []
    while core.has_unfinished_requests():
        if core.step():
            times.append(clock.now)
    seq, samples = core.latency.since(0)
    assert seq == 2 and [s.kind for s in samples] == ["ttft", "tpot"]
    ttft, tpot = samples
    assert ttft.seconds == pytest.approx(times[0] - arrival)
    assert (ttft.prompt_tokens, ttft.output_tokens) == (20, 1)
    assert tpot.seconds == pytest.approx((times[-1] - times[0]) / 9)
    assert tpot.output_tokens == 10


def test_a_prefill_only_request_leaves_its_ttft_and_no_tpot():
    clock = _Clock()
    core = _core(clock)
    core.add_request("p", list(range(1, 21)), _params(10), arrival_time=clock.now, prefill_only=True)
    for _ in range(5):
        core.step()
    _, samples = core.latency.since(0)
    assert [s.kind for s in samples] == ["ttft"] and "p" in core.parked
