"""Scheduler tick with a null model: budgets, chunking, preemption, priority aging, tenant fairness,
no leaks."""

from __future__ import annotations

from baton_serve.workers.blocks.manager import BlockManager
from baton_serve.workers.engine.config import SchedulerConfig
from baton_serve.workers.engine.request import Request, RequestStatus
from baton_serve.workers.engine.scheduler import Scheduler
from baton_serve.workers.engine.swap import HostBlockPool
from baton_serve.workers.engine.waiting_queue import PriorityAgingQueue
from baton_serve.workers.sampling.params import SamplingParams
from hypothesis import given, settings
from hypothesis import strategies as st


def _req(rid: str, prompt_len: int, max_tokens: int, priority: int = 0, arrival: float = 0.0,
         base: int = 0, tenant: str = "") -> Request:
    prompt = [(base + i) % 50 + 3 for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), prompt_len + max_tokens,
                   arrival_time=arrival, priority=priority, tenant=tenant)


def _advance(sched: Scheduler, out) -> list[Request]:
    """What the engine does after a forward: count, sample a token, finish at the length limit."""
    sampled = [s.request for s in out.scheduled if s.samples]
    sched.update_after_forward(out)
    done = []
    for r in sampled:
        r.append_token(7)
        if r.num_tokens >= r.max_total_tokens:
            sched.finish(r, RequestStatus.FINISHED_LENGTH)
            done.append(r)
    return done


def test_chunked_prefill_respects_budget_and_decodes_first():
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=10), bm)
    a = _req("a", 3, 5)
    sched.add_request(a)
    _advance(sched, sched.schedule())  # a prefilled, first token sampled
    b = _req("b", 23, 2, base=100)
    sched.add_request(b)
    out = sched.schedule()
    assert [s.request.request_id for s in out.decodes] == ["a"]
    assert [(s.request.request_id, s.num_new_tokens) for s in out.prefills] == [("b", 9)]
    assert not out.prefills[0].samples
    _advance(sched, out)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.prefills] == [("b", 9)]
    _advance(sched, out)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.prefills] == [("b", 5)]
    assert out.prefills[0].samples and out.num_batched_tokens == 6


def test_max_num_seqs_limits_admission():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2), BlockManager(64, 4))
    for i in range(3):
        sched.add_request(_req(str(i), 4, 3, base=10 * i))
    out = sched.schedule()
    assert [s.request.request_id for s in out.prefills] == ["0", "1"]
    assert sched.num_waiting == 1


def test_preemption_by_recompute_frees_blocks_and_requeues_first():
    bm = BlockManager(6, 4)  # 24 slots
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm)
    a, b = _req("a", 8, 12), _req("b", 8, 12, base=20)
    sched.add_request(a)
    sched.add_request(b)
    steps = 0
    preempted = []
    while sched.has_unfinished() and steps < 200:
        out = sched.schedule()
        preempted += [r.request_id for r in out.preempted]
        _advance(sched, out)
        steps += 1
    assert preempted and preempted[0] == "b"  # the later arrival yields
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert not sched.has_unfinished() and bm.num_free_blocks == 6


def test_priority_aging_lets_old_low_priority_request_through():
    """Fresh high-priority arrivals win at first; after ``priority * aging_seconds`` of waiting the
    low-priority request overtakes every newer one, so a steady stream cannot starve it."""
    q = PriorityAgingQueue(aging_seconds=1.0)
    q.push(_req("low", 2, 1, priority=5, arrival=0.0))
    served = []
    for t in range(10):
        q.push(_req(f"hi{t}", 2, 1, priority=0, arrival=float(t)))
        nxt = q.peek(now=float(t))
        q.remove(nxt)
        served.append(nxt.request_id)
    assert served[:5] == ["hi0", "hi1", "hi2", "hi3", "hi4"]
    assert "low" in served[5:7]


