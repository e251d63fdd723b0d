"""``simulate``: our scheduler, block manager, router and admission on a virtual clock. The same
seed repeats a run byte for byte, a policy change changes the result, and a run gives back every
block, slot and reservation it took."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from baton_serve.cluster.bench.metrics import SLO
from baton_serve.cluster.bench.plan import Layout
from baton_serve.cluster.bench.runner import BenchConfig
from baton_serve.cluster.bench.workload import LengthDist, WorkloadConfig
from baton_serve.cluster.config import load_config
from baton_serve.cluster.sim.profile import LatencyProfile
from baton_serve.cluster.sim.run import SimHardware, simulate
from baton_serve.router.routing.policies.prefix import PrefixAffinity

# SmolLM2-135M's shapes in bf16 (30 layers x K,V x 3 kv heads x 64 x 16 tokens x 2 bytes), with
# step times of the order a 2-core CPU gives: enough for the scheduler to batch and queue.
BLOCK_BYTES = 30 * 2 * 3 * 64 * 16 * 2


def profile_data() -> dict:
    return {
        "format": "baton-latency-profile", "version": 1, "created": "2026-12-06T00:00:00+00:00",
        "source": "published", "note": "hand-written for tests",
        "machine": {"cpu_model": "test", "cores": 2, "threads": 2, "device": "cpu"},
        "model": {"name": "m", "dtype": "bfloat16", "block_size": 16, "kv_block_bytes": BLOCK_BYTES,
                  "max_position_embeddings": 8192},
        "step_overhead_s": 0.02,
        "prefill": {"new_tokens": [1, 256, 2048], "cached_tokens": [0, 2048],
                    "seconds": [[0.021, 0.025], [0.08, 0.1], [0.5, 0.7]]},
        "decode": {"batch": [1, 64], "context_per_seq": [16, 2048], "seconds": [[0.021, 0.024], [0.04, 0.09]]},
        "mixed": {"rule": "sum", "validation": None},
        "kv_transfer": {"shared_memory": {"fixed_s": 0.0005, "per_block_s": 0.00005},
                        "collective": {"fixed_s": 0.004, "per_block_s": 0.00007}},
    }


@pytest.fixture
def profile() -> LatencyProfile:
    return LatencyProfile.from_dict(profile_data())


def _config(policy: str = "cost"):
    return load_config(None).with_overrides(**{"router.policy": policy, "engine.num_kv_blocks": 2048})


def _bench(workload: WorkloadConfig, n: int = 40, rate: float = 8.0, **kw) -> BenchConfig:
    return BenchConfig(workload=workload, num_prompts=n, request_rate=rate, seed=3, disable_tqdm=True, **kw)


RANDOM = WorkloadConfig("random", input_len=LengthDist(200, range_ratio=0.5), output_len=LengthDist(24, range_ratio=0.5))
SHARED = WorkloadConfig("shared-prefix", input_len=LengthDist(96), output_len=LengthDist(8), num_prefixes=6,
                        prefix_len=512)
HW = SimHardware(shared_cores=2, threads=2)


def _dump(res) -> str:
    return json.dumps({"summary": res.summary, "records": [dataclasses.asdict(r) for r in res.records],
                       "workers": res.workers}, sort_keys=True, default=str)


@pytest.mark.parametrize("layout", [Layout(1, 1), Layout(0, 0, 2)], ids=["1P+1D", "2 colocated"])
def test_the_same_seed_gives_the_same_simulation_byte_for_byte(profile, layout):
    runs = [simulate(_config(), layout, _bench(RANDOM), profile, HW, seed=5) for _ in range(2)]
    assert _dump(runs[0]) == _dump(runs[1])
    s = runs[0].summary
    assert s["completed"] == 40 and s["failed"] == 0
    assert s["total_output_tokens"] == sum(r.expected_output_len for r in runs[0].records)
    # the time is the profile's: each request waits at least its prefill step and each output token a step
    assert s["p50_ttft_ms"] >= 1e3 * profile.prefill_s(100, 0)
    assert s["p50_tpot_ms"] >= 1e3 * profile.decode_s(1, 100)


def test_a_finished_run_gives_back_every_block_slot_and_reservation(profile):
    res = simulate(_config(), Layout(1, 2), _bench(SHARED, n=60, rate=30.0), profile, HW, seed=1)
    assert res.summary["completed"] == 60
    for wid, w in res.workers.items():
        assert (w["blocks_held"], w["requests_left"], w["parked"], w["incoming"]) == (0, 0, 0, 0), wid
    assert res.admission_blocks_held == 0
    # the cost policy ships some prompts from the prefill worker and prefills others where their
    # system prompt is already cached, on a decode worker
    assert res.workers["prefill-0"]["shipments"] > 0
    assert res.workers["decode-0"]["prefill_tokens"] + res.workers["decode-1"]["prefill_tokens"] > 0
    assert res.summary["prefix_hit_rate"] > 0.5  # six system prompts of 512 tokens, reused


def test_more_load_than_the_hardware_serves_queues_and_goodput_follows_the_slo(profile):
    light = simulate(_config(), Layout(0, 0, 2), _bench(RANDOM, n=30, rate=1.0), profile, HW)
    heavy = simulate(_config(), Layout(0, 0, 2), _bench(RANDOM, n=30, rate=math.inf), profile, HW)
    assert heavy.summary["p99_ttft_ms"] > 3 * light.summary["p99_ttft_ms"]
    slo = SLO(ttft_ms=light.summary["p99_ttft_ms"] * 1.5)
    judged = simulate(_config(), Layout(0, 0, 2), _bench(RANDOM, n=30, rate=math.inf, slo=slo), profile, HW)
    assert 0 <= judged.summary["slo_attainment"] < 1


def test_changing_a_policys_scoring_changes_the_simulation(profile, monkeypatch):
    """The simulator calls the registered policy itself: scoring prefix matches the other way
    round (send a prompt where its prefix is *not* cached) loses the cache hits."""
    bench = _bench(SHARED, n=48, rate=20.0)
    layout = Layout(0, 0, 3)
    as_shipped = simulate(_config("prefix"), layout, bench, profile, HW)

    def anti_affinity(self, request, pool, candidates):
        fewest = min(candidates.matched(w) for w in pool)
        return self._least_loaded([w for w in pool if candidates.matched(w) == fewest]), "anti"

    monkeypatch.setattr(PrefixAffinity, "_pick", anti_affinity)
    inverted = simulate(_config("prefix"), layout, bench, profile, HW)
    hit = as_shipped.summary["prefix_hit_rate"]
    assert hit > inverted.summary["prefix_hit_rate"] + 0.1
    assert _dump(as_shipped) != _dump(inverted)


def test_the_simulated_cluster_has_the_configs_kv_cache_and_rejects_what_it_cannot_hold(profile):
    """A prompt larger than the decode worker's whole cache fails as the live front fails it,
    and takes nothing with it."""
    cfg = load_config(None).with_overrides(**{"engine.num_kv_blocks": 16})  # 256 tokens
    wl = WorkloadConfig("random", input_len=LengthDist(400), output_len=LengthDist(8))
    res = simulate(cfg, Layout(1, 1), _bench(wl, n=3), profile, HW)
    assert res.summary["failed"] == 3 and res.summary["completed"] == 0
    assert all(r.error for r in res.records)
    assert all(w["blocks_held"] == 0 and w["requests_left"] == 0 for w in res.workers.values())


def test_the_cost_models_per_decision_memo_changes_no_decision(profile, monkeypatch):
    """Fits made once per decision (``CostModel.deciding``) price every pair as fits made afresh
    for each did: the same run either way, on a pool big enough to pool fits across mates."""
    import contextlib

    from baton_serve.router.routing.cost_model import CostModel

    bench = _bench(SHARED, n=40, rate=30.0)
    hw = SimHardware(shared_cores=0, threads=2)
    memoised = simulate(_config("cost"), Layout(3, 3), bench, profile, hw, seed=2)
    monkeypatch.setattr(CostModel, "deciding", lambda self: contextlib.nullcontext(self))
    afresh = simulate(_config("cost"), Layout(3, 3), bench, profile, hw, seed=2)
    assert _dump(memoised) == _dump(afresh)
    assert memoised.summary["completed"] == 40
