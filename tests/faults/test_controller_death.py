"""The controller dies mid-stream: serving goes on (fronts route on their last view), Ray starts
the controller again, and the restarted one still restarts a worker that dies afterwards."""

from __future__ import annotations

import asyncio
import time

from baton_serve.cluster.front import PoolClient
from baton_serve.cluster.launcher import Cluster
from baton_serve.router.routing import make_policy

from tests.faults.scenario import PARAMS, alive_idle, collect, config


def test_controller_killed_mid_stream_serving_goes_on(ray_session, tiny_model_dir, reference):
    import ray

    prompts, want = reference
    cluster = Cluster(config(tiny_model_dir, colocated=2))
    cluster.start()

    async def main():
        pool = PoolClient(cluster.workers, cluster.limits, controller=cluster.controller,
                          policy=make_policy("round_robin"))
        await pool.start(stats_interval_s=0.2)
        try:
            tasks = [asyncio.create_task(collect(pool, f"k{i}", prompts[i], PARAMS[i])) for i in range(4)]
            while not all(s.emitted for s in list(pool._streams.values())) or len(pool._streams) < 4:
                await asyncio.sleep(0.01)
            ray.kill(cluster.controller, no_restart=False)
            during = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            again = await collect(pool, "while-restarting", prompts[0], PARAMS[0])
            deadline = time.monotonic() + 60
            while True:  # Ray brings it back; it answers once it has rebuilt its view
                try:
                    snap = await asyncio.wait_for(cluster.controller.snapshot.remote(), 5)
                    if all(m["alive"] for m in snap["members"].values()):
                        break
                except Exception:
                    pass
                assert time.monotonic() < deadline, "the controller did not come back"
                await asyncio.sleep(0.2)
            victim = pool.workers["colocated-0"]
            ray.kill(victim.handle)
            deadline = time.monotonic() + 60
            while victim.incarnation == 0 or not victim.alive:  # restarted by the new controller
                assert time.monotonic() < deadline, "the restarted controller did not restart the worker"
                await asyncio.sleep(0.2)
            after = await collect(pool, "after", prompts[1], PARAMS[1])
            return during, again, after
        finally:
            await pool.stop()

    try:
        during, again, after = asyncio.run(main())
        assert during == want and again == want[0] and after == want[1]
        alive_idle(cluster, set())
    finally:
        cluster.stop()
