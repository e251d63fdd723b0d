"""The recovery drill on the real model in bf16, with the deterministic mode on: a worker killed
mid-stream, its streams re-prefilled elsewhere (prompt + the tokens already sent) and continued,
and every stream equals the undisturbed run token for token. With the mode off the same drill
diverges in bf16 (the re-prefill sums in another order than the decode steps did); in fp32 the
tiny-model drills of test_worker_death.py hold either way."""

from __future__ import annotations

import asyncio
import random

import pytest
from baton_serve.cluster.config import ClusterConfig
from baton_serve.cluster.front import PoolClient
from baton_serve.cluster.launcher import Cluster
from baton_serve.router.routing import make_policy
from baton_serve.workers import LLM, SamplingParams

from tests.faults.scenario import alive_idle
from tests.faults.test_worker_death import _batch_with_kill, _busiest

NUM_BLOCKS = 256
PROMPTS = ["Write a story about a dragon who learns to read.", "Explain how a refrigerator works.",
           "List the planets of the solar system and one fact about each.", "Describe a walk through Paris.",
           "What makes a good cup of tea?", "Tell me about the history of the printing press."]
PARAMS = [SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)] * 5 + [
    SamplingParams(temperature=0.8, seed=7, max_tokens=96, ignore_eos=True)]


def _engine(model_dir) -> dict:
    return {"model": str(model_dir), "dtype": "bfloat16", "deterministic": True, "block_size": 16,
            "num_kv_blocks": NUM_BLOCKS, "threads_per_worker": 1}


@pytest.fixture(scope="module")
def smol_reference(default_model_dir):
    """Each prompt alone on the offline engine: the undisturbed streams."""
    llm = LLM(model=str(default_model_dir), dtype="bfloat16", deterministic=True, block_size=16,
              num_kv_blocks=NUM_BLOCKS, num_threads=1)
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    want = [{0: list(llm.generate([p], s)[0].outputs[0].token_ids)} for p, s in zip(prompts, PARAMS)]
    return prompts, want


@pytest.mark.parametrize("pools,role", [(dict(colocated=2), "colocated"), (dict(prefill=1, decode=2), "decode")],
                         ids=["colocated", "decode"])
def test_bf16_streams_recovered_identically(ray_session, default_model_dir, smol_reference, pools, role):
    prompts, want = smol_reference
    kill_after = random.Random(f"{role}-bf16").randint(20, 60)
    print(f"killing the busiest {role} worker once every stream has {kill_after} tokens")
    cluster = Cluster(ClusterConfig.model_validate({"engine": _engine(default_model_dir), "pools": pools,
                                                    "kv_transfer": {"timeout_s": 20}}))
    cluster.start()

    async def main():
        pool = PoolClient(cluster.workers, cluster.limits, policy=make_policy("round_robin"))
        await pool.start(stats_interval_s=0.2)
        try:
            got, dead = await _batch_with_kill(pool, prompts, _busiest(role), kill_after, params=PARAMS)
            return got, dead, pool.migrations_total
        finally:
            await pool.stop()

    try:
        got, dead, migrations = asyncio.run(main())
        assert migrations >= 1
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"stream {i} differs from the undisturbed run"
        alive_idle(cluster, {dead}, num_blocks=NUM_BLOCKS)
    finally:
        cluster.stop()
