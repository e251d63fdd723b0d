"""benchmarks/routing.py: policy variants compared in one run are valid router settings; the
per-worker prefill and eviction totals come from the deployment's metrics."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from baton_serve.cluster.config import ClusterConfig
from baton_serve.cluster.metrics import Metrics

from benchmarks.routing import _policy_specs, _worker_view, policy_config


def test_a_policy_variant_becomes_router_settings_the_config_accepts() -> None:
    assert policy_config("prefix") == {"policy": "prefix"}
    variant = policy_config("cost:share_weight=0,conditional_disaggregation=false")
    assert variant == {"policy": "cost", "share_weight": 0, "conditional_disaggregation": False}
    policy = ClusterConfig.model_validate({"router": variant}).router.make_policy()
    assert policy.model.share_weight == 0 and not policy.conditional_disaggregation
    with pytest.raises(ValueError, match="not key=value"):
        policy_config("cost:share_weight")
    assert _policy_specs("prefix,cost") == ["prefix", "cost"]
    assert _policy_specs("prefix; cost:share_weight=0,stall_weight=2") == ["prefix", "cost:share_weight=0,stall_weight=2"]


def test_worker_view_totals_prefill_tokens_evictions_preemptions_and_decode_shares_per_worker() -> None:
    m = Metrics("tiny")
    base = {"num_running": 0, "num_waiting": 0, "num_paused": 0, "kv_cache_usage": 0.0, "num_free_blocks": 8,
            "num_blocks": 8, "prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0,
            "num_steps": 1, "busy_seconds": 0.1, "extra": {}}
    m.on_worker_stats(SimpleNamespace(role="prefill", worker_id="prefill-0"),
                      {**base, "num_prefill_tokens_computed": 1000, "num_evicted_blocks": 4, "num_decode_tokens_computed": 0})
    m.on_worker_stats(SimpleNamespace(role="decode", worker_id="decode-0"),
                      {**base, "num_prefill_tokens_computed": 30, "num_evicted_blocks": 0, "num_decode_tokens_computed": 90,
                       "num_preemptions": 2})
    m.on_worker_stats(SimpleNamespace(role="decode", worker_id="decode-1"),
                      {**base, "num_prefill_tokens_computed": 0, "num_evicted_blocks": 0, "num_decode_tokens_computed": 30})
    view = _worker_view(m.registry)
    assert view["workers"] == {
        "prefill-0": {"prefill_tokens": 1000, "decode_tokens": 0, "evicted_blocks": 4, "preemptions": 0},
        "decode-0": {"prefill_tokens": 30, "decode_tokens": 90, "evicted_blocks": 0, "preemptions": 2},
        "decode-1": {"prefill_tokens": 0, "decode_tokens": 30, "evicted_blocks": 0, "preemptions": 0}}
    assert view["prefill_tokens_computed"] == 1030 and view["evicted_blocks"] == 4
    assert view["decode_share"] == {"decode-0": 0.75, "decode-1": 0.25}  # a worker that decoded nothing is left out


def test_repeats_take_the_policies_in_turn_within_each_seed() -> None:
    from benchmarks.routing import _schedule

    order = _schedule(["2P+2D"], ["skewed"], [0, 1], 2, ["prefix", "cost"])
    assert [(seed, run, policy) for _, _, seed, run, policy in order] == [
        (0, 0, "prefix"), (0, 0, "cost"), (0, 1, "prefix"), (0, 1, "cost"),
        (1, 0, "prefix"), (1, 0, "cost"), (1, 1, "prefix"), (1, 1, "cost")]


def test_summary_takes_each_policys_geomean_over_its_runs_and_counts_paired_wins() -> None:
    from benchmarks.routing import summarize

    def run(policy: str, seed: int, p99: float, tput: float) -> dict:
        return {"layout": "2P+2D", "workload": "skewed", "policy": policy, "seed": seed, "repeat": 0,
                "p99_ttft_ms": p99, "output_throughput": tput}

    results = [run("prefix", 0, 100, 10), run("cost", 0, 400, 10), run("prefix", 1, 400, 10),
               run("cost", 1, 25, 40), {"layout": "2P+2D", "workload": "skewed", "policy": "cost", "seed": 2,
                                         "repeat": 0, "error": "TimeoutError"}]
    cell = summarize(results)["2P+2D"]["skewed"]
    # geomeans: prefix 200, cost 100 (the failed run counts nowhere); throughput 10 against 20
    assert cell["p99_ttft_prefix_over_cost"] == pytest.approx(2.0)
    assert cell["throughput_cost_over_best_other"] == pytest.approx(2.0)
    assert cell["runs"] == 2 and cell["cost_p99_lower_than_prefix_in"] == "1/2"
    assert summarize(results)["4 colocated"] == {}


def test_each_run_gets_its_own_decision_log_path_the_config_accepts(tmp_path) -> None:
    from benchmarks.routing import _decision_log_path

    row = {"layout": "4 colocated", "workload": "skewed", "policy": "cost:share_weight=0", "seed": 1, "repeat": 0}
    path = _decision_log_path(str(tmp_path / "logs"), row)
    assert path == str(tmp_path / "logs" / "4-colocated_skewed_cost-share_weight=0_s1_r0.jsonl")
    assert (tmp_path / "logs").is_dir() and _decision_log_path(None, row) is None
    router = ClusterConfig.model_validate({"router": {**policy_config("cost"), "decision_log": path}}).router
    assert router.decision_log == path


def test_a_load_runs_each_cell_at_a_fraction_of_the_capacity_measured_first(monkeypatch, tmp_path) -> None:
    import math

    from benchmarks import routing

    calls = []

    def fake_run(args, layout, policy, workload, seed, log=None, request_rate=None, max_concurrency=None):
        calls.append((layout, policy, request_rate, max_concurrency))
        tput = 2.0 if layout == "2P+2D" else 3.0  # req/s the cell sustains all at once
        return {"completed": 8, "failed": 0, "duration": 1.0, "request_throughput": tput, "output_throughput": 10.0,
                "p99_ttft_ms": 100.0, "median_ttft_ms": 50.0, "median_tpot_ms": 5.0, "prefix_hit_rate": 0.5,
                "request_goodput": 1.0, "decisions": {}}

    monkeypatch.setattr(routing, "run_one", fake_run)
    out = tmp_path / "r.json"
    assert routing.main(["--layouts", "2P+2D,4 colocated", "--workloads", "skewed", "--policies", "prefix;cost",
                         "--seeds", "0,1", "--load", "0.5", "--out", str(out)]) == 0
    # one capacity run per cell, all at once under the baseline, then every run at half of it
    assert calls[0] == ("2P+2D", "prefix", math.inf, 16) and calls[5] == ("4 colocated", "prefix", math.inf, 16)
    assert [c[2] for c in calls[1:5]] == [1.0] * 4 and [c[2] for c in calls[6:]] == [1.5] * 4
    doc = __import__("json").loads(out.read_text())
    assert doc["capacities"]["2P+2D / skewed"]["request_throughput"] == 2.0
    assert {r["request_rate"] for r in doc["results"]} == {1.0, 1.5}
    with pytest.raises(ValueError, match="no capacity"):
        routing.load_rate(0.5, {"request_throughput": 2.0, "failed": 3})
