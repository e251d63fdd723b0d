"""Prefill and decode pools of real Ray actors: KV shipped over gloo or copied out of the prefill
worker's shared cache, tokens streamed back."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import pytest
from baton_serve.cluster.config import ClusterConfig
from baton_serve.cluster.front import PoolClient
from baton_serve.cluster.launcher import Cluster
from baton_serve.router.routing import make_policy
from baton_serve.workers import LLM, SamplingParams

NUM_BLOCKS = 64


def _hop():
    """The default policy, never prefilling on a decode worker: these tests pin the KV hop."""
    return make_policy("cost", conditional_disaggregation=False)


def _config(model_dir, engine: dict | None = None, transport: str = "auto", **pools) -> ClusterConfig:
    return ClusterConfig.model_validate({
        "engine": {"model": str(model_dir), "dtype": "float32", "block_size": 8, "num_kv_blocks": NUM_BLOCKS,
                   **(engine or {})},
        "pools": pools, "kv_transfer": {"timeout_s": 10, "transport": transport},
    })


# The pools take turns at the cores (the core-share board), as they do wherever workers'
# threads outnumber the machine's cores; every disaggregated test below runs through it, with
# 2 threads per worker so that on a 2-core machine the two pools really alternate.
SHARE = {"openmp_wait": "share", "threads_per_worker": 2}


# collective: gloo pair groups; auto: on one machine, decode copies out of prefill's mapped cache
TRANSPORTS = ["collective", "auto"]


@pytest.fixture(scope="module", params=TRANSPORTS)
def disagg(request, ray_session, tiny_model_dir):
    cluster = Cluster(_config(tiny_model_dir, SHARE, request.param, prefill=1, decode=1))
    cluster.start()
    board = cluster._board
    assert board is not None and board.exists()
    assert len(list(board.parent.glob(board.name + ".bell*"))) == 2  # one per worker
    yield cluster
    cluster.stop()
    assert not list(board.parent.glob(board.name + "*"))  # the board and its bells


async def _stream(pool: PoolClient, rid: str, prompt, params):
    toks: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    async for d in pool.generate(rid, prompt, params):
        toks.setdefault(d.index, []).extend(d.token_ids)
        if d.finish_reason:
            reasons[d.index] = d.finish_reason
    return toks, reasons


def _run(cluster: Cluster, jobs, streamed: bool = True):
    """Run ``jobs`` through a fresh front. streamed=False: the workers look as if they had no
    output stream, so the front polls them over Ray."""
    async def main():
        workers = cluster.workers if streamed else [
            dataclasses.replace(w, info={k: v for k, v in w.info.items() if k != "output_address"})
            for w in cluster.workers]
        pool = PoolClient(workers, cluster.limits, policy=_hop())
        await pool.start(stats_interval_s=0.2)
        fronts = await asyncio.gather(*(w.handle.stats.remote() for w in cluster.workers))
        # every worker pushes this front's outputs down its socket, or none does
        assert all((pool.front_id in s["output_fronts"]) == streamed for s in fronts)
        try:
            return await asyncio.gather(*(_stream(pool, *job) for job in jobs))
        finally:
            await pool.stop()
    return asyncio.run(main())


def _settled(cluster: Cluster, done, timeout_s: float = 10.0) -> dict:
    """Every worker's stats once ``done(stats)`` holds for all of them, or the last read at the
    timeout (work a front aborted ends within a few steps, not at once)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = _worker_stats(cluster)
        if all(done(s) for s in stats.values()) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def _worker_stats(cluster: Cluster):
    import ray

    return {w.worker_id: ray.get(w.handle.stats.remote()) for w in cluster.workers}


def test_disaggregated_greedy_equals_offline_engine(disagg, tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS)
    prompts = [llm.tokenizer.encode(t) for t in ("Hello world! How are you today?", "你好，世界！",
                                                 "def add(a, b):\n    return a + b", "The")]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    results = _run(disagg, [(f"r{i}", p, params) for i, p in enumerate(prompts)])
    offline = llm.generate(prompts, params)
    for (toks, reasons), out in zip(results, offline):
        assert toks[0] == out.outputs[0].token_ids
        assert reasons[0] == "length"
    stats = _worker_stats(disagg)
    assert all(s["num_free_blocks"] == NUM_BLOCKS for s in stats.values())
    assert all(s["tracked_requests"] == 0 for s in stats.values())  # no per-request state left behind
    # alike workers say so: routers fit their steps together
    assert stats["prefill-0"]["extra"]["hardware"] == stats["decode-0"]["extra"]["hardware"]
    assert stats["decode-0"]["extra"]["hardware"].startswith("cpu:")
    # both sides count the KV moved, whichever side moved it
    assert stats["decode-0"]["extra"]["kv_transfer"]["bytes"] == stats["prefill-0"]["extra"]["kv_transfer"]["bytes"] > 0
    if disagg.config.kv_transfer.transport == "collective":
        assert stats["prefill-0"]["pair_groups"] == 1  # the gloo pair, created on first use
        assert stats["decode-0"]["mapped_peer_caches"] == 0
    else:  # same machine: no collective group at all, decode mapped prefill's cache
        assert stats["prefill-0"]["pair_groups"] == 0 and stats["decode-0"]["pair_groups"] == 0
        assert stats["decode-0"]["mapped_peer_caches"] == 1


