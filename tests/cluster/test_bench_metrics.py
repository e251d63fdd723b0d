"""The arithmetic of `baton bench`: per-request timings, summaries, SLOs, goodput and the knee."""

from __future__ import annotations

import math

import pytest
from baton_serve.cluster.bench.metrics import SLO, RequestRecord, parse_goodput, summarize
from baton_serve.cluster.bench.sweep import SweepPoint, find_knee, meets
from hypothesis import given, settings
from hypothesis import strategies as st


def _rec(i: int, sched: float, emits: list[float], end: float | None = None, tokens: int | None = None,
         ok: bool = True, prompt_len: int = 10) -> RequestRecord:
    return RequestRecord(index=i, prompt_len=prompt_len, expected_output_len=len(emits), t_scheduled=sched,
                         t_ready=sched, t_sent=sched, t_end=emits[-1] if end is None and emits else (end or 0.0),
                         emit_times=emits, output_tokens=len(emits) if tokens is None else tokens, ok=ok)


def test_request_timings_follow_the_definitions():
    # Scheduled at 1.0, first token at 1.3, then 1.4, 1.6, 1.7: TTFT 0.3, ITLs .1 .2 .1, TPOT .4/3.
    r = _rec(0, 1.0, [1.3, 1.4, 1.6, 1.7], end=1.75)
    assert r.ttft == pytest.approx(0.3)
    assert r.itls == pytest.approx([0.1, 0.2, 0.1])
    assert r.tpot == pytest.approx(0.4 / 3)
    assert r.e2el == pytest.approx(0.75)
    # Chunks may carry several tokens: TPOT divides by tokens, ITLs stay per chunk.
    multi = _rec(1, 0.0, [0.2, 0.5], tokens=4)
    assert multi.tpot == pytest.approx(0.1) and multi.itls == pytest.approx([0.3])
    single = _rec(2, 0.0, [0.2])
    assert single.tpot is None and single.itls == []
    failed = _rec(3, 0.0, [0.2, 0.3], ok=False)
    assert failed.ttft is None and failed.e2el is None and failed.itls == []


@settings(max_examples=50, deadline=None)
@given(st.floats(0, 5), st.lists(st.floats(0.001, 1), min_size=1, max_size=30), st.floats(0, 0.5))
def test_e2e_is_ttft_plus_itls_plus_the_tail(start, gaps, tail):
    emits = [start + 0.05]
    for g in gaps:
        emits.append(emits[-1] + g)
    r = _rec(0, start, emits, end=emits[-1] + tail)
    assert r.e2el == pytest.approx(r.ttft + sum(r.itls) + tail)
    assert r.tpot * (len(emits) - 1) == pytest.approx(sum(r.itls))


def test_summary_uses_vllm_keys_and_rates():
    recs = [_rec(i, i * 0.5, [i * 0.5 + 0.1 * (i + 1), i * 0.5 + 0.1 * (i + 1) + 0.05]) for i in range(4)]
    recs.append(_rec(4, 2.0, [], ok=False, end=2.1))
    s = summarize(recs, duration_s=4.0, slo=SLO(ttft_ms=250))
    assert s["completed"] == 4 and s["failed"] == 1
    assert s["total_input_tokens"] == 40 and s["total_output_tokens"] == 8
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.0)
    assert s["total_token_throughput"] == pytest.approx(12.0)
    # TTFTs 100, 200, 300, 400 ms: two meet 250 ms; the failure counts as a miss.
    assert s["median_ttft_ms"] == pytest.approx(250) and s["max_ttft_ms"] == pytest.approx(400)
    assert s["p99_ttft_ms"] == pytest.approx(397)
    assert s["ttft_samples"] == 4 and s["itl_samples"] == 4 and s["tpot_samples"] == 4
    assert s["mean_itl_ms"] == pytest.approx(50)
    assert s["slo_attainment"] == pytest.approx(2 / 5)  # a ratio ...
    assert s["request_goodput"] == pytest.approx(2 / 4.0)  # ... and a rate
    for key in ("mean_tpot_ms", "median_e2el_ms", "p99_itl_ms", "std_ttft_ms", "p90_e2el_ms"):
        assert key in s


def test_summary_of_nothing_is_zeros_not_errors():
    s = summarize([], 0.0, SLO(ttft_ms=1))
    assert s["completed"] == 0 and s["p99_ttft_ms"] == 0.0 and s["ttft_samples"] == 0
    assert s["slo_attainment"] == 0.0


def test_slo_checks_every_given_objective():
    r = _rec(0, 0.0, [0.2, 0.3, 0.4])  # TTFT 200 ms, TPOT 100 ms, E2E 400 ms
    assert SLO(ttft_ms=200, tpot_ms=100, e2el_ms=400).met_by(r)
    assert not SLO(ttft_ms=199).met_by(r)
    assert not SLO(tpot_ms=99).met_by(r)
    assert not SLO(e2el_ms=399).met_by(r)
    assert SLO(tpot_ms=1).met_by(_rec(1, 0.0, [0.1]))  # one token: TPOT is vacuous


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:50"]) == SLO(ttft_ms=500, tpot_ms=50)
    assert parse_goodput(None) is None
    for bad in (["ttft"], ["latency:5"], ["ttft:x"], ["tpot:0"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def _point(rate: float, ttft: float, tpot: float, failed: int = 0) -> SweepPoint:
    summary = {"completed": 100 - failed, "failed": failed, "p99_ttft_ms": ttft, "p99_tpot_ms": tpot,
               "p99_e2el_ms": 0.0}
    return SweepPoint(rate, summary, meets(summary, SLO(ttft_ms=500, tpot_ms=50)))


def test_knee_is_the_last_rate_of_the_passing_run_from_idle():
    pts = [_point(1, 100, 20), _point(2, 200, 30), _point(4, 450, 49), _point(8, 900, 49), _point(16, 300, 20)]
    assert find_knee(pts) == 4  # 16 passing again after 8 failed is noise, not capacity
    assert find_knee(list(reversed(pts))) == 4
    assert find_knee([_point(1, 600, 20)]) is None
    assert find_knee([_point(1, 100, 20), _point(math.inf, 200, 20)]) == math.inf
    assert not _point(1, 100, 20, failed=2).meets_slo  # 2% failed: a p99 over the rest would hide it
    assert not _point(1, 100, 51).meets_slo
