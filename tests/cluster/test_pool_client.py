"""PoolClient against scripted workers (no Ray): the order in which deltas reach a stream decides
what its caller gets, so these tests fix that order exactly instead of racing real actors for it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from baton_serve.cluster.front import PoolClient, WorkerRef
from baton_serve.router.routing import make_policy
from baton_serve.workers.actor.messages import encode_deltas
from baton_serve.workers.engine.outputs import TokenDelta
from baton_serve.workers.engine.validation import RequestLimits
from baton_serve.workers.sampling.params import SamplingParams
from hypothesis import given, settings
from hypothesis import strategies as st


class _Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> asyncio.Future:
        # Runs at once, like a Ray call that is sent whether or not anyone awaits its result.
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(self.fn(*args, **kwargs))
        return fut


class ScriptedWorker:
    """A worker handle whose ``add_request`` calls a script; what the script emits is what the
    front's poll loop reads next, in one batch."""

    def __init__(self, script) -> None:
        self.script, self.outbox, self.added, self.aborted = script, [], [], []
        self.add_request = _Method(self._add)
        self.abort = _Method(self.aborted.append)
        self.poll = _Poll(self)
        self.stats = _Method(lambda: {})
        self.set_paused = _Method(lambda *a: None)
        self.finish_sample = _Method(lambda *a: None)

    def _add(self, wire_id, prompt, params, *common, resume=None) -> None:
        self.added.append((wire_id, None if resume is None else {**resume, "output_token_ids": list(resume["output_token_ids"])}))
        self.outbox.extend(self.script(wire_id, params, resume))



class _Poll:
    """``Worker.poll``: what the worker emitted since the last call, or None after a short wait."""

    def __init__(self, worker: ScriptedWorker) -> None:
        self.worker = worker

    async def remote(self, front_id: str, timeout_s: float) -> bytes | None:
        await asyncio.sleep(0.01)
        out, self.worker.outbox = self.worker.outbox, []
        return encode_deltas(out) if out else None


FULL = {0: [11, 12, 13, 14], 1: [21, 22, 23, 24]}


def _pool(script, decode: ScriptedWorker | None = None, poll: type[_Poll] = _Poll,
          migration_wait_s: float = 1.0, decision_log: str | None = None) -> tuple[PoolClient, ScriptedWorker]:
    """One prefill worker running ``script`` (its output read through ``poll``) and one decode worker."""
    worker = ScriptedWorker(script)
    worker.poll = poll(worker)
    refs = [WorkerRef("prefill-0", "prefill", worker),
            WorkerRef("decode-0", "decode", decode or ScriptedWorker(lambda *a: []))]
    pool = PoolClient(refs, RequestLimits(vocab_size=100, max_model_len=64, num_blocks=64, block_size=8),
                      policy=make_policy("round_robin"), migration_wait_s=migration_wait_s,
                      decision_log=decision_log)
    return pool, worker


def _handoff(decode: ScriptedWorker, rest: list[int]):
    """A prefill script: the first token here, the decode worker's ``rest`` (the last one ends the
    sample) put in its outbox at once, as if the KV had reached it."""
    def script(wire_id, params, resume):
        decode.outbox.extend(TokenDelta(wire_id, 0, [t], position=1 + k,
                                        finish_reason="length" if k == len(rest) - 1 else None)
                             for k, t in enumerate(rest))
        return [TokenDelta(wire_id, 0, [11], position=0, kv_ready=True)]
    return script


async def _collect(pool: PoolClient, params: SamplingParams) -> tuple[dict[int, list[int]], dict[int, str]]:
    toks: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    async for d in pool.generate("r", [1, 2, 3], params):
        toks.setdefault(d.index, []).extend(d.token_ids)
        if d.finish_reason is not None:
            reasons[d.index] = d.finish_reason
    return toks, reasons


def test_both_samples_of_a_failed_shipment_resume_even_when_their_failures_arrive_together():
    """n = 2: prefill emits both first tokens, then both shipments fail in the same batch. The
    first failure gives the placement up; the second, already queued behind it, must not end
    its sample as aborted: both samples resume after the migration, nothing lost or repeated."""

    def script(wire_id, params, resume):
        if resume is None:  # the first placement: first tokens, then both KV shipments fail
            return [TokenDelta(wire_id, 0, FULL[0][:1]), TokenDelta(wire_id, 1, FULL[1][:1]),
                    *(TokenDelta(wire_id, i, [], finish_reason="abort", stop_reason="kv transfer failed",
                                 recoverable=True) for i in (0, 1))]
        i, have = resume["index"], resume["output_token_ids"]
        return [TokenDelta(wire_id, i, FULL[i][len(have):], finish_reason="length")]

    async def main():
        pool, worker = _pool(script)
        await pool.start(stats_interval_s=0.05)
        try:
            got = await asyncio.wait_for(_collect(pool, SamplingParams(n=2, max_tokens=4, seed=1)), 10)
            left = [(w.load.local_decode_left, w.load.local_pending_requests) for w in pool.workers.values()]
            return got, pool.migrations_total, worker.added, left
        finally:
            await pool.stop()

    (toks, reasons), migrations, added, left = asyncio.run(main())
    assert toks == FULL and reasons == {0: "length", 1: "length"}
    assert migrations == 1
    assert left == [(0, 0), (0, 0)]  # the tokens-left and pending counts came through the migration whole
    # one migration placed each sample alone, resuming from its first token
    assert sorted((r["index"], r["output_token_ids"]) for _, r in added[1:]) == [(0, [11]), (1, [21])]


