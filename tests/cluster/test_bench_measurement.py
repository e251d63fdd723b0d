"""The measurement itself, against a fake OpenAI server with injected delays: measured TTFT, ITL,
TPOT and goodput match what the server was told to do, and a 2 s server stall shows up in the
latencies of every request scheduled during it (no coordinated omission).

Delays are large (hundreds of ms) and tolerances wide (tens of ms) so a loaded 2-core machine
cannot make these flaky; each run is bounded to a few seconds.
"""

from __future__ import annotations

import math

import pytest
from baton_serve.cluster.bench.client import CHAT
from baton_serve.cluster.bench.fakeserver import FakeOpenAIServer, FakeServerConfig
from baton_serve.cluster.bench.metrics import SLO
from baton_serve.cluster.bench.runner import BenchConfig, run
from baton_serve.cluster.bench.workload import LengthDist, WorkloadConfig

TOL_MS = 40


def _cfg(server: FakeOpenAIServer, n: int, out_len: int, **kw) -> BenchConfig:
    kw.setdefault("num_warmups", 0)
    return BenchConfig(base_url=server.url, num_prompts=n, disable_tqdm=True, request_timeout_s=30,
                       workload=WorkloadConfig(input_len=LengthDist(16), output_len=LengthDist(out_len)), **kw)


@pytest.mark.parametrize("endpoint", ["/v1/completions", CHAT])
def test_measured_ttft_itl_tpot_match_injected_delays(endpoint):
    with FakeOpenAIServer(FakeServerConfig(ttft_s=0.2, itl_s=0.05)) as server:
        res = run(_cfg(server, 8, 6, endpoint=endpoint, request_rate=20.0, burstiness=math.inf))
        bodies = server.bodies
    s = res.summary
    assert s["completed"] == 8 and s["failed"] == 0
    # A chat stream opens with an empty role chunk at once: counting it would give TTFT ~0.
    assert s["median_ttft_ms"] == pytest.approx(200, abs=TOL_MS)
    assert s["median_itl_ms"] == pytest.approx(50, abs=TOL_MS / 2)
    assert s["median_tpot_ms"] == pytest.approx(50, abs=TOL_MS / 2)
    assert s["median_e2el_ms"] == pytest.approx(200 + 5 * 50, abs=2 * TOL_MS)
    assert s["itl_samples"] == 8 * 5 and s["total_output_tokens"] == 48
    assert s["output_throughput"] == pytest.approx(48 / s["duration"])
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} for b in bodies)
    assert all(b["max_tokens"] == 6 and b["ignore_eos"] is True for b in bodies)


def test_goodput_and_attainment_count_only_requests_meeting_the_slo():
    # Even-numbered arrivals answer in 100 ms, odd ones in 500 ms; the SLO is 300 ms.
    cfg = FakeServerConfig(ttft_for=lambda i: 0.1 if i % 2 == 0 else 0.5, itl_s=0.02)
    with FakeOpenAIServer(cfg) as server:
        res = run(_cfg(server, 8, 3, request_rate=math.inf, slo=SLO(ttft_ms=300, tpot_ms=100)))
    s = res.summary
    assert s["slo_attainment"] == 0.5
    assert s["request_goodput"] == pytest.approx(0.5 * s["request_throughput"])
    assert s["median_ttft_ms"] == pytest.approx(300, abs=2 * TOL_MS)  # halfway between the modes
    with FakeOpenAIServer(cfg) as server:
        tight = run(_cfg(server, 4, 3, request_rate=math.inf, slo=SLO(tpot_ms=10)))  # ITL is 20 ms
    assert tight.summary["request_goodput"] == 0.0


def test_failures_are_counted_and_miss_the_slo():
    with FakeOpenAIServer(FakeServerConfig(ttft_s=0.05, itl_s=0.01, fail_every=4)) as server:
        res = run(_cfg(server, 8, 2, request_rate=math.inf, slo=SLO(ttft_ms=5000)))
    s = res.summary
    assert (s["completed"], s["failed"]) == (6, 2)
    assert s["slo_attainment"] == pytest.approx(6 / 8)
    assert sum("HTTP 500" in r.error for r in res.records) == 2
    assert any("2 of 8 requests failed" in w for w in res.warnings)


