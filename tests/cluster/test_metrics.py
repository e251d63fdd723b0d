"""Worker snapshots become Prometheus gauges and counters (counters from cumulative totals)."""

from __future__ import annotations

from types import SimpleNamespace

from baton_serve.cluster.metrics import Metrics


def _stats(**over) -> dict:
    base = {"num_running": 3, "num_waiting": 1, "num_paused": 2, "kv_cache_usage": 0.25, "num_free_blocks": 30,
            "num_blocks": 40, "prefix_cache_queries": 100, "prefix_cache_hits": 40, "num_evicted_blocks": 6,
            "num_preemptions": 1,
            "num_steps": 10, "busy_seconds": 1.5, "num_prefill_tokens_computed": 500,
            "num_decode_tokens_computed": 20, "extra": {"kv_transfer": {"bytes": 4096, "recent_seconds": [0.01]}, "core_wait_seconds": 0.5}}
    return {**base, **over}


def _value(m: Metrics, name: str, **labels) -> float:
    v = m.registry.get_sample_value(name, {"role": "decode", "worker": "decode-0", **labels})
    assert v is not None, name
    return v


def test_snapshots_fill_gauges_and_counter_deltas() -> None:
    m = Metrics("tiny")
    worker = SimpleNamespace(role="decode", worker_id="decode-0")
    m.on_worker_stats(worker, _stats())
    m.on_worker_stats(worker, _stats(num_steps=25, busy_seconds=4.0, num_decode_tokens_computed=80,
                                     num_paused=0, prefix_cache_queries=150, num_evicted_blocks=9))
    assert _value(m, "baton:num_requests_running") == 3
    assert _value(m, "baton:num_requests_paused") == 0
    assert _value(m, "baton:engine_steps_total") == 25  # totals, not the sum of both snapshots
    assert _value(m, "baton:engine_busy_seconds_total") == 4.0
    assert _value(m, "baton:tokens_computed_total", kind="decode") == 80
    assert _value(m, "baton:tokens_computed_total", kind="prefill") == 500
    assert _value(m, "baton:prefix_cache_queries_total") == 150
    assert _value(m, "baton:prefix_cache_evicted_blocks_total") == 9
    assert _value(m, "baton:kv_transfer_bytes_total") == 4096
    assert _value(m, "baton:core_wait_seconds_total") == 0.5
    assert _value(m, "baton:worker_up") == 1


def test_a_down_worker_reports_zero_and_keeps_its_counters() -> None:
    m = Metrics("tiny")
    worker = SimpleNamespace(role="decode", worker_id="decode-0")
    m.on_worker_stats(worker, _stats())
    m.on_worker_stats(worker, None)
    assert _value(m, "baton:worker_up") == 0
    assert _value(m, "baton:engine_steps_total") == 10
