"""A worker dies under a batch of streams: each continues on a healthy worker from exactly the
token after the last one its caller got (request migration), or ends with a clear error.

Each scenario kills at a moment drawn from a seeded generator (printed, so a failure can be
rerun), then checks: the streams equal an undisturbed run's (greedy and seeded samples, n > 1
too), the surviving workers' KV blocks all come back, and the deployment serves afterwards.
"""

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
from baton_serve.workers import SamplingParams
from baton_serve.workers.errors import WorkerLostError

from tests.faults.scenario import PARAMS, alive_idle, collect, config

held: list[int] = []  # how many streams the last kill's victim held when it died


async def _batch_with_kill(pool: PoolClient, prompts, victim_of, kill_after: int, params=PARAMS):
    """Run every stream (``params[i]`` for prompt ``i``); once each has ``kill_after`` tokens, kill
    the worker ``victim_of(pool)`` names. Returns the tokens per stream per sample and the killed
    worker's id."""
    reached = asyncio.Semaphore(0)
    killed: list[str] = []
    del held[:]

    async def one(i):
        toks: dict[int, list[int]] = {}
        told = False
        async for d in pool.generate(f"s{i}", prompts[i], params[i]):
            toks.setdefault(d.index, []).extend(d.token_ids)
            if not told and min(len(t) for t in toks.values()) >= kill_after and len(toks) == params[i].n:
                told = True
                reached.release()
        return toks

    tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
    try:
        for _ in prompts:
            await asyncio.wait_for(reached.acquire(), 120)
        victim = victim_of(pool)
        killed.append(victim.worker_id)
        held.append(sum(victim.worker_id in s.workers for s in pool._streams.values()))
        # SIGKILL lands at once; ray.kill goes through the GCS, and on a loaded machine the streams
        # could all finish before it took effect.
        os.kill(victim.info["pid"], signal.SIGKILL)
        got = await asyncio.wait_for(asyncio.gather(*tasks), 180)
    finally:
        for t in tasks:
            t.cancel()
    return got, killed[0]


def _busiest(role: str):
    """The worker of ``role`` that holds the most streams right now."""
    def pick(pool: PoolClient):
        counts: dict[str, int] = {}
        for stream in pool._streams.values():
            for wid in stream.workers:
                if pool.workers[wid].role == role:
                    counts[wid] = counts.get(wid, 0) + 1
        return pool.workers[max(counts, key=counts.get)]
    return pick


