"""What every fault scenario shares: the batch of streams, the deployment's config, and the
checks that nothing was lost or held."""

from __future__ import annotations

import time

from baton_serve.cluster.config import ClusterConfig
from baton_serve.cluster.front import PoolClient
from baton_serve.cluster.launcher import Cluster
from baton_serve.workers import LLM, SamplingParams

NUM_BLOCKS = 64
PROMPTS = ["Hello world", "The sky is", "One two three", "Paris is the capital of"]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=40, ignore_eos=True),
    SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=32, ignore_eos=True),
    SamplingParams(temperature=0.7, seed=3, frequency_penalty=0.4, max_tokens=40, ignore_eos=True),
]


def config(model_dir, **pools) -> ClusterConfig:
    """The tiny model in fp32, one thread per worker, the given pools."""
    return ClusterConfig.model_validate({
        "engine": {"model": str(model_dir), "dtype": "float32", "block_size": 8, "num_kv_blocks": NUM_BLOCKS,
                   "threads_per_worker": 1},
        "pools": pools, "kv_transfer": {"timeout_s": 10},
    })


def free_port() -> int:
    """A loopback port nobody holds now, for a deployment's HTTP fronts."""
    from baton_serve.router.server import bind_socket

    probe = bind_socket("127.0.0.1", 0)
    try:
        return probe.getsockname()[1]
    finally:
        probe.close()


def undisturbed(model_dir) -> tuple[list[list[int]], list[dict[int, list[int]]]]:
    """The prompts, and the undisturbed run of every stream: the offline engine's tokens per sample."""
    llm = LLM(model=str(model_dir), dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS)
    prompts = [llm.tokenizer.encode(t) for t in PROMPTS]
    want = [{o.index: o.token_ids for o in llm.generate([p], params)[0].outputs}
            for p, params in zip(prompts, PARAMS)]
    return prompts, want


def alive_idle(cluster: Cluster, dead: set[str], tracked: bool = True, num_blocks: int = NUM_BLOCKS) -> None:
    """Every surviving worker holds no request (nor tracks one for a front) and has every KV block
    free again."""
    import ray

    for w in cluster.workers:
        if w.worker_id in dead:
            continue
        deadline = time.monotonic() + 15
        while True:
            stats = ray.get(w.handle.stats.remote())
            if (stats["num_free_blocks"] == num_blocks and stats["num_running"] == 0 and stats["num_waiting"] == 0
                    and (not tracked or stats["tracked_requests"] == 0)):
                break
            if time.monotonic() > deadline:
                owners = ray.get(w.handle.__ray_call__.remote(lambda self: (
                    {k: sorted(v[1]) for k, v in list(self._owner.items())[:8]},
                    {"incoming": sorted(self.core.incoming)[:8], "parked": sorted(self.core.parked)[:8]})))
                raise AssertionError((w.worker_id, stats, owners))
            time.sleep(0.2)


async def collect(pool: PoolClient, rid: str, prompt, params) -> dict[int, list[int]]:
    """One stream's tokens per sample."""
    toks: dict[int, list[int]] = {}
    async for d in pool.generate(rid, prompt, params):
        toks.setdefault(d.index, []).extend(d.token_ids)
    return toks
