"""Abort, timeout and finish racing each other and the worker's own end, 1000 times: afterwards
no request is tracked anywhere, every KV block is free, and the deployment serves as before."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

from baton_serve.cluster.front import PoolClient
from baton_serve.cluster.launcher import Cluster
from baton_serve.workers import SamplingParams

from tests.faults.scenario import alive_idle, collect, config

RACES = int(__import__("os").environ.get("BATON_RACES", "1000"))


def test_abort_timeout_finish_races_leave_nothing_behind(ray_session, tiny_model_dir, reference):
    prompts, want = reference
    cluster = Cluster(config(tiny_model_dir, prefill=1, decode=1))
    cluster.start()
    rng = random.Random("races-2026")
    seen_kind: dict[str, str] = {}
    kinds = {"abort": 0, "timeout": 0, "finish": 0, "close": 0, "complete": 0}

    async def main():
        pool = PoolClient(cluster.workers, cluster.limits)
        await pool.start(stats_interval_s=0.2)

        async def one(i: int) -> None:
            kind = rng.choice(["abort", "timeout", "finish", "close", "complete"])
            kinds[kind] += 1
            rid = f"race-{i}"
            seen_kind[rid] = kind
            params = SamplingParams(temperature=rng.choice([0.0, 1.0]), seed=i, max_tokens=rng.randint(1, 12),
                                    ignore_eos=True, n=rng.choice([1, 1, 2]))
            at = rng.randint(0, 6)  # deltas before the racing call
            gen = pool.generate(rid, prompts[i % len(prompts)], params)
            seen = 0

            async def consume() -> None:
                nonlocal seen
                async for d in gen:
                    seen += 1
                    if seen == at:
                        if kind == "abort":
                            pool.abort(rid)
                        elif kind == "finish":
                            pool.finish_sample(rid, d.index, "stop-string")
                        elif kind == "close":
                            return  # the caller walks away: the generator is closed below

            try:
                if kind == "timeout":
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(consume(), rng.uniform(0.0, 0.05))
                else:
                    await consume()
            finally:
                await gen.aclose()

        sem = asyncio.Semaphore(16)

        async def bounded(i: int) -> None:
            async with sem:
                await one(i)

        try:
            tasks = [asyncio.create_task(bounded(i)) for i in range(RACES)]
            done, pending = await asyncio.wait(tasks, timeout=300)
            assert not pending, f"{len(pending)} races never ended: " + ", ".join(
                f"{rid} {seen_kind[rid]} {pool._streams[rid]}" for rid in sorted(pool._streams)[:4])
            for t in done:
                t.result()  # none raised
            assert not pool._streams and not pool._by_wire
            after = await collect(pool, "after", prompts[0], SamplingParams(temperature=0, max_tokens=40,
                                                                            ignore_eos=True))
        finally:
            await pool.stop()
        return after

    try:
        after = asyncio.run(main())
        assert after == want[0]
        alive_idle(cluster, set(), tracked=False)  # no block held, nothing running or waiting
        assert all(kinds.values()), kinds  # every kind of race ran
        # Once about one race in a thousand left a decode worker tracking a sample whose abort
        # landed between the connector's check and its registration (Worker.register).
        assert not _tracked(cluster), "requests still tracked after the races"
    finally:
        cluster.stop()


def _tracked(cluster: Cluster, timeout_s: float = 15.0) -> dict[str, dict]:
    """Requests each worker still tracks for a front, once that settles (empty: none)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        left = {w.worker_id: ray.get(w.handle.__ray_call__.remote(
                    lambda self: {k: sorted(v[1]) for k, v in self._owner.items()}))
                for w in cluster.workers}
        left = {k: v for k, v in left.items() if v}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)
