"""The rebalancer in a live controller: it reads the workers' latency samples and stats, and with
the decode pool short (a TPOT target no CPU meets) and the prefill pool idle it flips a prefill
worker to decode, logging why; greedy streams stay the offline engine's (fp32). A dry run decides
the same and changes nothing."""

from __future__ import annotations

import asyncio
import time

import pytest
from baton_serve.cluster.config import ClusterConfig
from baton_serve.cluster.front import PoolClient
from baton_serve.cluster.launcher import Cluster
from baton_serve.router.routing import make_policy
from baton_serve.workers import LLM, SamplingParams

NUM_BLOCKS = 96
FAST = {"enabled": True, "interval_s": 0.5, "window_s": 30, "cooldown_s": 1000, "min_dwell_s": 0,
        "min_requests": 4, "tpot_target_s": 1e-4, "ttft_target_s": 60, "drain_grace_s": 0.5}


def _cluster(model_dir, **rebalance) -> Cluster:
    return Cluster(ClusterConfig.model_validate({
        "engine": {"model": str(model_dir), "dtype": "float32", "block_size": 8, "num_kv_blocks": NUM_BLOCKS},
        "pools": {"prefill": 2, "decode": 1}, "kv_transfer": {"timeout_s": 10, "transport": "collective"},
        "rebalance": {**FAST, **rebalance}}))


def _snapshot(cluster: Cluster) -> dict:
    import ray

    return ray.get(cluster.controller.snapshot.remote())


def _serve(cluster: Cluster, prompts, params, until) -> list[list[int]]:
    """Rounds of ``prompts`` through one front until ``until(snapshot)`` holds (30 s at most)."""
    async def stream(pool, rid, prompt):
        out = []
        async for d in pool.generate(rid, prompt, params):
            out.extend(d.token_ids)
        return out

    async def main():
        pool = PoolClient(cluster.workers, cluster.limits, policy=make_policy("round_robin"),
                          controller=cluster.controller)
        await pool.start(stats_interval_s=0.2)
        results, deadline, k = [], time.monotonic() + 30, 0
        try:
            while not until(_snapshot(cluster)):
                assert time.monotonic() < deadline, _snapshot(cluster)["rebalance"]
                results += await asyncio.gather(*(stream(pool, f"r{k}-{i}", p) for i, p in enumerate(prompts)))
                k += 1
            results += await asyncio.gather(*(stream(pool, f"last-{i}", p) for i, p in enumerate(prompts)))
        finally:
            await pool.stop()
        return results

    return asyncio.run(main())


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS)


def _prompts(llm):
    return [llm.tokenizer.encode(t) for t in ("Hello world!", "def f(x):", "Once upon a time", "1, 2, 3,")]


def test_a_short_decode_pool_takes_an_idle_prefill_worker(ray_session, tiny_model_dir, llm):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = _prompts(llm)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    cluster = _cluster(tiny_model_dir)
    cluster.start()
    try:
        results = _serve(cluster, prompts, params,
                         lambda snap: any(m["role"] == "decode" and w.startswith("prefill")
                                          for w, m in snap["members"].items()))
        snap = _snapshot(cluster)
    finally:
        cluster.stop()
    assert results == expected * (len(results) // len(prompts))
    flips = [f for f in snap["flips"] if not f.get("given_up")]
    assert len(flips) == 1 and flips[0]["to_role"] == "decode" and flips[0]["reason"] == "decode_pressure"
    rb = snap["rebalance"]
    assert rb["enabled"] and not rb["dry_run"] and rb["counts"]["flip:decode_pressure"] == 1
    acted = rb["acted"][0]
    assert acted["pressures"]["decode"] > 1.0 and acted["inputs"]["decode"]["workers"] == 1
    assert acted["inputs"]["requests"] >= FAST["min_requests"]


def test_a_dry_run_decides_and_flips_nothing(ray_session, tiny_model_dir, llm):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cluster = _cluster(tiny_model_dir, dry_run=True)
    cluster.start()
    try:
        _serve(cluster, _prompts(llm), params, lambda snap: snap["rebalance"]["acted"])
        snap = _snapshot(cluster)
    finally:
        cluster.stop()
    assert snap["rebalance"]["dry_run"] and snap["rebalance"]["acted"][0]["actions"][0]["kind"] == "flip"
    assert snap["flips"] == []
    assert sorted(m["role"] for m in snap["members"].values()) == ["decode", "prefill", "prefill"]