def test_n_samples_and_seeds_across_the_hop(disagg, tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS)
    prompt = llm.tokenizer.encode("Paris is the capital of France.")
    params = SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=8, ignore_eos=True)
    [(toks, _)] = _run(disagg, [("seeded", prompt, params)])
    offline = llm.generate([prompt], params)[0]
    assert [toks[0], toks[1]] == [c.token_ids for c in offline.outputs]


def test_a_grammar_survives_the_hop(disagg, tiny_model_dir):
    """A constrained request prefilled on one worker and decoded on another follows its grammar
    there too (the matcher is rebuilt from the emitted tokens): the same tokens as the offline
    engine, greedy and seeded, and the text matches."""
    import re

    from baton_serve.workers.sampling.structured import StructuredSpec

    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS)
    prompt = llm.tokenizer.encode("Hello world")
    pattern = "[a-z]{3,6}-[0-9]{2,4}"
    regex = StructuredSpec.regex(pattern).to_dict()
    params = [SamplingParams(temperature=0, max_tokens=30, structured_outputs=regex),
              SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=30, structured_outputs=regex)]
    results = _run(disagg, [(f"g{i}", prompt, p) for i, p in enumerate(params)])
    offline = llm.generate([prompt, prompt], params)
    for (toks, reasons), out in zip(results, offline):
        assert [toks[i] for i in sorted(toks)] == [c.token_ids for c in out.outputs]
        for c in out.outputs:
            assert re.fullmatch(pattern, c.text), c.text
        assert set(reasons.values()) == {"stop"}


def test_32_streams_then_cancel_half_returns_every_block(disagg, tiny_model_dir):
    llm_tok = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=8).tokenizer
    prompt = llm_tok.encode("The quick brown fox jumps over the lazy dog")

    async def main():
        pool = PoolClient(disagg.workers, disagg.limits, policy=_hop())
        await pool.start(stats_interval_s=0.2)

        async def one(i: int) -> int:
            got = 0
            agen = pool.generate(f"c{i}", prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
            async for d in agen:
                got += len(d.token_ids)
                if i % 2 and got >= 3:
                    break
            await agen.aclose()
            return got

        try:
            counts = await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await pool.stop()
        return counts

    counts = asyncio.run(main())
    assert all(c == 40 for c in counts[0::2])
    assert all(3 <= c < 40 for c in counts[1::2])
    stats = _settled(disagg, lambda s: s["num_free_blocks"] == NUM_BLOCKS and s["num_running"] == 0)
    assert all(s["num_free_blocks"] == NUM_BLOCKS for s in stats.values()), stats
    assert all(s["num_running"] == 0 and s["num_waiting"] == 0 for s in stats.values()), stats


def test_a_front_that_goes_away_without_aborting_frees_its_requests(disagg, tiny_model_dir):
    """A front process that dies sends no aborts; its output streams close, and the workers abort
    what it had sent them rather than generate for nobody and hold the blocks."""
    prompt = LLM(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=8).tokenizer.encode("Once upon a time")
    long = SamplingParams(temperature=0, max_tokens=disagg.limits.max_model_len - len(prompt) - 1, ignore_eos=True)

    async def main():
        pool = PoolClient(disagg.workers, disagg.limits, policy=_hop())
        pool._abort_on_workers = lambda *a, **k: None  # it dies: no abort reaches any worker
        await pool.start(stats_interval_s=0.2)
        streams = [pool.generate(f"orphan{i}", prompt, long) for i in range(4)]
        for agen in streams:  # every request is decoding
            await agen.__anext__()
            await agen.__anext__()
        for task in pool._tasks:
            task.cancel()
        for writer in pool.links._writers:
            writer.transport.abort()  # as when its process is killed
        for agen in streams:
            await agen.aclose()

    computed = _worker_stats(disagg)["decode-0"]["num_decode_tokens_computed"]
    asyncio.run(main())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stats = _worker_stats(disagg)
        if all(s["num_free_blocks"] == NUM_BLOCKS and s["num_running"] == s["tracked_requests"] == 0
               for s in stats.values()):
            break
        time.sleep(0.2)
    assert all(s["num_free_blocks"] == NUM_BLOCKS for s in stats.values()), stats
    assert all(s["num_running"] == s["num_waiting"] == s["tracked_requests"] == 0 for s in stats.values()), stats
    # stopped within a few steps, not run to the end for nobody (4 x max_tokens)
    assert stats["decode-0"]["num_decode_tokens_computed"] - computed < long.max_tokens


def test_a_request_id_is_refused_twice_at_once_and_reusable_right_after_an_abort(disagg, tiny_model_dir):
    """Each attempt reaches the workers under its own id: the abort of the first (which may land
    late) and the workers' memory of aborted ids never touch a second request that reuses the id."""
    from baton_serve.workers.errors import InvalidRequestError

    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS)
    prompt = llm.tokenizer.encode("Hello world")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = llm.generate([prompt], params)[0].outputs[0].token_ids

    async def main():
        pool = PoolClient(disagg.workers, disagg.limits, policy=_hop())
        await pool.start(stats_interval_s=0.2)
        try:
            first = pool.generate("again", prompt, params)
            assert (await first.__anext__()).request_id == "again"  # callers see their own id
            with pytest.raises(InvalidRequestError, match="already in use"):
                await pool.generate("again", prompt, params).__anext__()
            await first.aclose()  # aborts it on the workers
            toks: list[int] = []
            async for d in pool.generate("again", prompt, params):
                toks += d.token_ids
            return toks
        finally:
            await pool.stop()

    assert asyncio.run(asyncio.wait_for(main(), 60)) == expected
    stats = _settled(disagg, lambda s: s["num_free_blocks"] == NUM_BLOCKS and s["tracked_requests"] == 0)
    assert all(s["num_free_blocks"] == NUM_BLOCKS and s["tracked_requests"] == 0 for s in stats.values()), stats


