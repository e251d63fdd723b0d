"""Waiting-queue policies on their own: nothing lost, aging across classes, DRR fairness between
tenants of one class, and peeks that change nothing."""

from __future__ import annotations

import pytest
from baton_serve.workers.engine.config import SchedulerConfig
from baton_serve.workers.engine.request import Request
from baton_serve.workers.engine.waiting_queue import (
    POLICY_NAMES,
    FairShareQueue,
    WaitingQueue,
    make_waiting_queue,
)
from baton_serve.workers.sampling.params import SamplingParams
from hypothesis import given, settings
from hypothesis import strategies as st


def _req(rid: str, size: int, tenant: str = "", priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(rid, [3] * size, SamplingParams(max_tokens=1), size + 1, arrival_time=arrival,
                   priority=priority, tenant=tenant)


def _take(q: WaitingQueue, now: float = 0.0) -> Request:
    """What the scheduler does when it admits: peek, charge, remove."""
    r = q.peek(now)
    q.admitted(r)
    q.remove(r)
    return r


def _drain(q: WaitingQueue, now: float = 0.0) -> list[str]:
    return [_take(q, now).request_id for _ in range(len(q))]


# ---------------------------------------------------------------------- by name
def test_policies_are_chosen_by_name_and_unknown_names_list_the_three():
    assert POLICY_NAMES == ("fcfs", "priority", "fair")
    fair = make_waiting_queue("fair", 2.0, quantum_tokens=64)
    assert isinstance(fair, FairShareQueue) and fair.quantum_tokens == 64
    assert make_waiting_queue("fair", 2.0).quantum_tokens == 512  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="'fcfs', 'priority', 'fair'"):
        make_waiting_queue("lottery", 1.0)
    with pytest.raises(ValueError, match="policy must be 'fcfs', 'priority' or 'fair'"):
        SchedulerConfig(policy="lottery")
    with pytest.raises(ValueError, match="fair_quantum_tokens must be > 0"):
        SchedulerConfig(policy="fair", fair_quantum_tokens=0)
    with pytest.raises(ValueError, match="quantum_tokens must be > 0"):
        FairShareQueue(1.0, quantum_tokens=0)


# ---------------------------------------------------------------------- exact DRR orders
def test_equal_sizes_alternate_between_tenants():
    q = FairShareQueue(10.0, quantum_tokens=8)
    for i in range(4):
        q.push(_req(f"a{i}", 8, "A"))
    for i in range(2):
        q.push(_req(f"b{i}", 8, "B"))
    assert _drain(q) == ["a0", "b0", "a1", "b1", "a2", "a3"]


def test_a_turn_lasts_while_the_deficit_covers_the_head():
    """Quantum 10. A's 6-token requests: one per turn, then two once 8 is saved. B's 15-token head
    needs two visits; when A leaves the round, B's saved 10 plus a quantum pay for both of its."""
    q = FairShareQueue(10.0, quantum_tokens=10)
    for i in range(3):
        q.push(_req(f"a{i}", 6, "A"))
    q.push(_req("b0", 15, "B"))
    q.push(_req("b1", 3, "B"))
    assert _drain(q) == ["a0", "a1", "a2", "b0", "b1"]


def test_tokens_still_to_compute_are_what_is_charged():
    q = FairShareQueue(10.0, quantum_tokens=10)
    swapped = _req("a0", 30, "A")
    swapped.num_computed_tokens = 26  # KV kept in host memory: 4 positions left
    q.push(swapped)
    q.push(_req("a1", 4, "A"))
    q.push(_req("b0", 4, "B"))
    assert _drain(q) == ["a0", "a1", "b0"]  # 4 + 4 within A's first quantum


def test_push_front_keeps_the_tenants_head_and_its_place():
    q = FairShareQueue(10.0, quantum_tokens=10)
    for i in range(3):
        q.push(_req(f"a{i}", 4, "A"))
    b0 = _req("b0", 4, "B")
    q.push(b0)
    a0 = _take(q)
    q.push_front(a0)  # preempted: back at A's head, A's turn goes on with its 6 left
    assert q.peek(0.0) is a0
    assert [_take(q).request_id for _ in range(2)] == ["a0", "b0"]  # charged again: 2 left, B's turn
    # B emptied and left the round; its preempted request rejoins behind A, with nothing saved.
    q.push_front(b0)
    assert _drain(q) == ["a1", "a2", "b0"]