SCENARIOS = {
    # name: pools, the role killed, how many tokens each stream has first (drawn, seeded)
    "colocated mid-stream": (dict(colocated=2), "colocated"),
    "decode mid-stream": (dict(prefill=1, decode=2), "decode"),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_worker_killed_mid_stream_streams_continue_identically(ray_session, tiny_model_dir, reference, scenario):
    pools, role = SCENARIOS[scenario]
    kill_after = random.Random(f"{scenario}-2026").randint(2, 24)
    print(f"{scenario}: killing the busiest {role} worker once every stream has {kill_after} tokens")
    prompts, want = reference
    cluster = Cluster(config(tiny_model_dir, **pools))
    cluster.start()

    async def main():
        pool = PoolClient(cluster.workers, cluster.limits, policy=make_policy("round_robin"))
        await pool.start(stats_interval_s=0.2)
        try:
            got, dead = await _batch_with_kill(pool, prompts, _busiest(role), kill_after)
            # Served afterwards, by the survivors.
            after = [d async for d in pool.generate("after", prompts[0], PARAMS[0])]
            return got, dead, after, pool.migrations_total
        finally:
            await pool.stop()

    try:
        got, dead, after, migrations = asyncio.run(main())
        assert got == want  # every sample of every stream: no token repeated, skipped or changed
        assert migrations >= 1
        assert [t for d in after for t in d.token_ids] == want[0][0]
        alive_idle(cluster, {dead})
    finally:
        cluster.stop()


def test_prefill_killed_before_the_first_token_is_re_prefilled(ray_session, tiny_model_dir, reference):
    """Two prefill workers, round robin; prefill-0 is stopped (SIGSTOP) before the batch, so the
    prompts sent to it wait there unprefilled, then killed: they run on prefill-1."""
    prompts, want = reference
    cluster = Cluster(config(tiny_model_dir, prefill=2, decode=1))
    cluster.start()
    victim = next(w for w in cluster.workers if w.worker_id == "prefill-0")

    async def main():
        pool = PoolClient(cluster.workers, cluster.limits, policy=make_policy("round_robin"))
        await pool.start(stats_interval_s=0.2)
        try:
            os.kill(victim.info["pid"], signal.SIGSTOP)
            tasks = [asyncio.create_task(collect(pool, f"p{i}", prompts[i], PARAMS[i])) for i in range(4)]
            await asyncio.sleep(1.0)
            stuck = [s for s in pool._streams.values() if "prefill-0" in s.workers]
            assert stuck and all(not s.emitted for s in stuck)  # no first token came from it
            os.kill(victim.info["pid"], signal.SIGKILL)
            got = await asyncio.wait_for(asyncio.gather(*tasks), 180)
            return got, pool.migrations_total
        finally:
            await pool.stop()

    try:
        got, migrations = asyncio.run(main())
        assert got == want and migrations >= 1
        alive_idle(cluster, {"prefill-0"})
    finally:
        cluster.stop()


def test_migrations_run_out_with_a_clear_error_and_nothing_held(ray_session, tiny_model_dir):
    """1 prefill + 1 decode, the decode worker killed, nobody to take over within the wait: the
    stream ends with WorkerLostError (HTTP 503), the prefill worker keeps nothing."""
    cfg = config(tiny_model_dir, prefill=1, decode=1)
    # nobody to take over: the controller does not start the worker again either
    cfg.recovery.restart_workers = False
    cluster = Cluster(cfg)
    cluster.start()
    decode = next(w for w in cluster.workers if w.role == "decode")

    async def main():
        pool = PoolClient(cluster.workers, cluster.limits, policy=make_policy("cost", conditional_disaggregation=False),
                          migration_wait_s=1.0)
        await pool.start(stats_interval_s=0.2)
        got, killed = 0, []
        started = time.monotonic()
        try:
            with pytest.raises(WorkerLostError, match="no healthy worker"):
                async for d in pool.generate("doomed", [5, 6, 7, 8, 9], SamplingParams(
                        temperature=0, max_tokens=400, ignore_eos=True)):
                    got += len(d.token_ids)
                    if got >= 3 and not killed:
                        killed.append(decode.worker_id)
                        # SIGKILL lands at once; ray.kill goes through the GCS, and on a loaded
                        # machine the worker could finish all its tokens before it took effect.
                        os.kill(decode.info["pid"], signal.SIGKILL)
            assert time.monotonic() - started < 30  # bounded by the wait, never a hang
        finally:
            await pool.stop()

    try:
        asyncio.run(main())
        alive_idle(cluster, {"decode-0"})
    finally:
        cluster.stop()


@pytest.mark.parametrize("pools,role", [(dict(colocated=1), "colocated"), (dict(prefill=1, decode=1), "decode")],
                         ids=["sole colocated", "sole decode"])
def test_sole_worker_killed_is_restarted_and_its_streams_finish(ray_session, tiny_model_dir, reference, pools, role):
    """No other worker of the role: the controller starts a new one under the same id, the front
    adopts it, and the streams waiting to migrate finish on it exactly as undisturbed."""
    from baton_serve.cluster.metrics import Metrics

    prompts, want = reference
    kill_after = random.Random(f"restart-{role}-2026").randint(2, 20)
    print(f"killing {role}-0 once every stream has {kill_after} tokens")
    cluster = Cluster(config(tiny_model_dir, **pools))
    cluster.start()
    metrics = Metrics("tiny")

    async def main():
        pool = PoolClient(cluster.workers, cluster.limits, controller=cluster.controller, metrics=metrics,
                          policy=make_policy("cost", conditional_disaggregation=False))
        await pool.start(stats_interval_s=0.2)
        try:
            got, dead = await _batch_with_kill(pool, prompts, _busiest(role), kill_after)
            after = [d async for d in pool.generate("after", prompts[0], PARAMS[0])]
            return got, dead, after, pool.workers[dead].incarnation, pool.status()
        finally:
            await pool.stop()

    try:
        got, dead, after, incarnation, status = asyncio.run(main())
        assert got == want
        row = next(w for w in status["workers"] if w["worker_id"] == dead)  # what /status and baton status show
        assert (row["alive"], row["restarts"], row["quarantined"], row["incarnation"]) == (True, 1, False, incarnation)
        assert status["ready"] and status["migrations_total"] == held[0] >= 1
        assert [t for d in after for t in d.token_ids] == want[0][0]
        assert incarnation > 0  # a new actor, adopted
        assert metrics.registry.get_sample_value("baton:worker_restarts_total", {"role": role}) == 1
        assert metrics.registry.get_sample_value("baton:request_migrations_total", {"role": role}) == held[0] >= 1
        alive_idle(cluster, set())
    finally:
        cluster.stop()
