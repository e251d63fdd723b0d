"""The directory of idempotent runs' owners: first claim wins, conflicts, release, take-over, TTL."""

from __future__ import annotations

import asyncio

from baton_serve.cluster.admission.idempotency_owners import IdempotencyOwners
from baton_serve.router.idempotency import IdempotencyStore


def test_first_claim_owns_later_claims_are_told_the_owner_and_other_bodies_conflict():
    d = IdempotencyOwners(ttl_s=60)
    assert d.claim("t", "k", "fp", "front-0") == "front-0"
    assert d.claim("t", "k", "fp", "front-1") == "front-0"
    assert d.claim("t", "k", "other", "front-1") == "conflict"
    assert d.claim("u", "k", "other", "front-1") == "front-1"  # another tenant's key


def test_release_keeps_for_the_ttl_or_frees_a_failed_run_and_a_dead_owner_is_replaced():
    d = IdempotencyOwners(ttl_s=0.05)
    d.claim("t", "ok", "fp", "front-0")
    d.release("t", "ok", "front-0", keep=True)
    assert d.claim("t", "ok", "fp", "front-1") == "front-0"  # still replayable there
    d.claim("t", "bad", "fp", "front-0")
    d.release("t", "bad", "front-0", keep=False)  # failed before sending: a retry runs anew
    assert d.claim("t", "bad", "fp", "front-1") == "front-1"
    d.release("t", "bad", "front-0", keep=True)  # not the owner any more: no effect
    assert d.claim("t", "bad", "fp", "front-0") == "front-1"
    assert d.claim("t", "bad", "fp", "front-0", replace="front-1") == "front-0"  # front-1 died
    import time

    time.sleep(0.06)
    assert d.claim("t", "ok", "fp", "front-1") == "front-1"  # expired


def test_a_recorded_run_can_be_looked_up_and_waited_on():
    async def run() -> None:
        store = IdempotencyStore()
        rec, created = store.begin("t", "k", "fp")
        assert created and store.get("t", "k") is rec and store.get("t", "nope") is None
        rec.start(200, {}, "text/event-stream")
        waiter = asyncio.create_task(rec.wait_for(2, 5.0))
        rec.append("a")
        await asyncio.sleep(0.01)
        assert not waiter.done()
        rec.append("b")
        await asyncio.wait_for(waiter, 1.0)
        await rec.wait_for(10, 0.01)  # times out quietly
        rec.finish()
        await asyncio.wait_for(rec.wait_for(10, 5.0), 1.0)  # finished: returns at once

    asyncio.run(run())
