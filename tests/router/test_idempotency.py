"""IdempotencyStore and RecordedResponse: attach, replay, conflicts, expiry, eviction, abandonment."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from baton_serve.router.idempotency import (
    IdempotencyConflict,
    IdempotencyStore,
    IdempotencyStoreFull,
    RecordedResponse,
)
from hypothesis import given, settings
from hypothesis import strategies as st

FP = IdempotencyStore.fingerprint(b'{"prompt": "hi"}', "/v1/completions")
SSE = "text/event-stream"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def collect(run: RecordedResponse, after: int = -1) -> list[tuple[int, str]]:
    return [item async for item in run.replay(after)]


def test_concurrent_begin_attaches_and_replays_every_chunk_once_in_order():
    store = IdempotencyStore()

    async def main():
        attached = asyncio.Event()
        got: list[tuple[int, str]] = []

        async def writer():
            run, created = store.begin("t1", "k", FP)
            assert created
            with run.listening():
                run.start(200, {"x-request-id": "r1"}, SSE)
                run.append("e0")
                run.append("e1")
                await attached.wait()
                for i in range(2, 5):
                    run.append(f"e{i}")
                    await asyncio.sleep(0)
                run.finish()

        async def retry():
            await asyncio.sleep(0)
            run, created = store.begin("t1", "k", FP)
            assert not created
            await run.wait_started()
            assert (run.status, run.headers, run.media_type) == (200, {"x-request-id": "r1"}, SSE)
            async for item in run.replay():
                got.append(item)
                attached.set()

        await asyncio.wait_for(asyncio.gather(writer(), retry()), 2)
        assert got == [(i, f"e{i}") for i in range(5)]
        assert store.stats() == {"live": 0, "finished": 1}

    asyncio.run(main())


def test_replay_after_last_event_id_skips_earlier_chunks():
    async def main():
        run = RecordedResponse()
        run.start(200, {}, SSE)
        for i in range(3):
            run.append(f"e{i}")
        task = asyncio.create_task(collect(run, after=1))
        await asyncio.sleep(0)
        run.append("e3")
        run.finish()
        assert await asyncio.wait_for(task, 1) == [(2, "e2"), (3, "e3")]

    asyncio.run(main())


def test_replay_after_finish_gets_everything_and_ends():
    async def main():
        run = RecordedResponse()
        run.start(200, {"content-type": "application/json"}, "application/json")
        run.append('{"id": "cmpl-1"}')
        run.finish()
        run.finish()  # idempotent
        assert await asyncio.wait_for(collect(run), 1) == [(0, '{"id": "cmpl-1"}')]
        assert await asyncio.wait_for(collect(run, after=0), 1) == []
        assert run.listeners == 0

    asyncio.run(main())


def test_replay_counts_as_listener_while_active():
    async def main():
        run = RecordedResponse()
        run.start(200, {}, SSE)
        task = asyncio.create_task(collect(run))
        await asyncio.sleep(0)
        assert run.listeners == 1
        run.finish()
        await task
        assert run.listeners == 0

    asyncio.run(main())


def test_different_fingerprint_conflicts():
    store = IdempotencyStore()
    store.begin("t1", "k", FP)
    other = IdempotencyStore.fingerprint(b'{"prompt": "bye"}', "/v1/completions")
    with pytest.raises(IdempotencyConflict, match="different request body"):
        store.begin("t1", "k", other)


def test_scope_separates_tenants():
    store = IdempotencyStore()
    a, created_a = store.begin("tenant-a", "k", FP)
    b, created_b = store.begin("tenant-b", "k", FP)
    assert created_a and created_b and a is not b
    other = IdempotencyStore.fingerprint(b"{}", "/v1/completions")
    c, created_c = store.begin("tenant-c", "k", other)  # no conflict across tenants
    assert created_c and len(store) == 3


def test_fingerprint_ignores_whitespace_and_key_order_not_values_or_path():
    fp = IdempotencyStore.fingerprint
    base = fp(b'{"model": "m", "max_tokens": 8}', "/v1/completions")
    assert fp(b'{ "max_tokens" : 8,\n  "model":"m" }', "/v1/completions") == base
    assert fp(b'{"model": "m", "max_tokens": 9}', "/v1/completions") != base
    assert fp(b'{"model": "m", "max_tokens": 8}', "/v1/chat/completions") != base
    assert fp(b"not json", "/v1/completions") == fp(b"not json", "/v1/completions")
    assert fp(b"not json", "/v1/completions") != fp(b"not  json", "/v1/completions")
    assert fp(b"\xff\xfe", "/p") != fp(b"\xff", "/p")


def test_key_too_long_is_rejected():
    store = IdempotencyStore()
    store.begin("t", "k" * 255, FP)
    with pytest.raises(ValueError, match="1 to 255 characters, got 256"):
        store.begin("t", "k" * 256, FP)
    with pytest.raises(ValueError, match="got 0"):
        store.begin("t", "", FP)


def test_config_is_validated():
    with pytest.raises(ValueError, match="ttl_s"):
        IdempotencyStore(ttl_s=0)
    with pytest.raises(ValueError, match="max_entries"):
        IdempotencyStore(max_entries=0)
    with pytest.raises(ValueError, match="grace_s"):
        IdempotencyStore(grace_s=-1)


def test_ttl_expires_finished_entries_never_live_ones():
    clock = FakeClock()
    store = IdempotencyStore(ttl_s=60, clock=clock)
    done, _ = store.begin("t", "done", FP)
    live, _ = store.begin("t", "live", FP)
    done.start(200, {}, "application/json")
    done.append("{}")
    done.finish()
    clock.now += 59.9
    assert store.begin("t", "done", FP) == (done, False)
    clock.now += 0.1
    assert store.stats() == {"live": 1, "finished": 0}
    clock.now += 10_000
    assert store.begin("t", "live", FP) == (live, False)
    again, created = store.begin("t", "done", FP)
    assert created and again is not done


def test_eviction_takes_earliest_finished_first_then_refuses_when_all_live():
    clock = FakeClock()
    store = IdempotencyStore(max_entries=3, clock=clock)
    runs = {k: store.begin("t", k, FP)[0] for k in ("a", "b", "c")}
    runs["b"].finish()
    clock.now += 1
    runs["a"].finish()
    store.begin("t", "d", FP)
    assert store.begin("t", "a", FP)[1] is False  # b went first: it finished first
    store.begin("t", "e", FP)
    assert store.begin("t", "c", FP)[1] is False  # a went next; c is live
    assert store.stats() == {"live": 3, "finished": 0}
    with pytest.raises(IdempotencyStoreFull):
        store.begin("t", "f", FP)
    assert store.begin("t", "c", FP) == (runs["c"], False)  # attaching needs no room


def test_fail_before_any_chunk_drops_entry_so_retry_generates_anew():
    async def main():
        store = IdempotencyStore()
        run, _ = store.begin("t", "k", FP)
        waiter = asyncio.create_task(collect(run))
        await asyncio.sleep(0)
        run.start(200, {}, SSE)  # headers recorded but no byte sent yet
        run.fail(503, '{"error": "overloaded"}')
        assert await asyncio.wait_for(waiter, 1) == [(0, '{"error": "overloaded"}')]
        assert (run.status, run.media_type, run.failed) == (503, "application/json", True)
        assert len(store) == 0
        again, created = store.begin("t", "k", FP)
        assert created and again is not run
        run.finish()  # a late finish on the dropped run must not touch the new entry
        assert store.stats() == {"live": 1, "finished": 0}

    asyncio.run(main())


def test_fail_after_streaming_started_keeps_the_run():
    store = IdempotencyStore()
    run, _ = store.begin("t", "k", FP)
    run.start(200, {}, SSE)
    run.append("e0")
    run.fail(500, 'event: error\ndata: {"error": "boom"}\n\n')
    assert (run.status, run.finished, run.failed) == (200, True, False)
    assert run.chunks == ["e0", 'event: error\ndata: {"error": "boom"}\n\n']
    assert store.begin("t", "k", FP) == (run, False)


def test_on_abandoned_fires_once_after_grace_without_listeners():
    async def main():
        fired: list[int] = []
        run = RecordedResponse(grace_s=0.05, on_abandoned=lambda: fired.append(1))
        run.start(200, {}, SSE)
        with run.listening():
            await asyncio.sleep(0.08)  # grace only starts once the count drops to 0
        assert fired == []
        await asyncio.sleep(0.1)
        assert fired == [1]
        run.attach()
        run.detach()
        await asyncio.sleep(0.1)
        assert fired == [1]

    asyncio.run(main())


def test_on_abandoned_does_not_fire_when_someone_attaches_within_grace():
    async def main():
        fired: list[int] = []
        # a wide grace so a stalled shared core cannot push the re-attach past it
        run = RecordedResponse(grace_s=0.2, on_abandoned=lambda: fired.append(1))
        run.start(200, {}, SSE)
        run.attach()
        run.detach()
        await asyncio.sleep(0.01)
        retry = asyncio.create_task(collect(run))  # a retry re-attaches through replay
        await asyncio.sleep(0.3)
        assert fired == [] and run.listeners == 1
        run.finish()
        await retry
        await asyncio.sleep(0.3)
        assert fired == []  # a finished run is never abandoned

    asyncio.run(main())


def test_store_runs_use_its_grace():
    async def main():
        fired: list[str] = []
        store = IdempotencyStore(grace_s=0.02)
        run, _ = store.begin("t", "k", FP)
        run.on_abandoned = lambda: fired.append("k")
        run.attach()
        run.detach()
        await asyncio.sleep(0.08)
        assert fired == ["k"]

    asyncio.run(main())


def test_misuse_is_reported():
    run = RecordedResponse()
    with pytest.raises(RuntimeError, match="before start"):
        run.append("x")
    run.start(200, {}, SSE)
    with pytest.raises(RuntimeError, match="twice"):
        run.start(200, {}, SSE)
    with pytest.raises(RuntimeError, match="without a matching attach"):
        run.detach()
    run.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        run.append("x")


# One op per step: append a chunk, start a replayer after some index, or let the loop run a while.
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.just(0)),
        st.tuples(st.just("replay"), st.integers(-1, 12)),
        st.tuples(st.just("yield"), st.integers(1, 3)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, slow=st.lists(st.booleans(), min_size=1, max_size=8))
def test_every_replayer_sees_exact_sequence_from_its_start(ops, slow):
    async def replayer(run: RecordedResponse, after: int, n: int) -> list[tuple[int, str]]:
        got = []
        async with contextlib.aclosing(run.replay(after)) as it:
            async for item in it:
                got.append(item)
                if slow[(n + len(got)) % len(slow)]:
                    await asyncio.sleep(0)
        return got

    async def main():
        run = RecordedResponse()
        run.start(200, {}, SSE)
        tasks = []
        for op, arg in ops:
            if op == "append":
                run.append(f"e{len(run.chunks)}")
            elif op == "replay":
                tasks.append((arg, asyncio.create_task(replayer(run, arg, len(tasks)))))
            else:
                for _ in range(arg):
                    await asyncio.sleep(0)
        run.append(f"e{len(run.chunks)}")
        run.finish()
        total = len(run.chunks)
        for after, task in tasks:
            got = await asyncio.wait_for(task, 1)
            assert got == [(i, f"e{i}") for i in range(after + 1, total)]
        assert run.listeners == 0

    asyncio.run(main())