def test_a_peek_that_is_not_followed_by_admission_changes_nothing():
    q = FairShareQueue(10.0, quantum_tokens=4)
    q.push(_req("a0", 8, "A"))
    q.push(_req("b0", 4, "B"))
    for _ in range(5):
        assert q.peek(0.0).request_id == "b0"  # A needs two visits, B one
    assert _drain(q) == ["b0", "a0"]


def test_aging_lets_an_old_low_priority_request_through_a_fair_class():
    q = FairShareQueue(aging_seconds=1.0, quantum_tokens=8)
    q.push(_req("low", 2, "L", priority=5, arrival=0.0))
    served = []
    for t in range(10):
        q.push(_req(f"hi{t}", 2, "AB"[t % 2], priority=0, arrival=float(t)))
        served.append(_take(q, now=float(t)).request_id)
    assert served[:5] == ["hi0", "hi1", "hi2", "hi3", "hi4"]
    assert "low" in served[5:7]


# ---------------------------------------------------------------------- properties
_TENANTS = ["", "a", "b"]
_op = st.one_of(
    st.tuples(st.just("push"), st.integers(1, 40), st.sampled_from(_TENANTS), st.integers(0, 2)),
    st.tuples(st.just("take")),
    st.tuples(st.just("abort"), st.integers(0, 1000)),
    st.tuples(st.just("preempt"), st.integers(0, 1000), st.booleans()),
)


@settings(max_examples=150, deadline=None)
@given(policy=st.sampled_from(POLICY_NAMES), ops=st.lists(_op, max_size=60), quantum=st.integers(1, 64))
def test_every_pushed_request_comes_out_exactly_once(policy, ops, quantum):
    q = make_waiting_queue(policy, 2.0, quantum_tokens=quantum)
    waiting: list[Request] = []
    running: list[Request] = []
    pushes: dict[str, int] = {}
    removals: dict[str, int] = {}
    now = 0.0

    def out(r: Request) -> None:
        waiting.remove(r)
        removals[r.request_id] = removals.get(r.request_id, 0) + 1

    for i, op in enumerate(ops):
        now += 0.5
        if op[0] == "push":
            r = _req(f"r{i}", op[1], op[2], op[3], arrival=now)
            q.push(r)
            waiting.append(r)
            pushes[r.request_id] = 1
        elif op[0] == "take" and waiting:
            r = q.peek(now)
            assert any(r is w for w in waiting)
            q.admitted(r)
            q.remove(r)
            out(r)
            running.append(r)
        elif op[0] == "abort" and waiting:
            r = waiting[op[1] % len(waiting)]
            q.remove(r)
            out(r)
        elif op[0] == "preempt" and running:
            r = running.pop(op[1] % len(running))
            r.num_computed_tokens = r.num_tokens // 2 if op[2] else 0  # swapped keeps some KV
            q.push_front(r)
            waiting.append(r)
            pushes[r.request_id] += 1
        assert len(q) == len(waiting)
        assert sorted(id(r) for r in q) == sorted(id(r) for r in waiting)
    while waiting:
        r = _take(q, now)
        out(r)
    assert len(q) == 0 and list(q) == []
    assert removals == pushes


@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(["priority", "fair"]), aging=st.sampled_from([1.0, 2.0, 4.0]),
       gap=st.integers(1, 5), num_tenants=st.integers(1, 3), backlog=st.integers(0, 8),
       max_size=st.integers(1, 64), quantum=st.integers(64, 256), data=st.data())