def test_colocated_mode_matches(ray_session, tiny_model_dir):
    cluster = Cluster(_config(tiny_model_dir, colocated=1))
    cluster.start()
    try:
        llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS)
        prompt = llm.tokenizer.encode("Hello world")
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        want = llm.generate([prompt], params)[0].outputs[0].token_ids
        [(toks, _)] = _run(cluster, [("co", prompt, params)])
        assert toks[0] == want
        [(toks, _)] = _run(cluster, [("polled", prompt, params)], streamed=False)  # no socket: Ray polls
        assert toks[0] == want
    finally:
        cluster.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_decode_worker_death_fails_streams_cleanly(ray_session, tiny_model_dir, transport):
    """Kill the decode actor mid-stream with migration off: the stream errors out, the prefill
    worker keeps no KV, and new requests are refused (no live decode worker) instead of hanging."""
    import ray
    from baton_serve.workers.errors import OverloadedError, WorkerLostError

    cluster = Cluster(_config(tiny_model_dir, SHARE, transport, prefill=1, decode=1))
    cluster.start()
    prefill = next(w for w in cluster.workers if w.role == "prefill")
    decode = next(w for w in cluster.workers if w.role == "decode")

    async def main():
        pool = PoolClient(cluster.workers, cluster.limits, policy=_hop(), max_migrations=0)
        await pool.start(stats_interval_s=0.2)
        got = 0
        try:
            with pytest.raises(WorkerLostError, match="failed"):
                async for d in pool.generate("doomed", [5, 6, 7, 8, 9], SamplingParams(
                        temperature=0, max_tokens=400, ignore_eos=True)):
                    got += len(d.token_ids)
                    if got == 3:  # SIGKILL lands at once; ray.kill goes through the GCS, and on a
                        # loaded machine the stream could end before it did
                        os.kill(decode.info["pid"], signal.SIGKILL)
            with pytest.raises(OverloadedError):
                async for _ in pool.generate("after", [5, 6], SamplingParams(max_tokens=2)):
                    pass
        finally:
            await pool.stop()
        return got

    try:
        assert asyncio.run(main()) >= 3
        stats = ray.get(prefill.handle.stats.remote())
        assert stats["num_free_blocks"] == NUM_BLOCKS and stats["num_running"] == 0
    finally:
        cluster.stop()


