"""benchmarks/routing.py: policy variants compared in one run are valid router settings; the
per-worker prefill and eviction totals come from the deployment's metrics."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.routing import _policy_specs, _worker_view, policy_config
from cluster.config import ClusterConfig
from cluster.metrics import Metrics


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


def test_worker_view_totals_prefill_tokens_evictions_and_decode_shares_per_worker() -> None:
    m = Metrics("tiny")
    base = {"num_running": 0, "num_waiting": 0, "num_paused": 0, "kv_cache_usage": 0.0, "num_free_blocks": 8,
            "num_blocks": 8, "prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0,
            "num_steps": 1, "busy_seconds": 0.1, "extra": {}}
    m.on_worker_stats(SimpleNamespace(role="prefill", worker_id="prefill-0"),
                      {**base, "num_prefill_tokens_computed": 1000, "num_evicted_blocks": 4, "num_decode_tokens_computed": 0})
    m.on_worker_stats(SimpleNamespace(role="decode", worker_id="decode-0"),
                      {**base, "num_prefill_tokens_computed": 30, "num_evicted_blocks": 0, "num_decode_tokens_computed": 90})
    m.on_worker_stats(SimpleNamespace(role="decode", worker_id="decode-1"),
                      {**base, "num_prefill_tokens_computed": 0, "num_evicted_blocks": 0, "num_decode_tokens_computed": 30})
    view = _worker_view(m.registry)
    assert view["workers"] == {
        "prefill-0": {"prefill_tokens": 1000, "decode_tokens": 0, "evicted_blocks": 4},
        "decode-0": {"prefill_tokens": 30, "decode_tokens": 90, "evicted_blocks": 0},
        "decode-1": {"prefill_tokens": 0, "decode_tokens": 30, "evicted_blocks": 0}}
    assert view["prefill_tokens_computed"] == 1030 and view["evicted_blocks"] == 4
    assert view["decode_share"] == {"decode-0": 0.75, "decode-1": 0.25}  # a worker that decoded nothing is left out