def test_aging_prevents_starvation_across_classes(policy, aging, gap, num_tenants, backlog, max_size,
                                                   quantum, data):
    """A steady flood of better-class requests (one in, one out per second) cannot hold back a
    request ``gap`` classes worse: it is next exactly when no better one that arrived before
    ``gap * aging`` still waits, which DRR within the flood's class guarantees in bounded time."""
    q = make_waiting_queue(policy, aging, quantum_tokens=quantum)
    size = st.integers(1, max_size)
    low = _req("low", data.draw(size), "low", priority=gap)
    q.push(low)
    for i in range(backlog):
        q.push(_req(f"old{i}", data.draw(size), str(i % num_tenants), priority=0))
    horizon = gap * aging
    bound = horizon + 1 + (backlog + 2) * num_tenants * (quantum + max_size)
    t = 0
    while True:
        t += 1
        assert t <= bound, "the low-priority request starved"
        q.push(_req(f"hi{t}", data.draw(size), str(t % num_tenants), priority=0, arrival=float(t)))
        older_better = any(r is not low and r.arrival_time < horizon for r in q)
        nxt = _take(q, now=float(t))
        assert (nxt is low) == (not older_better)
        if nxt is low:
            break


def _fair_prefixes(sizes_a: list[int], sizes_b: list[int], quantum: int, b_first: bool) -> int:
    """Drain two tenants of one class; the largest token gap over the prefixes where both waited."""
    q = FairShareQueue(10.0, quantum_tokens=quantum)
    a = [_req(f"a{i}", s, "A") for i, s in enumerate(sizes_a)]
    b = [_req(f"b{i}", s, "B") for i, s in enumerate(sizes_b)]
    for r in (b + a if b_first else a + b):
        q.push(r)
    tokens = {"A": 0, "B": 0}
    left = {"A": len(a), "B": len(b)}
    worst = 0
    while len(q):
        both = left["A"] > 0 and left["B"] > 0
        r = _take(q)
        tokens[r.tenant] += r.num_prompt_tokens
        left[r.tenant] -= 1
        if both:
            worst = max(worst, abs(tokens["A"] - tokens["B"]))
    return worst


@settings(max_examples=150, deadline=None)
@given(num_b=st.integers(1, 6), size=st.integers(1, 64), quantum=st.integers(1, 300), b_first=st.booleans())
def test_a_tenant_with_ten_times_the_requests_gets_no_more_than_a_quantum_ahead(num_b, size, quantum,
                                                                                b_first):
    worst = _fair_prefixes([size] * (10 * num_b), [size] * num_b, quantum, b_first)
    assert worst <= quantum + size


@settings(max_examples=150, deadline=None)
@given(sizes_a=st.lists(st.integers(1, 80), min_size=1, max_size=60),
       sizes_b=st.lists(st.integers(1, 80), min_size=1, max_size=8),
       quantum=st.integers(1, 300), b_first=st.booleans())
def test_unequal_sizes_stay_within_a_quantum_and_the_largest_request(sizes_a, sizes_b, quantum, b_first):
    worst = _fair_prefixes(sizes_a, sizes_b, quantum, b_first)
    assert worst <= quantum + max(sizes_a + sizes_b)


@settings(max_examples=300, deadline=None)
@given(policy=st.sampled_from(POLICY_NAMES),
       ops=st.lists(st.one_of(
           st.tuples(st.just("push"), st.integers(1, 40), st.sampled_from(_TENANTS), st.integers(0, 1)),
           st.tuples(st.just("take"), st.integers(2, 4))), max_size=50),
       quantum=st.integers(1, 64))
def test_peeking_many_times_admits_in_the_same_order_as_peeking_once(policy, ops, quantum):
    orders = []
    for repeat in (False, True):
        q = make_waiting_queue(policy, 2.0, quantum_tokens=quantum)
        order = []
        for i, op in enumerate(ops):
            now = 0.5 * i
            if op[0] == "push":
                q.push(_req(f"r{i}", op[1], op[2], op[3], arrival=now))
            elif len(q):
                for _ in range(op[1] if repeat else 0):
                    q.peek(now)
                    q.peek(now + 100.0)  # a later clock, too: peeking only reads
                order.append(_take(q, now).request_id)
        order += _drain(q, 0.5 * len(ops))
        orders.append(order)
    assert orders[0] == orders[1]
