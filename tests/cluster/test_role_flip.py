"""A live role flip: the controller drains a prefill worker under load (fronts stop sending it
requests, its own finish and their KV ships), changes it to decode in place, and the fronts route
to it in its new role. Every greedy stream, flipped mid-run or after, equals the offline engine
(fp32), and every block comes back."""

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


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_model_dir):
    config = ClusterConfig.model_validate({
        "engine": {"model": str(tiny_model_dir), "dtype": "float32", "block_size": 8, "num_kv_blocks": NUM_BLOCKS},
        "pools": {"prefill": 2, "decode": 2}, "kv_transfer": {"timeout_s": 10, "transport": "collective"},
        # no grace: the controller asks the worker to change while its requests still run (it refuses)
        "rebalance": {"drain_grace_s": 0}})
    c = Cluster(config)
    c.start()
    yield c
    c.stop()


def _member(cluster: Cluster, wid: str) -> dict:
    import ray

    return ray.get(cluster.controller.snapshot.remote())["members"][wid]


async def _stream(pool: PoolClient, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    out: list[int] = []
    async for d in pool.generate(rid, prompt, params):
        out.extend(d.token_ids)
    return out


async def _flip_under_load(cluster: Cluster, pool: PoolClient, wid: str, role: str, jobs) -> list[list[int]]:
    """Start ``jobs``, flip ``wid`` once it is running some of them, and wait for both."""
    tasks = [asyncio.create_task(_stream(pool, *job)) for job in jobs]
    handle = pool.workers[wid].handle
    deadline = time.monotonic() + 30
    while (await handle.stats.remote())["num_running"] == 0:  # requests in flight there when it flips
        assert time.monotonic() < deadline, f"{wid} never ran a request"
        await asyncio.sleep(0.005)
    await cluster.controller.flip.remote(wid, role)
    done = await asyncio.gather(*tasks)
    while _member(cluster, wid)["role"] != role or pool.workers[wid].role != role or pool.workers[wid].draining:
        assert time.monotonic() < deadline + 60, "the flip did not complete, or the front did not see it"
        await asyncio.sleep(0.1)
    return done


def test_flips_both_ways_under_load_keep_every_stream_and_every_block(cluster, tiny_model_dir):
    import ray

    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS)
    texts = ["Hello world! How are you today?", "def add(a, b):\n    return a + b", "The capital of France",
             "Once upon a time", "1, 2, 3, 4,", "你好，世界！"]
    prompts = [llm.tokenizer.encode(t) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    def jobs(tag: str):
        return [(f"{tag}{i}", p, params) for i, p in enumerate(prompts * 2)]

    async def main():
        # every request crosses the KV hop (no local prefill), in turn over each pool's workers
        pool = PoolClient(cluster.workers, cluster.limits, policy=make_policy("round_robin"),
                          controller=cluster.controller)
        await pool.start(stats_interval_s=0.2)
        try:
            # a decode worker holding running sequences becomes a third prefill worker ...
            first = await _flip_under_load(cluster, pool, "decode-1", "prefill", jobs("a"))
            # ... and a prefill worker in the middle of prompts and shipments becomes a decode worker
            second = await _flip_under_load(cluster, pool, "prefill-1", "decode", jobs("b"))
            after = await asyncio.gather(*(_stream(pool, *job) for job in jobs("c")))
            return first, second, after
        finally:
            await pool.stop()

    first, second, after = asyncio.run(main())
    assert first == expected * 2 and second == expected * 2 and after == expected * 2
    snap = ray.get(cluster.controller.snapshot.remote())
    assert [(f["worker_id"], f["from_role"], f["to_role"]) for f in snap["flips"]] == [
        ("decode-1", "decode", "prefill"), ("prefill-1", "prefill", "decode")]
    assert {w: m["role"] for w, m in snap["members"].items()} == {
        "prefill-0": "prefill", "prefill-1": "decode", "decode-0": "decode", "decode-1": "prefill"}
    assert not any(m["draining"] for m in snap["members"].values())
    infos = {w.worker_id: ray.get(w.handle.info.remote()) for w in cluster.workers}
    assert infos["prefill-1"]["role"] == "decode" and infos["decode-1"]["role"] == "prefill"
    deadline = time.monotonic() + 10
    while True:
        stats = {w.worker_id: ray.get(w.handle.stats.remote()) for w in cluster.workers}
        if all(s["num_free_blocks"] == NUM_BLOCKS and s["tracked_requests"] == 0 for s in stats.values()):
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
    # each worked in its new role: the flipped prefill worker decoded, the flipped decode worker shipped
    assert stats["prefill-1"]["num_decode_tokens_computed"] > 0
    assert stats["decode-1"]["extra"]["kv_transfer"]["shipments"] > 0


def test_a_worker_holding_a_request_refuses_to_change_role(cluster, tiny_model_dir):
    import ray

    w = next(w for w in cluster.workers if w.worker_id == "decode-0")
    params = {"max_tokens": cluster.limits.max_model_len - 8, "temperature": 0.0, "ignore_eos": True}
    ray.get(w.handle.add_request.remote("held", [5, 6, 7, 8], params))
    assert ray.get(w.handle.set_role.remote("prefill")) is False  # its request has not ended
    assert ray.get(w.handle.info.remote())["role"] == "decode"
    ray.get(w.handle.abort.remote("held"))
    deadline = time.monotonic() + 10
    while (s := ray.get(w.handle.stats.remote()))["num_free_blocks"] != NUM_BLOCKS or s["tracked_requests"]:
        assert time.monotonic() < deadline, s
        time.sleep(0.1)


def test_a_flip_that_would_empty_a_pool_or_leave_the_two_roles_is_refused(cluster):
    import ray

    # after the flips above decode-0 and prefill-1 decode; flip one and the other is the last
    ray.get(cluster.controller.flip.remote("decode-0", "prefill"))
    with pytest.raises(ValueError, match="last live decode worker"):
        ray.get(cluster.controller.flip.remote("prefill-1", "prefill"))
    # a second flip of it: refused while it drains, and once it is a prefill worker (no grace here)
    with pytest.raises(ValueError, match="cannot flip now|between prefill and decode"):
        ray.get(cluster.controller.flip.remote("decode-0", "prefill"))
    with pytest.raises(ValueError, match="between prefill and decode"):
        ray.get(cluster.controller.flip.remote("prefill-0", "colocated"))
    with pytest.raises(ValueError, match="unknown worker"):
        ray.get(cluster.controller.flip.remote("decode-9", "prefill"))
    with pytest.raises(ValueError, match="between prefill and decode"):
        ray.get(cluster.workers[0].handle.set_role.remote("colocated"))