def test_warmups_are_excluded_and_the_cold_request_reported_apart():
    cfg = FakeServerConfig(ttft_for=lambda i: 0.6 if i == 0 else 0.1, itl_s=0.02)
    with FakeOpenAIServer(cfg) as server:
        res = run(_cfg(server, 5, 2, request_rate=math.inf, num_warmups=2))
        received = len(server.bodies)
    assert received == 7 and res.summary["completed"] == 5
    assert res.cold is not None and res.cold.ttft == pytest.approx(0.6, abs=TOL_MS / 1e3)
    assert res.summary["max_ttft_ms"] < 400


def _slow(records, limit_s: float = 0.5, sent: bool = False) -> int:
    """How many requests had TTFT over ``limit_s``, measured from schedule (or from sending)."""
    return sum(((r.emit_times[0] - r.t_sent) if sent else r.ttft) > limit_s for r in records if r.ok)


STALL = FakeServerConfig(ttft_s=0.02, itl_s=0.01, stall_at=10, stall_s=2.0)


def test_a_server_stall_shows_in_open_loop_p99_and_only_once_in_closed_loop():
    # 10 req/s, evenly spaced, for 5 s; the 11th request (t = 1 s) stalls the server for 2 s, so
    # the ~20 requests scheduled in [1 s, 3 s) all wait for the stall to end.
    with FakeOpenAIServer(STALL) as server:
        open_loop = run(_cfg(server, 50, 3, request_rate=10.0, burstiness=math.inf))
    s = open_loop.summary
    assert s["completed"] == 50
    assert s["p99_ttft_ms"] >= 1000
    assert s["median_ttft_ms"] < 300
    assert _slow(open_loop.records) >= 10
    assert s["p99_client_lag_ms"] < 200  # the client kept to its schedule throughout
    # A closed-loop user waits out the stall in one request and then carries on: one slow sample.
    with FakeOpenAIServer(STALL) as server:
        closed = run(_cfg(server, 30, 3, max_concurrency=1))
    assert closed.mode.startswith("closed loop")
    assert _slow(closed.records) == 1
    assert closed.summary["p90_ttft_ms"] < 300


def test_a_client_side_queue_counts_from_the_scheduled_time():
    # At most one request in flight at 10 req/s: during the stall the *client* queues requests.
    # From their scheduled times they are slow; timed from sending, almost none would be.
    with FakeOpenAIServer(STALL) as server:
        res = run(_cfg(server, 40, 3, request_rate=10.0, burstiness=math.inf, max_concurrency=1))
    assert _slow(res.records) >= 10
    assert _slow(res.records, sent=True) <= 1
    assert res.summary["p99_ttft_ms"] >= 1000
    assert res.summary["p99_client_lag_ms"] < 200  # queueing for the cap is not client lag


def test_a_client_that_cannot_keep_up_is_reported(monkeypatch):
    # Parsing each chunk blocks the client's event loop for 30 ms (a CPU-bound client): it falls
    # behind its own schedule, and the run must say so rather than blame the server.
    import json as real_json
    import time
    import types

    import baton_serve.cluster.bench.client as client_mod

    def slow_loads(text: str):
        time.sleep(0.03)
        return real_json.loads(text)

    monkeypatch.setattr(client_mod, "json", types.SimpleNamespace(loads=slow_loads, dumps=real_json.dumps))
    with FakeOpenAIServer(FakeServerConfig(ttft_s=0.05, itl_s=0.01)) as server:
        res = run(_cfg(server, 20, 4, request_rate=40.0, burstiness=math.inf))
    assert res.summary["completed"] == 20
    assert max(res.summary["p99_client_lag_ms"], res.summary["p99_loop_lag_ms"]) > 25
    assert any("behind schedule" in w for w in res.warnings)
