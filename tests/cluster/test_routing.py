"""Cache-aware routing over four real workers of the tiny model: requests sharing a system prompt
land on the worker that holds it, under ``cost`` and ``prefix``, the index fed by the workers' KV
events, and the cached tokens the workers report agree with what the router expected."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from baton_serve.cluster.config import ClusterConfig
from baton_serve.cluster.front import PoolClient
from baton_serve.cluster.launcher import Cluster
from baton_serve.cluster.metrics import Metrics
from baton_serve.router.routing import Candidates, Decision, RouteRequest, RoutingPolicy, make_policy
from baton_serve.workers import SamplingParams

BS = 8
NUM_BLOCKS = 96
PREFIX_BLOCKS = 12  # a 96-token system prompt per group
GROUPS = 4


class Recording(RoutingPolicy):
    """Wraps a policy and keeps its decisions, in order."""

    def __init__(self, inner: RoutingPolicy) -> None:
        self.inner, self.name, self.decisions, self.by_length, self.seen = inner, inner.name, [], {}, {}

    def route(self, request: RouteRequest, candidates: Candidates) -> Decision:
        decision = self.inner.route(request, candidates)
        self.decisions.append(decision)
        self.by_length[request.prompt_len] = decision
        self.seen[request.prompt_len] = [  # for the failure message
            (w.worker_id, candidates.matched(w), w.load.pending_prefill, w.load.outstanding,
             f"prefill fit (s, s/token) {w.load.fit('prefill')}", f"decode fit (s, s/seq) {w.load.fit('decode')}")
            for w in candidates.first + candidates.decode]
        return decision


LAYOUTS = {"4 colocated": {"colocated": 4}, "2P+2D": {"prefill": 2, "decode": 2}}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def four_workers(request, ray_session, tiny_model_dir):
    config = ClusterConfig.model_validate({
        "engine": {"model": str(tiny_model_dir), "dtype": "float32", "block_size": BS,
                   "num_kv_blocks": NUM_BLOCKS, "threads_per_worker": 1},
        "pools": LAYOUTS[request.param], "kv_transfer": {"timeout_s": 10},
    })
    cluster = Cluster(config)
    cluster.start()
    yield cluster
    cluster.stop()


def _prompts(vocab: int) -> tuple[list[list[int]], random.Random]:
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, vocab) for _ in range(PREFIX_BLOCKS * BS)] for _ in range(GROUPS)]
    return prefixes, rng


async def _one(pool: PoolClient, rid: str, prompt: list[int]) -> int:
    """Run a request to its end; returns the cached tokens the worker reported."""
    cached = 0
    async for d in pool.generate(rid, prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)):
        cached = max(cached, d.num_cached_tokens)
    return cached


async def _index_holds(pool: PoolClient, worker_id: str, prompt: list[int], salt: str | None = None,
                       timeout_s: float = 20.0) -> None:
    """Wait until the workers' events have told the index that ``worker_id`` holds ``prompt``'s
    system prompt (a prediction made when it was routed does not count: it may have expired)."""
    hashes = pool.router.prompt_hashes(prompt, salt)[:PREFIX_BLOCKS]
    deadline = time.monotonic() + timeout_s
    while True:
        w = pool.router.index._workers.get(worker_id)
        if w is not None and all(h in w.hashes for h in hashes):
            return
        assert time.monotonic() < deadline, f"the index never heard of {worker_id}'s blocks"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("policy", ["cost", "prefix"])
def test_shared_prefixes_land_where_their_blocks_are(four_workers, policy):
    cluster = four_workers
    vocab = cluster.workers[0].info["vocab_size"]
    prefixes, rng = _prompts(vocab)
    salt = f"{policy}-{len(cluster.workers)}"  # a namespace of its own: earlier tests' blocks never match
    metrics = Metrics("tiny")

    async def main():
        recorder = Recording(make_policy(policy, **({"conditional_disaggregation": False}
                                                    if policy == "cost" else {})))
        pool = PoolClient(cluster.workers, cluster.limits, policy=recorder, metrics=metrics,
                          events_interval_s=0.05)
        await pool.start(stats_interval_s=0.2)
        original = pool.generate

        def salted(rid, prompt, params, *a, **kw):
            return original(rid, prompt, params, 0, salt)

        pool.generate = salted  # every request in this test's own cache namespace
        try:
            # Seed: one request per system prompt, all at once (so they spread over the pool), then
            # wait until the index has heard of every holder's blocks.
            seeds = {g: prefix + [rng.randrange(3, vocab) for _ in range(40 + g)] for g, prefix in enumerate(prefixes)}
            await asyncio.gather(*(_one(pool, f"seed-{g}", p) for g, p in seeds.items()))
            holder = {g: recorder.by_length[len(p)].first.worker_id for g, p in seeds.items()}
            for g, p in seeds.items():
                await _index_holds(pool, holder[g], p, salt)
            # Then user turns, one request at a time so that every worker is idle when it is
            # routed: the holder saves the prefill and costs nothing more, so it must win.
            checked = []
            for turn in range(2):
                for g in holder:
                    p = prefixes[g] + [rng.randrange(3, vocab) for _ in range(1 + g + GROUPS * turn)]
                    got = await _one(pool, f"t{turn}-{g}", p)
                    checked.append((g, recorder.by_length[len(p)], got, recorder.seen[len(p)]))
            return holder, checked, recorder.decisions
        finally:
            await pool.stop()

    holder, checked, decisions = asyncio.run(main())
    roles = {"colocated"} if cluster.config.colocated else {"prefill"}
    assert {d.first.role for d in decisions} <= roles
    # every follow-up landed on its group's holder, which the router knew held the whole prefix
    # and which reported exactly that many cached tokens
    for g, decision, cached, seen in checked:
        assert decision.first.worker_id == holder[g], f"group {g}'s turn did not go to {holder[g]}: {seen}"
        assert decision.matched_blocks == PREFIX_BLOCKS
        assert cached == PREFIX_BLOCKS * BS
    follow = decisions[GROUPS:]
    assert {d.reason for d in follow} == {"prefix"}
    body = metrics.registry.get_sample_value("baton:router_decisions_total", {"policy": policy, "reason": "prefix"})
    assert body == len(follow)
    for w in cluster.workers:
        assert metrics.registry.get_sample_value("baton:router_index_stale",
                                                 {"role": w.role, "worker": w.worker_id}) == 0
    if cluster._board is not None:  # four workers take turns at this machine's cores: the router knows it
        boards = {(w.load.core_board, w.load.board_cores) for w in cluster.workers}
        assert len(boards) == 1, boards
        board, cores = boards.pop()
        assert board.endswith(str(cluster._board)) and cores >= 1


def test_a_short_tail_is_prefilled_on_the_decode_worker_that_holds_its_prefix(four_workers, tiny_model_dir):
    """Conditional disaggregation on real workers: with shipping made expensive, a prompt goes to a
    decode worker alone, runs there like a colocated one (same greedy tokens as the offline
    engine), and the next turn on the same system prompt hits that worker's cache."""
    from baton_serve.router.routing.rates import LinearCost
    from baton_serve.workers import LLM

    cluster = four_workers
    if cluster.config.colocated:
        pytest.skip("conditional disaggregation needs a decode pool")
    vocab = cluster.workers[0].info["vocab_size"]
    prefixes, rng = _prompts(vocab)
    prefix = [(t * 7 + 1) % (vocab - 3) + 3 for t in prefixes[0]]  # a system prompt no other test used
    turns = [prefix + [rng.randrange(3, vocab) for _ in range(n)] for n in (2, 5)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    recorder = Recording(make_policy("cost", seed=0))  # its views name every candidate on a failure

    async def main():
        pool = PoolClient(cluster.workers, cluster.limits, policy=recorder, events_interval_s=0.05)
        await pool.start(stats_interval_s=3600)  # the fits below stay as set
        for w in cluster.workers:
            # 0.1 ms a token: the prefix a holder saves (~20 ms) outweighs the noise in the other terms
            w.load.prefill = LinearCost(fixed=0.001, per_unit=1e-4, fitted=True)
            if w.role == "prefill":
                w.load.ship = LinearCost(fixed=1.0, per_unit=0.0, fitted=True)  # a 1 s handoff
        try:
            out = []
            for i, prompt in enumerate(turns):
                toks, cached = [], 0
                async for d in pool.generate(f"local-{i}", prompt, params):
                    toks.extend(d.token_ids)
                    cached = max(cached, d.num_cached_tokens)
                out.append((toks, cached, recorder.decisions[-1]))
                if i == 0:
                    await _index_holds(pool, recorder.decisions[-1].first.worker_id, prompt)
            return out
        finally:
            await pool.stop()

    (toks0, _, first), (toks1, cached1, second) = asyncio.run(main())
    assert first.local and first.first.role == "decode"
    # what earlier tests left in the decode caches decides whether room picked between the two
    # (the new-prefix placement rule); either way the prompt stays on a decode worker
    assert first.reason in ("local_prefill", "cache_room"), recorder.seen[len(turns[0])]
    assert second.local and second.first.worker_id == first.first.worker_id  # the holder
    assert second.matched_blocks == PREFIX_BLOCKS and cached1 == PREFIX_BLOCKS * BS
    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=BS, num_kv_blocks=NUM_BLOCKS)
    want = [o.outputs[0].token_ids for o in llm.generate(turns, params)]
    assert [toks0, toks1] == want