def _admission_order(policy: str) -> list[str]:
    """Tenant A floods ten requests, then B sends two; one sequence at a time, each done after its prefill."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, policy=policy, fair_quantum_tokens=8), BlockManager(64, 4))
    for i in range(10):
        sched.add_request(_req(f"a{i}", 8, 1, arrival=0.01 * i, base=10 * i, tenant="A"))
    for i in range(2):
        sched.add_request(_req(f"b{i}", 8, 1, arrival=1.0 + 0.01 * i, base=100 + 10 * i, tenant="B"))
    order = []
    while sched.has_unfinished():
        out = sched.schedule()
        order += [s.request.request_id for s in out.prefills]
        _advance(sched, out)
    return order


def test_fair_interleaves_tenants_where_priority_serves_the_flood_first():
    flood = [f"a{i}" for i in range(10)]
    assert _admission_order("priority") == flood + ["b0", "b1"]
    assert _admission_order("fair") == ["a0", "b0", "a1", "b1"] + flood[2:]


def test_peeks_that_find_no_room_charge_no_one():
    """A's first request fills the KV cache; B's, next in the round, is peeked and refused for room
    every tick until it finishes. Those peeks cost B nothing: it still goes before A's second."""
    sched = Scheduler(SchedulerConfig(policy="fair", fair_quantum_tokens=12), BlockManager(4, 4))
    sched.add_request(_req("a0", 12, 4, arrival=0.0, tenant="A"))  # 3 blocks, then the 4th to decode
    sched.add_request(_req("a1", 8, 1, arrival=0.01, base=20, tenant="A"))
    sched.add_request(_req("b0", 8, 1, arrival=0.02, base=40, tenant="B"))
    order = []
    while sched.has_unfinished():
        out = sched.schedule()
        order += [s.request.request_id for s in out.prefills]
        _advance(sched, out)
    assert order == ["a0", "b0", "a1"]


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 3)),
                     min_size=1, max_size=12),
    num_blocks=st.integers(12, 40),
    budget=st.integers(1, 40),
    max_seqs=st.integers(1, 6),
    policy=st.sampled_from(["fcfs", "priority", "fair"]),
    abort_every=st.integers(0, 7),
    swap_blocks=st.sampled_from([0, 3, 16]),
    quantum=st.integers(1, 64),
)
def test_random_workloads_respect_limits_and_never_leak(prompts, num_blocks, budget, max_seqs, policy,
                                                         abort_every, swap_blocks, quantum):
    bm = BlockManager(num_blocks, 4)
    host = HostBlockPool(swap_blocks) if swap_blocks else None
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, policy=policy,
                                      fair_quantum_tokens=quantum,
                                      preemption_mode="swap" if host else "recompute"), bm, host)
    reqs = []
    for i, (plen, max_tokens, prio) in enumerate(prompts):
        if (plen + max_tokens + 3) // 4 > num_blocks:  # the engine rejects what can never fit
            continue
        r = _req(str(i), plen, max_tokens, priority=prio, base=7 * (i % 3), tenant="AB"[i % 2])
        reqs.append(r)
        sched.add_request(r)
    steps = 0
    while sched.has_unfinished():
        steps += 1
        assert steps < 2000, "scheduler made no progress"
        out = sched.schedule()
        assert out.num_batched_tokens <= budget
        assert len(sched.running) <= max_seqs
        assert len({h for _, h in out.swap_out}) == len(out.swap_out)
        for s in out.scheduled:
            r = s.request
            assert s.num_new_tokens >= 1
            assert r.num_computed_tokens + s.num_new_tokens <= r.num_tokens
            assert len(bm.block_table(r.request_id)) * 4 >= r.num_computed_tokens + s.num_new_tokens
        _advance(sched, out)
        if abort_every and steps % abort_every == 0 and sched.running:
            sched.finish(sched.running[0], RequestStatus.FINISHED_ABORTED)
    assert all(r.status.finished for r in reqs)
    assert bm.num_free_blocks == num_blocks
    assert host is None or host.num_free == swap_blocks
    for r in reqs:
        assert sched.finish(r, RequestStatus.FINISHED_ABORTED) is False  # reclaim is idempotent


def test_a_long_prompt_takes_a_chunk_a_step_and_short_ones_finish_beside_its_first():
    """``max_prefill_chunk`` (vLLM's long_prefill_token_threshold): the short prompts queued with a
    long one sample in the step of its first chunk instead of waiting for the whole of it."""
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_prefill_chunk=16), bm)
    long, short = _req("long", 40, 2), _req("short", 8, 2, base=200)
    sched.add_request(long)
    sched.add_request(short)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.prefills] == [("long", 16), ("short", 8)]
    assert [s.request.request_id for s in out.scheduled if s.samples] == ["short"]
    _advance(sched, out)
    chunks = [16]
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = sched.schedule()
        chunks += [s.num_new_tokens for s in out.prefills if s.request is long]
        _advance(sched, out)
    assert chunks == [16, 16, 8]
