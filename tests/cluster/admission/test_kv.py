"""Stage 2: KV reservations per worker and tenant; admit, queue, degrade, reject, in order."""

from __future__ import annotations

import asyncio

import pytest
from baton_serve.cluster.admission.gate import AdmissionError
from baton_serve.cluster.admission.kv import KVAdmission, KVDemand, admission_policies, make_admission_policy
from baton_serve.cluster.admission.tenants import Tenant
from hypothesis import given, settings
from hypothesis import strategies as st

T = Tenant("t")


def demand(rid: str, prompt: int = 16, max_tokens: int = 16, n: int = 1, priority: int = 0,
           tenant: Tenant = T) -> KVDemand:
    return KVDemand(rid, tenant, prompt, max_tokens, n, priority)


def test_blocks_for_counts_prompt_output_and_samples():
    kv = KVAdmission({"w": 100}, block_size=16)
    assert kv.blocks_for(demand("a", 16, 16)) == 2
    assert kv.blocks_for(demand("a", 20, 1)) == 2
    # n=2: the second sample shares the prompt's full block and needs its own tail + output.
    assert kv.blocks_for(demand("a", 20, 12, n=2)) == 2 + 1
    half = KVAdmission({"w": 100}, block_size=16, reserve_fraction=0.5)
    assert half.blocks_for(demand("a", 16, 32)) == 2


def test_admit_prefers_the_routed_worker_then_any_with_room():
    async def run() -> None:
        kv = KVAdmission({"w0": 4, "w1": 10}, block_size=16)
        r = await kv.reserve(demand("a", 32, 32), lambda: ["w0", "w1"], lambda: "w0")
        assert r.worker_id == "w0" and r.blocks == 4 and not r.degraded
        r = await kv.reserve(demand("b", 32, 32), lambda: ["w0", "w1"], lambda: "w0")
        assert r.worker_id == "w1"  # w0 is full: the other one has room
        assert kv.ledgers["w0"].reserved_blocks == 4 and kv.ledgers["w1"].reserved_blocks == 4
        assert kv.release("a") == 4 and kv.release("a") == 0  # a repeat frees nothing

    asyncio.run(run())


def test_followers_of_a_held_prefix_are_charged_only_their_own_blocks():
    """Three requests on one 1,024-token system prompt fit a worker with room for the prompt once
    and three tails, as they fit its prefix cache; a stranger's prompt of the same length does not,
    and the prefix's blocks come free only with the last reservation naming them."""
    prefix = tuple(bytes([i]) for i in range(64))  # 64 blocks of 16 tokens

    def follower(rid: str, hashes=prefix) -> KVDemand:
        return KVDemand(rid, T, 1024 + 32, 16, 1, 0, hashes)

    async def run() -> None:
        kv = KVAdmission({"w0": 64 + 3 * 4, "w1": 200}, block_size=16)
        for rid in ("a", "b", "c"):
            r = await kv.reserve(follower(rid), lambda: ["w0", "w1"], lambda: "w0")
            assert r.worker_id == "w0" and r.blocks == 67  # asked for whole, held once
        assert kv.ledgers["w0"].reserved_blocks == 64 + 3 * 3 and kv.ledgers["w0"].available_blocks == 3
        stranger = tuple(bytes([i, 1]) for i in range(64))
        r = await kv.reserve(follower("x", stranger), lambda: ["w0", "w1"], lambda: "w0")
        assert r.worker_id == "w1"  # its prompt is not held on w0: it needs 67 blocks there
        kv.release("a")
        kv.release("b")
        assert kv.ledgers["w0"].reserved_blocks == 64 + 3
        kv.release("c")
        assert kv.ledgers["w0"].reserved_blocks == 0

    asyncio.run(run())


def test_prefix_hashes_never_count_past_the_prompt():
    """Hashes beyond the prompt's full blocks (a caller's bug, another block size) are cut, so a
    reservation never claims to share more than it holds."""
    async def run() -> None:
        kv = KVAdmission({"w": 100}, block_size=16)
        hashes = tuple(bytes([i]) for i in range(10))
        await kv.reserve(KVDemand("a", T, 40, 8, 1, 0, hashes), lambda: ["w"], lambda: "w")
        assert kv.ledgers["w"].reserved_blocks == 3  # ceil(48 / 16), two of them shared
        await kv.reserve(KVDemand("b", T, 40, 8, 1, 0, hashes), lambda: ["w"], lambda: "w")
        assert kv.ledgers["w"].reserved_blocks == 4

    asyncio.run(run())


