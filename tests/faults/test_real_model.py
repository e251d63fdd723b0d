"""The one real-model scenario: SmolLM2's decode worker killed mid-stream (1 prefill + 2 decode);
each greedy stream's text is the undisturbed run's, token for token."""

from __future__ import annotations

import asyncio

import pytest
from baton_serve.cluster.config import ClusterConfig
from baton_serve.cluster.front import PoolClient
from baton_serve.cluster.launcher import Cluster
from baton_serve.router.routing import make_policy
from baton_serve.workers import LLM, SamplingParams

from tests.faults.test_worker_death import _batch_with_kill, _busiest

PROMPTS = ["The capital of France is", "Water boils at a temperature of", "A haiku about autumn:"]


@pytest.mark.slow
def test_smollm2_decode_killed_mid_stream_text_identical(ray_session, default_model_dir):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm = LLM(model=str(default_model_dir), dtype="float32", num_kv_blocks=128)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    want = [{0: o.outputs[0].token_ids} for o in llm.generate(prompts, params)]
    del llm
    cluster = Cluster(ClusterConfig.model_validate({
        "engine": {"model": str(default_model_dir), "dtype": "float32", "num_kv_blocks": 128,
                   "threads_per_worker": 1},
        "pools": {"prefill": 1, "decode": 2}}))
    cluster.start()

    async def main():
        pool = PoolClient(cluster.workers, cluster.limits, policy=make_policy("least_loaded"))
        await pool.start(stats_interval_s=0.2)
        try:
            return await _batch_with_kill(pool, prompts, _busiest("decode"), 8, params=[params] * len(prompts))
        finally:
            await pool.stop()

    try:
        got, _ = asyncio.run(main())
        assert got == want
    finally:
        cluster.stop()