def test_admission_charges_a_shared_prompt_once_on_the_worker_that_holds_it():
    """The front names the prompt's block hashes in its KV demand: a second request on the same
    long prompt is admitted beside the first on the worker holding it, where a worker-sized ledger
    has room for the prompt once and two tails, instead of spilling to a cold worker."""
    import dataclasses

    from baton_serve.cluster.admission.kv import KVAdmission
    from baton_serve.workers.blocks.prefix_hash import CacheNamespace

    ns = dataclasses.asdict(CacheNamespace(model="m", weights_hash="w", block_size=8))
    refs = [WorkerRef(f"colocated-{i}", "colocated", ScriptedWorker(lambda *a: []),
                      info={"cache_namespace": ns, "num_blocks": 20, "block_size": 8}) for i in range(2)]
    admission = KVAdmission({r.worker_id: 20 for r in refs}, block_size=8)
    pool = PoolClient(refs, RequestLimits(vocab_size=100, max_model_len=256, num_blocks=20, block_size=8),
                      policy=make_policy("prefix"), admission=admission)
    prompt, params = list(range(1, 101)), SamplingParams(max_tokens=8)  # 12 full blocks + 4 tokens

    async def run() -> list[str]:
        placed = []
        for rid in ("a", "b"):
            decision, hashes = pool._route(prompt, None, params)
            assert len(hashes) == 12
            decision, _, _ = await pool._admit(rid, prompt, None, params, 0, None, decision, hashes)
            placed.append(decision.first.worker_id)
        return placed

    a, b = asyncio.run(run())
    assert a == b  # 14 blocks each, 12 of them shared: 16 of the worker's 20
    assert admission.ledgers[a].reserved_blocks == 16


class _SlowPoll(_Poll):
    """A worker whose output reaches the front late (a descheduled writer thread, a slow link)."""

    async def remote(self, front_id: str, timeout_s: float) -> bytes | None:
        await asyncio.sleep(0.3)
        return await super().remote(front_id, timeout_s)


def test_decode_tokens_that_overtake_the_prefill_workers_first_token_wait_for_it():
    """Disaggregated: the decode worker's tokens reach the front before the prefill worker's first
    one (two sockets, no order between them). The caller gets them in the sample's order, and the
    request resumes nowhere: nothing was lost."""
    decode = ScriptedWorker(lambda *a: [])
    pool, _ = _pool(_handoff(decode, [12, 13, 14]), decode, poll=_SlowPoll)

    async def main():
        await pool.start(stats_interval_s=0.05)
        try:
            return await asyncio.wait_for(_collect(pool, SamplingParams(max_tokens=4)), 10)
        finally:
            await pool.stop()

    toks, reasons = asyncio.run(main())
    assert toks == {0: [11, 12, 13, 14]} and reasons == {0: "length"}
    assert pool.migrations_total == 0


def test_the_decode_worker_s_tokens_left_follow_each_sample_and_end_at_zero():
    """The front's count of output tokens a decode worker may still produce (what the cost model
    bounds its busy time by): the whole budget at placement, one less a token (the prefill
    worker's first one too), the rest of a sample's budget when it ends sooner, and 0 after."""
    decode = ScriptedWorker(lambda *a: [])
    pool, _ = _pool(_handoff(decode, [12, 13]), decode)
    seen: list[tuple[int, int]] = []

    async def main():
        await pool.start(stats_interval_s=0.05)
        try:
            async for d in pool.generate("r", [1, 2, 3], SamplingParams(max_tokens=6)):
                seen.append((len(d.token_ids), pool.workers["decode-0"].load.local_decode_left))
        finally:
            await pool.stop()

    asyncio.run(asyncio.wait_for(main(), 10))
    # 11 from the prefill worker, 12 from the decode worker, 13 ends the sample 3 tokens short
    assert seen == [(1, 5), (1, 4), (1, 0)]
    assert pool.workers["prefill-0"].load.local_decode_left == 0


