"""Prefix-cache hits as the client sees them: ``usage.prompt_tokens_details.cached_tokens`` parsed
from a streamed usage chunk and from a non-streamed response, unknown (not 0) when absent, and the
run's ``prefix_hit_rate`` = sum(cached) / sum(prompt tokens) over the requests that reported it."""

from __future__ import annotations

import json

import httpx
import pytest
from baton_serve.cluster.bench.client import CHAT, cached_tokens
from baton_serve.cluster.bench.fakeserver import FakeOpenAIServer, FakeServerConfig
from baton_serve.cluster.bench.metrics import RequestRecord, summarize
from baton_serve.cluster.bench.report import markdown, result_json, write_json
from baton_serve.cluster.bench.runner import BenchConfig, BenchResult, run
from baton_serve.cluster.bench.workload import LengthDist, WorkloadConfig


def _half_on_even(i: int, prompt_tokens: int) -> int | None:
    """Even arrivals report half their prompt as cached; odd ones say nothing."""
    return prompt_tokens // 2 if i % 2 == 0 else None


def _cfg(server: FakeOpenAIServer, n: int, **kw) -> BenchConfig:
    # One request at a time, so the server's arrival order is the records' order.
    return BenchConfig(base_url=server.url, num_prompts=n, num_warmups=0, disable_tqdm=True, request_timeout_s=30,
                       max_concurrency=1, workload=WorkloadConfig(input_len=LengthDist(16, range_ratio=0.5),
                                                                  output_len=LengthDist(2)), **kw)


def test_usage_without_cached_tokens_is_unknown_not_zero():
    assert cached_tokens({"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}) == 4
    assert cached_tokens({"prompt_tokens_details": {"cached_tokens": 0}}) == 0  # a real miss
    for usage in ({}, {"prompt_tokens_details": None}, {"prompt_tokens_details": {}},
                  {"prompt_tokens_details": {"cached_tokens": None}}, {"prompt_tokens_details": {"cached_tokens": "4"}},
                  {"prompt_tokens_details": {"cached_tokens": True}}, {"prompt_tokens_details": {"cached_tokens": -1}}):
        assert cached_tokens(usage) is None, usage


@pytest.mark.parametrize("endpoint", ["/v1/completions", CHAT])
def test_cached_tokens_from_the_streamed_usage_chunk(endpoint):
    with FakeOpenAIServer(FakeServerConfig(ttft_s=0.02, itl_s=0.005, cached_tokens_for=_half_on_even)) as server:
        res = run(_cfg(server, 6, endpoint=endpoint))
        bodies = server.bodies
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} for b in bodies)
    recs = res.records
    assert all(r.ok for r in recs) and len({r.prompt_len for r in recs}) > 1
    assert [r.cached_tokens for r in recs] == [r.prompt_len // 2 if r.index % 2 == 0 else None for r in recs]
    even = recs[0::2]
    s = res.summary
    assert s["cached_tokens_reported"] == 3
    assert s["prefix_hit_rate"] == pytest.approx(sum(r.prompt_len // 2 for r in even) / sum(r.prompt_len for r in even))
    data = result_json(res)
    assert [r["cached_tokens"] for r in data["requests"]] == [r.cached_tokens for r in recs]
    assert f"prefix cache hit rate {s['prefix_hit_rate']:.1%}" in markdown(res)
    assert "reported by 3 of 6 completed requests" in markdown(res)


@pytest.mark.parametrize("path", ["/v1/completions", CHAT])
def test_cached_tokens_from_a_non_streamed_response(path):
    cfg = FakeServerConfig(ttft_s=0.01, itl_s=0.001, cached_tokens_for=lambda i, n: 3 if i == 0 else None)
    body = {"model": "fake-model", "max_tokens": 2, "stream": False,
            **({"messages": [{"role": "user", "content": "a b c d e"}]} if path == CHAT else {"prompt": [1] * 7})}
    with FakeOpenAIServer(cfg) as server:
        first = httpx.post(server.url + path, json=body, timeout=10)
        second = httpx.post(server.url + path, json=body, timeout=10)
    assert first.headers["content-type"] == "application/json"
    usage = first.json()["usage"]
    assert usage["completion_tokens"] == 2 and usage["prompt_tokens_details"] == {"cached_tokens": 3}
    assert cached_tokens(usage) == 3
    assert "prompt_tokens_details" not in second.json()["usage"] and cached_tokens(second.json()["usage"]) is None


def test_a_server_that_reports_nothing_gives_an_unknown_hit_rate(tmp_path):
    with FakeOpenAIServer(FakeServerConfig(ttft_s=0.02, itl_s=0.005)) as server:  # the default: no details
        res = run(_cfg(server, 3))
    assert [r.cached_tokens for r in res.records] == [None] * 3
    assert res.summary["prefix_hit_rate"] is None and res.summary["cached_tokens_reported"] == 0
    assert "prefix cache hit rate unknown" in markdown(res)
    data = json.loads(write_json(result_json(res), tmp_path / "r.json").read_text())
    assert data["prefix_hit_rate"] is None and data["cached_tokens_reported"] == 0


def _rec(i: int, prompt_len: int, cached: int | None, ok: bool = True) -> RequestRecord:
    return RequestRecord(index=i, prompt_len=prompt_len, expected_output_len=1, t_scheduled=0.0, t_ready=0.0,
                         t_sent=0.0, t_end=1.0, emit_times=[0.5] if ok else [], output_tokens=1 if ok else 0,
                         cached_tokens=cached, ok=ok)


def test_the_hit_rate_counts_only_requests_that_reported_it():
    # Reported: 10/20, 0/10, 5/10 -> 15/40; the silent 100-token prompt and the failure are left out.
    recs = [_rec(0, 20, 10), _rec(1, 10, 0), _rec(2, 100, None), _rec(3, 10, 5), _rec(4, 50, 50, ok=False)]
    s = summarize(recs, duration_s=1.0)
    assert s["prefix_hit_rate"] == pytest.approx(0.375) and s["cached_tokens_reported"] == 3
    keys = list(s)
    assert keys.index("prefix_hit_rate") == keys.index("total_token_throughput") + 1  # beside throughput
    none = summarize([_rec(0, 20, None), _rec(1, 50, 50, ok=False)], duration_s=1.0)
    assert none["prefix_hit_rate"] is None and none["cached_tokens_reported"] == 0
    assert summarize([], 0.0)["prefix_hit_rate"] is None
    zeros = summarize([_rec(0, 20, 0), _rec(1, 30, 0)], duration_s=1.0)
    assert zeros["prefix_hit_rate"] == 0.0 and zeros["cached_tokens_reported"] == 2  # reported misses are 0


def test_the_report_prints_the_hit_rate_beside_throughput():
    recs = [_rec(0, 20, 10), _rec(1, 20, None)]
    summary = summarize(recs, 1.0) | {"p99_loop_lag_ms": 0.0, "max_loop_lag_ms": 0.0}
    res = BenchResult(config=BenchConfig(), model="m", summary=summary, records=recs, cold=None,
                      prompt_lengths="exact", tokenizer_note="", mode="closed loop", warnings=[], started="")
    lines = markdown(res).splitlines()
    throughput = next(i for i, ln in enumerate(lines) if "request throughput" in ln)
    assert lines[throughput + 1] == ("- prefix cache hit rate 50.0% of prompt tokens "
                                     "(cached tokens reported by 1 of 2 completed requests)")
    data = result_json(res)
    assert data["prefix_hit_rate"] == 0.5 and data["cached_tokens_reported"] == 1