def test_queue_then_admit_in_priority_order_and_deadline():
    async def run() -> None:
        kv = KVAdmission({"w": 4}, block_size=16, queue_timeout_s=5)
        await kv.reserve(demand("big", 32, 32), lambda: ["w"], lambda: "w")
        order = []

        async def wait(rid: str, priority: int) -> None:
            r = await kv.reserve(demand(rid, 16, 16, priority=priority), lambda: ["w"], lambda: "w")
            order.append((rid, r.queued_s > 0))

        tasks = [asyncio.create_task(wait("low", 5)), asyncio.create_task(wait("high", 0))]
        await asyncio.sleep(0.05)
        assert kv.queue_depths() == {5: 1, 0: 1} and not order
        kv.release("big")
        await asyncio.gather(*tasks)
        assert order == [("high", True), ("low", True)]
        # A deadline: 429 with Retry-After, and nothing held.
        short = KVAdmission({"w": 2}, block_size=16, queue_timeout_s=0.05)
        await short.reserve(demand("x", 16, 16), lambda: ["w"], lambda: "w")
        with pytest.raises(AdmissionError) as err:
            await short.reserve(demand("y", 16, 16), lambda: ["w"], lambda: "w")
        assert err.value.status_code == 429 and err.value.reason == "queue_deadline"
        assert "Retry-After" in err.value.headers and short.held("y") is None

    asyncio.run(run())


def test_no_live_worker_ends_queued_with_503():
    async def run() -> None:
        kv = KVAdmission({"w": 2}, block_size=16, queue_timeout_s=0.05)
        await kv.reserve(demand("x"), lambda: ["w"], lambda: "w")
        alive: list[str] = ["w"]
        task = asyncio.create_task(kv.reserve(demand("y"), lambda: list(alive), lambda: "w"))
        await asyncio.sleep(0.01)
        alive.clear()
        with pytest.raises(AdmissionError) as err:
            await task
        assert err.value.status_code == 503

    asyncio.run(run())


def test_degrade_runs_fewer_whole_samples_before_shorter_ones():
    async def run() -> None:
        flexible = Tenant("f", allow_degrade=True)
        kv = KVAdmission({"w": 8}, block_size=16, queue_timeout_s=0.05)
        await kv.reserve(demand("x", 16, 48), lambda: ["w"], lambda: "w")  # 4 of 8 blocks
        # n=4 of prompt 16 + 16 out: 2 blocks for the first, 1 per further sample -> 5; 4 fit: n=3.
        r = await kv.reserve(demand("f1", 16, 16, n=4, tenant=flexible), lambda: ["w"], lambda: "w")
        assert r.degraded and (r.n, r.max_tokens, r.blocks) == (3, 16, 4)
        assert kv.ledgers["w"].available_blocks == 0
        kv.release("f1")
        # Not even one whole sample fits: the output budget is capped instead, n kept.
        r = await kv.reserve(demand("f2", 16, 100, n=2, tenant=flexible), lambda: ["w"], lambda: "w")
        assert r.degraded and r.n is None and r.max_tokens < 100

    asyncio.run(run())


def test_degrade_caps_max_tokens_only_for_tenants_that_allow_it():
    async def run() -> None:
        flexible = Tenant("f", allow_degrade=True)
        kv = KVAdmission({"w": 8}, block_size=16, queue_timeout_s=0.05)
        await kv.reserve(demand("x", 16, 48), lambda: ["w"], lambda: "w")  # 4 of 8 blocks
        r = await kv.reserve(demand("f1", 16, 200, tenant=flexible), lambda: ["w"], lambda: "w")
        assert r.degraded and r.max_tokens == 48 and kv.ledgers["w"].available_blocks == 0
        with pytest.raises(AdmissionError):  # a strict tenant queues, then times out
            await kv.reserve(demand("s1", 16, 200), lambda: ["w"], lambda: "w")

    asyncio.run(run())


def test_queue_full_rejects_with_retry_after_from_the_drain_rate():
    async def run() -> None:
        kv = KVAdmission({"w": 2}, block_size=16, queue_timeout_s=5, max_queued_per_class=1)
        for i in range(5):  # a history of releases gives a drain rate
            await kv.reserve(demand(f"h{i}"), lambda: ["w"], lambda: "w")
            await asyncio.sleep(0.02)
            kv.release(f"h{i}")
        await kv.reserve(demand("x", 16, 16), lambda: ["w"], lambda: "w")
        waiting = asyncio.create_task(kv.reserve(demand("q"), lambda: ["w"], lambda: "w"))
        await asyncio.sleep(0.01)
        with pytest.raises(AdmissionError) as err:
            await kv.reserve(demand("r"), lambda: ["w"], lambda: "w")
        assert err.value.reason == "kv_queue_full" and 1 <= int(err.value.headers["Retry-After"]) < 5
        kv.release("x")
        await waiting

    asyncio.run(run())