def test_the_prefill_worker_s_pending_requests_count_until_the_first_token():
    """The front's count of requests waiting for their prompt on a worker (what the cost model
    prices a long prompt joining their step by): one at placement, none once the first token is
    out, however the request then ends."""
    decode = ScriptedWorker(lambda *a: [])
    handoff = _handoff(decode, [12, 13])
    at_add: list[int] = []

    def script(wire_id, params, resume):
        at_add.append(pool.workers["prefill-0"].load.local_pending_requests)
        return handoff(wire_id, params, resume)

    pool, _ = _pool(script, decode)
    seen: list[int] = []

    async def main():
        await pool.start(stats_interval_s=0.05)
        try:
            async for _ in pool.generate("r", [1, 2, 3], SamplingParams(max_tokens=3)):
                seen.append(pool.workers["prefill-0"].load.local_pending_requests)
        finally:
            await pool.stop()

    asyncio.run(asyncio.wait_for(main(), 10))
    assert at_add == [1]  # counted while the prompt is on the worker
    assert seen == [0, 0, 0]  # and no longer once its first token is out
    assert [w.load.local_pending_requests for w in pool.workers.values()] == [0, 0]


def test_the_decision_log_pairs_each_routed_request_with_its_measured_ttft(tmp_path):
    decode = ScriptedWorker(lambda *a: [])
    path = tmp_path / "decisions.jsonl"
    pool, worker = _pool(_handoff(decode, [12, 13]), decode, decision_log=str(path))

    async def main():
        await pool.start(stats_interval_s=0.05)
        try:
            return await asyncio.wait_for(_collect(pool, SamplingParams(max_tokens=3)), 10)
        finally:
            await pool.stop()

    toks, _ = asyncio.run(main())
    assert toks == {0: [11, 12, 13]}
    records = [json.loads(line) for line in path.read_text().splitlines()]
    (wire_id, _), = worker.added
    decision, ttft = records
    assert (decision["kind"], decision["id"], decision["policy"]) == ("decision", wire_id, "round_robin")
    assert (decision["first"], decision["decode"]) == ("prefill-0", "decode-0")
    assert {w["id"] for w in decision["workers"]} == {"prefill-0", "decode-0"}
    assert (ttft["kind"], ttft["id"]) == ("ttft", wire_id) and 0 < ttft["ttft_s"] < 10
    assert pool.router.decision_log._fd is None  # stop() closed it


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12).flatmap(lambda k: st.tuples(st.just(k), st.permutations(range(k)),
                                                      st.lists(st.integers(0, k - 1), max_size=3))))
def test_a_samples_deltas_in_any_order_reach_the_caller_in_its_order(case):
    """Whatever order a sample's deltas come in (repeats too), the queue gets each delta once, in
    position order; ends decided outside the engine (position -1) go at once."""
    from baton_serve.cluster.front.streams import Stream as _Stream

    k, order, repeats = case
    stream = _Stream(asyncio.Queue(), 1, set(), "w")
    out: list[TokenDelta] = []
    for p in [*order, *repeats]:
        d = TokenDelta("w", 0, [100 + p], position=p, finish_reason="length" if p == k - 1 else None)
        out += [d for d, _ in stream.in_order(d, "decode-0")]
    assert [t for d in out for t in d.token_ids] == [100 + p for p in range(k)]
    assert [d.finish_reason for d in out] == [None] * (k - 1) + ["length"]
    end = TokenDelta("w", 0, [], finish_reason="abort")
    assert stream.in_order(end, None) == [(end, None)]


class _DeadPoll(_Poll):
    """A worker that died before its output left: its poll fails, what it emitted never comes."""

    async def remote(self, front_id: str, timeout_s: float) -> bytes | None:
        await asyncio.sleep(0.2)
        raise RuntimeError("actor died")


def test_a_prefill_worker_lost_before_its_first_token_came_fails_the_stream_over_held_decode_tokens():
    """The decode worker's tokens wait for the prefill worker's first one; that worker dies first.
    Its death is still the stream's (the decode worker has not taken the sample over for the
    caller): the request is placed again, here on nobody, so it ends with a clear error instead
    of waiting forever or streaming a sample without its first token."""
    import pytest
    from baton_serve.workers.errors import WorkerLostError

    decode = ScriptedWorker(lambda *a: [])
    pool, _ = _pool(_handoff(decode, [12, 13]), decode, poll=_DeadPoll, migration_wait_s=0.5)

    async def main():
        await pool.start(stats_interval_s=0.05)
        try:
            with pytest.raises(WorkerLostError):
                await asyncio.wait_for(_collect(pool, SamplingParams(max_tokens=3)), 10)
        finally:
            await pool.stop()

    asyncio.run(main())
    assert pool.migrations_total == 1
    assert decode.aborted  # the decode worker's copy of the sample was let go