def test_prefill_worker_death_spares_streams_already_decoding(ray_session, tiny_model_dir):
    """Kill the prefill actor once every stream decodes on the decode worker: the streams finish
    exactly as the offline engine's (the front dropped the prefill worker from them at the
    handoff), and new requests are refused rather than hang."""
    import ray
    from baton_serve.workers.errors import OverloadedError

    cluster = Cluster(_config(tiny_model_dir, SHARE, "auto", prefill=1, decode=1))
    cluster.start()
    prefill = next(w for w in cluster.workers if w.role == "prefill")
    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS)
    prompts = [llm.tokenizer.encode(t) for t in ("Hello world", "The sky is", "One two three", "Paris")]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def main():
        pool = PoolClient(cluster.workers, cluster.limits, policy=_hop())
        await pool.start(stats_interval_s=0.2)
        decoding = asyncio.Semaphore(0)

        async def one(i, prompt):
            toks = []
            async for d in pool.generate(f"s{i}", prompt, params):
                toks.extend(d.token_ids)
                if len(toks) - len(d.token_ids) < 3 <= len(toks):
                    decoding.release()  # past the first token: this one decodes on decode-0
            return toks

        tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
        try:
            for _ in prompts:
                await asyncio.wait_for(decoding.acquire(), 60)
            ray.kill(prefill.handle)
            done = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            with pytest.raises(OverloadedError):  # noticed dead (socket EOF) before the next request
                await asyncio.sleep(1.0)
                async for _ in pool.generate("after", [5, 6], SamplingParams(max_tokens=2)):
                    pass
            return done
        finally:
            for t in tasks:
                t.cancel()
            await pool.stop()

    try:
        got = asyncio.run(main())
        assert got == [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        decode = next(w for w in cluster.workers if w.role == "decode")
        deadline = time.monotonic() + 10
        while (stats := ray.get(decode.handle.stats.remote()))["num_free_blocks"] != NUM_BLOCKS:
            assert time.monotonic() < deadline, stats
            time.sleep(0.2)
        assert stats["num_running"] == 0
    finally:
        cluster.stop()


def test_slow_reader_pauses_generation_then_resumes_exactly(disagg, tiny_model_dir):
    import time

    import ray

    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS)
    prompt = llm.tokenizer.encode("Hello world")
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    expected = llm.generate([prompt], params)[0].outputs[0].token_ids
    decode = next(w for w in disagg.workers if w.role == "decode")

    async def main():
        pool = PoolClient(disagg.workers, disagg.limits, policy=_hop())
        pool.high_water, pool.low_water = 8, 2
        await pool.start(stats_interval_s=0.2)
        toks: list[int] = []
        paused_seen = False
        try:
            agen = pool.generate("slow", prompt, params)
            toks += (await agen.__anext__()).token_ids
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not paused_seen:  # the reader stalls
                await asyncio.sleep(0.1)
                paused_seen = (await decode.handle.stats.remote())["num_paused"] == 1
            async for d in agen:
                toks += d.token_ids
        finally:
            await pool.stop()
        return toks, paused_seen

    toks, paused_seen = asyncio.run(main())
    assert paused_seen
    assert toks == expected
    stats = ray.get(decode.handle.stats.remote())
    assert stats["num_paused"] == 0 and stats["num_free_blocks"] == NUM_BLOCKS


def test_object_store_transport(ray_session, tiny_model_dir):
    config = _config(tiny_model_dir, prefill=1, decode=1).with_overrides(**{"kv_transfer.transport": "object_store"})
    cluster = Cluster(config)
    cluster.start()
    try:
        llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS)
        prompts = [llm.tokenizer.encode(t) for t in ("Hello world! How are you today?", "你好")]
        params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
        results = _run(cluster, [(f"o{i}", p, params) for i, p in enumerate(prompts)])
        for (toks, _), out in zip(results, llm.generate(prompts, params)):
            assert toks[0] == out.outputs[0].token_ids
        stats = _worker_stats(cluster)
        assert all(s["num_free_blocks"] == NUM_BLOCKS for s in stats.values())
        assert stats["prefill-0"]["pair_groups"] == 0 and stats["decode-0"]["extra"]["kv_transfer"]["bytes"] > 0
    finally:
        cluster.stop()


def test_a_worker_that_fails_to_start_leaves_nothing_behind(ray_session, tmp_path):
    """A model that is not there: start raises, and no actor or core-share board outlives it."""
    import glob

    import ray

    def alive_workers() -> set[str]:
        actors = ray._private.state.actors().values()  # from the GCS: no dashboard needed
        return {a["ActorID"] for a in actors if a["State"] == "ALIVE" and a["ActorClassName"] == "Worker"}

    boards_before, workers_before = set(glob.glob("/dev/shm/baton-cores-*")), alive_workers()
    cluster = Cluster(_config(tmp_path / "no-such-model", SHARE, prefill=1, decode=1))
    with pytest.raises(ray.exceptions.RayActorError, match="no-such-model"):
        cluster.start()
    assert cluster.workers == [] and cluster._board is None
    assert set(glob.glob("/dev/shm/baton-cores-*")) == boards_before
    assert alive_workers() <= workers_before  # other tests' deployments may still be up