def test_tenant_concurrency_and_kv_budget_queue_only_that_tenant():
    async def run() -> None:
        capped = Tenant("c", max_concurrent_requests=1)
        budget = Tenant("b", kv_block_budget=3)
        kv = KVAdmission({"w": 100}, block_size=16, queue_timeout_s=0.05)
        await kv.reserve(demand("c1", tenant=capped), lambda: ["w"], lambda: "w")
        with pytest.raises(AdmissionError):
            await kv.reserve(demand("c2", tenant=capped), lambda: ["w"], lambda: "w")
        await kv.reserve(demand("b1", tenant=budget), lambda: ["w"], lambda: "w")  # 2 blocks
        with pytest.raises(AdmissionError):
            await kv.reserve(demand("b2", tenant=budget), lambda: ["w"], lambda: "w")  # 2 more > 3
        await kv.reserve(demand("other"), lambda: ["w"], lambda: "w")  # others are not held back

    asyncio.run(run())


def test_a_request_alone_is_admitted_even_past_a_small_share():
    async def run() -> None:
        kv = KVAdmission({"w": 10}, block_size=16, share=0.25)  # 2 blocks for this front
        r = await kv.reserve(demand("big", 64, 64), lambda: ["w"], lambda: "w")
        assert r.blocks == 8 and kv.ledgers["w"].available_blocks < 0
        kv.release("big")
        assert kv.ledgers["w"].available_blocks == 2

    asyncio.run(run())


def test_policies_by_name():
    assert {"reserve", "unlimited"} <= set(admission_policies())
    with pytest.raises(ValueError, match="known"):
        make_admission_policy("nope")

    async def run() -> None:
        kv = KVAdmission({"w": 2}, block_size=16, policy="unlimited")
        for i in range(3):
            await kv.reserve(demand(f"u{i}"), lambda: ["w"], lambda: "w")
        assert kv.ledgers["w"].reserved_blocks == 6  # oversubscribed, and the ledger shows it

    asyncio.run(run())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["reserve", "release"]), st.integers(1, 80), st.integers(0, 2)),
                max_size=40))
def test_ledger_never_oversubscribes_and_every_hold_is_released_once(ops):
    async def run() -> None:
        kv = KVAdmission({"w0": 12, "w1": 6}, block_size=16, queue_timeout_s=0.01)
        held: list[str] = []
        for i, (op, size, prio) in enumerate(ops):
            if op == "reserve":
                try:
                    await kv.reserve(demand(f"r{i}", size, size, priority=prio), lambda: ["w0", "w1"],
                                     lambda: "w0")
                    held.append(f"r{i}")
                except AdmissionError:
                    pass
            elif held:
                kv.release(held.pop(0))
            for ledger in kv.ledgers.values():
                # Over capacity only for one request admitted alone.
                assert ledger.available_blocks >= 0 or len(ledger) == 1
        for rid in held:
            assert kv.release(rid) > 0
        assert all(lg.reserved_blocks == 0 and len(lg) == 0 for lg in kv.ledgers.values())
        assert not kv._tenant_blocks.get("t") and not kv._tenant_admitted.get("t")

    asyncio.run(run())


def test_the_synchronous_api_admits_queues_and_wakes_without_an_event_loop():
    """``try_reserve`` / ``enqueue`` / ``collect``: what the simulator calls on its virtual clock, and
    what ``reserve`` is built on. A demand that does not fit queues; a release admits it, in order."""
    now = [0.0]
    kv = KVAdmission({"w": 4}, block_size=16, clock=lambda: now[0], max_queued_per_class=1)
    first = kv.try_reserve(demand("a", 32, 32), ["w"], "w")
    assert first is not None and first.worker_id == "w" and first.blocks == 4
    assert kv.try_reserve(demand("b", 32, 32), ["w"], "w") is None  # full: it must queue
    got: list = []
    waiter = kv.enqueue(demand("b", 32, 32), lambda: ["w"], lambda: "w", got.append, got.append)
    assert kv.queue_depths() == {0: 1}
    with pytest.raises(AdmissionError) as full:  # the class's queue holds one
        kv.try_reserve(demand("c", 32, 32), ["w"], "w")
    assert full.value.status == 429 and full.value.reason == "kv_queue_full"
    now[0] = 2.5
    kv.release("a")
    assert waiter.done and len(got) == 1 and got[0].action == "held"
    held = kv.collect(demand("b", 32, 32), got[0], now[0])
    assert held.worker_id == "w" and held.blocks == 4 and held.queued_s == 2.5
    assert kv.ledgers["w"].reserved_blocks == 4 and kv.queue_depths() == {}
    assert kv.timed_out(demand("d"), []).status == 503 and kv.timed_out(demand("d"), ["w"]).status == 429


def test_a_dequeued_waiter_is_never_admitted():
    kv = KVAdmission({"w": 4}, block_size=16)
    kv.try_reserve(demand("a", 32, 32), ["w"], "w")
    got: list = []
    waiter = kv.enqueue(demand("b", 32, 32), lambda: ["w"], lambda: "w", got.append, got.append)
    kv.dequeue(waiter)
    kv.release("a")
    assert got == [] and kv.ledgers["w"].reserved_blocks == 0
