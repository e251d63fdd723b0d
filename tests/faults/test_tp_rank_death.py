"""A rank of a tensor-parallel replica is killed mid-stream: the replica is dead as a whole (never
hung), its streams are recovered on the other worker, or on the restarted replica, exactly as an
undisturbed run; the other workers' KV blocks all come back."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from baton_serve.cluster.front import PoolClient
from baton_serve.cluster.launcher import Cluster
from baton_serve.router.routing import make_policy

from tests.faults.scenario import NUM_BLOCKS, PARAMS, alive_idle, collect, config
from tests.tiny_model import write_tiny_llama


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tp-faults"), num_heads=8, num_kv_heads=2, seed=3)


@pytest.fixture(scope="module")
def reference(model):
    from tests.faults.scenario import undisturbed

    return undisturbed(model)


def _rank_pids(ray, worker) -> list[int]:
    actors = ray.get(worker.handle.__ray_call__.remote(lambda self: list(self.core.tensor_parallel.ranks.actors)))
    return ray.get([a.pid.remote() for a in actors], timeout=30)


@pytest.mark.parametrize("pools,victim", [
    ({"prefill": 1, "decode": {"replicas": 2, "tensor_parallel_size": 2}}, "decode-0"),
    ({"colocated": {"replicas": 1, "tensor_parallel_size": 2}}, "colocated-0"),
], ids=["one of two decode tp2", "sole colocated tp2"])
def test_a_rank_killed_mid_stream_ends_its_replica_and_the_streams_recover(tp_ray_session, model, reference,
                                                                         pools, victim):
    ray = tp_ray_session
    prompts, want = reference
    cluster = Cluster(config(model, **pools))
    cluster.start()
    target = next(w for w in cluster.workers if w.worker_id == victim)
    (rank_pid,) = _rank_pids(ray, target)

    async def main():
        pool = PoolClient(cluster.workers, cluster.limits, controller=cluster.controller,
                          policy=make_policy("round_robin"))
        await pool.start(stats_interval_s=0.2)
        try:
            tasks = [asyncio.create_task(collect(pool, f"s{i}", prompts[i], PARAMS[i])) for i in range(len(prompts))]
            for _ in range(600):  # until the victim holds a stream that has emitted
                if any(victim in s.workers and s.emitted for s in pool._streams.values()):
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError(f"{victim} never held a stream")
            os.kill(rank_pid, signal.SIGKILL)
            got = await asyncio.wait_for(asyncio.gather(*tasks), 180)
            return got, pool.migrations_total
        finally:
            await pool.stop()

    try:
        got, migrations = asyncio.run(main())
        assert got == want  # every sample of every stream, recovered token for token
        assert migrations >= 1  # the dead replica's streams moved (to the other worker, or its restart)
        alive_idle(cluster, {victim}, num_blocks=NUM_BLOCKS)
    finally:
        cluster.stop()
