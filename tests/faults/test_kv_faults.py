"""Faults on the KV path between a prefill and a decode worker: corrupted bytes, a peer that
hangs mid-transfer, a prefill worker that dies after shipping. Each ends with every stream equal
to an undisturbed run and no block held on any surviving worker."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest
from baton_serve.cluster.front import PoolClient
from baton_serve.cluster.launcher import Cluster
from baton_serve.router.routing import make_policy

from tests.faults.scenario import PARAMS, alive_idle, collect, config


def _hop():
    return make_policy("cost", conditional_disaggregation=False)


@pytest.mark.parametrize("transport", ["collective", "auto"])
def test_corrupted_kv_is_caught_and_the_request_re_prefilled(ray_session, tiny_model_dir, reference, transport):
    """The decode worker's first two received shipments get a flipped byte before their checksum
    is checked: those requests are re-prefilled, none decodes from bad KV."""
    import ray

    prompts, want = reference
    cluster = Cluster(config(tiny_model_dir, prefill=1, decode=1))
    cluster.config.kv_transfer.transport = transport
    cluster.start()
    decode = next(w for w in cluster.workers if w.role == "decode")
    ray.get(decode.handle.arm_fault.remote("corrupt_received_kv", 2))

    async def main():
        pool = PoolClient(cluster.workers, cluster.limits, policy=_hop())
        await pool.start(stats_interval_s=0.2)
        try:
            got = await asyncio.wait_for(asyncio.gather(*(
                collect(pool, f"c{i}", prompts[i], PARAMS[i]) for i in range(len(prompts)))), 120)
            return got, pool.migrations_total
        finally:
            await pool.stop()

    try:
        got, migrations = asyncio.run(main())
        assert got == want
        # The two corrupted shipments were placed again: two requests, or one (both samples of n = 2).
        assert 1 <= migrations <= 2
        alive_idle(cluster, set())
    finally:
        cluster.stop()


def test_decode_worker_hung_mid_transfer_is_replaced(ray_session, tiny_model_dir, reference):
    """The decode worker is paused (SIGSTOP) as the requests reach it: shipments to it time out,
    the controller's health checks declare it dead and restart it, and every stream finishes on
    the new decode worker exactly as undisturbed, in bounded time."""
    prompts, want = reference
    cfg = config(tiny_model_dir, prefill=1, decode=1)
    cfg.kv_transfer.timeout_s = 4
    cluster = Cluster(cfg)
    cluster.start()
    decode = next(w for w in cluster.workers if w.role == "decode")

    async def main():
        pool = PoolClient(cluster.workers, cluster.limits, controller=cluster.controller, policy=_hop())
        await pool.start(stats_interval_s=0.2)
        try:
            os.kill(decode.info["pid"], signal.SIGSTOP)
            started = time.monotonic()
            got = await asyncio.wait_for(asyncio.gather(*(
                collect(pool, f"h{i}", prompts[i], PARAMS[i]) for i in range(len(prompts)))), 120)
            return got, time.monotonic() - started, pool.workers[decode.worker_id].incarnation
        finally:
            await pool.stop()

    try:
        got, seconds, incarnation = asyncio.run(main())
        print(f"hung decode worker: streams done {seconds:.1f}s after the pause")
        assert got == want and incarnation > 0
        alive_idle(cluster, set())
    finally:
        cluster.stop()


def test_prefill_killed_mid_transfer_frees_the_reservation_and_re_prefills(ray_session, tiny_model_dir, reference):
    """Prefill-0 stalls between the decode worker's reservation and the data (a fault point) and
    is killed there: the decode worker's receive fails and frees the blocks it reserved, and the
    streams re-prefill on prefill-1, each exactly as undisturbed."""
    import ray

    prompts, want = reference
    cfg = config(tiny_model_dir, prefill=2, decode=1)
    cfg.kv_transfer.transport = "collective"
    cluster = Cluster(cfg)
    cluster.start()
    victim = next(w for w in cluster.workers if w.worker_id == "prefill-0")
    decode = next(w for w in cluster.workers if w.role == "decode")
    ray.get(victim.handle.arm_fault.remote("stall_kv_send", 100))

    async def main():
        pool = PoolClient(cluster.workers, cluster.limits, controller=cluster.controller,
                          policy=make_policy("round_robin"))
        await pool.start(stats_interval_s=0.2)
        try:
            tasks = [asyncio.create_task(collect(pool, f"t{i}", prompts[i], PARAMS[i])) for i in range(len(prompts))]
            deadline = time.monotonic() + 60
            while not ray.get(decode.handle.__ray_call__.remote(lambda self: len(self.core.incoming))):
                assert time.monotonic() < deadline, "no transfer from prefill-0 reached its reservation"
                await asyncio.sleep(0.05)
            on_victim = sum("prefill-0" in s.workers for s in pool._streams.values())
            ray.kill(victim.handle)
            got = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            return got, on_victim
        finally:
            await pool.stop()

    try:
        got, on_victim = asyncio.run(main())
        assert on_victim >= 1 and got == want
        alive_idle(cluster, {"prefill-0"})  # the decode worker's reservation is free again
    finally:
        cluster.stop()


def test_prefill_killed_right_after_shipping_spares_the_streams(ray_session, tiny_model_dir, reference):
    """Kill the prefill worker the moment each stream has its first decode-side token: nothing
    happens to the streams (the front dropped the prefill worker at the handoff), the
    controller restarts it, and new requests are served."""
    import ray

    prompts, want = reference
    cluster = Cluster(config(tiny_model_dir, prefill=1, decode=1))
    cluster.start()
    prefill = next(w for w in cluster.workers if w.role == "prefill")
    kill_after = random.Random("after-handoff-2026").randint(2, 6)

    async def main():
        pool = PoolClient(cluster.workers, cluster.limits, controller=cluster.controller, policy=_hop())
        await pool.start(stats_interval_s=0.2)
        handed = asyncio.Semaphore(0)

        async def one(i):
            toks: dict[int, list[int]] = {}
            told = False
            async for d in pool.generate(f"a{i}", prompts[i], PARAMS[i]):
                toks.setdefault(d.index, []).extend(d.token_ids)
                s = pool._streams.get(f"a{i}")
                if not told and s is not None and s.prefill_id is None and min(map(len, toks.values())) >= kill_after:
                    told = True
                    handed.release()
            return toks

        tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
        try:
            for _ in prompts:
                await asyncio.wait_for(handed.acquire(), 60)
            ray.kill(prefill.handle)
            got = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            migrations = pool.migrations_total
            deadline = time.monotonic() + 60
            back = pool.workers[prefill.worker_id]
            while back.incarnation == 0 or not back.alive:  # adopted: new handle first, alive once listened to
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)
            after = await collect(pool, "after", prompts[0], PARAMS[0])
            return got, migrations, after
        finally:
            for t in tasks:
                t.cancel()
            await pool.stop()

    try:
        got, migrations, after = asyncio.run(main())
        assert got == want and migrations == 0 and after == want[0]
        alive_idle(cluster, set())
    finally:
        cluster.stop()
