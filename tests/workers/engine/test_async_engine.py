"""The asyncio front: concurrent streams, cancellation frees KV, errors reach the caller."""

from __future__ import annotations

import asyncio
import threading

import pytest
from baton_serve.workers import LLM, SamplingParams
from baton_serve.workers.engine.async_engine import AsyncEngine
from baton_serve.workers.engine.config import SchedulerConfig
from baton_serve.workers.errors import InvalidRequestError

NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def async_engine(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS)
    eng = AsyncEngine(llm.engine)
    yield eng, llm
    eng.shutdown()


async def _collect(eng: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    toks: list[int] = []
    async for d in eng.generate(rid, prompt, params):
        toks.extend(d.token_ids)
    return toks


def test_concurrent_streams_match_offline_generation(async_engine):
    eng, llm = async_engine
    prompts = [llm.tokenizer.encode(p) for p in ("Hello world", "你好", "def f(x):", "The quick brown")]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(_collect(eng, f"s{i}", p, params) for i, p in enumerate(prompts)))

    streamed = asyncio.run(main())
    # a separate engine: the async one's loop thread owns its engine
    other = LLM(model=str(llm.model_path), dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS)
    offline = [o.outputs[0].token_ids for o in other.generate(prompts, params)]
    assert streamed == offline
    assert eng.stats().num_free_blocks == NUM_BLOCKS
    # routers count the steps a queue of prompts takes by the budget
    assert eng.stats().step_token_budget == llm.engine.config.scheduler.max_num_batched_tokens > 0
    assert eng.stats().prefill_chunk == 0  # no cap on a prompt's tokens below that budget


def test_cancelling_a_stream_aborts_and_frees_blocks(async_engine):
    eng, llm = async_engine
    prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog")

    async def main():
        got = 0
        agen = eng.generate("cancel-me", prompt, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        async for _ in agen:
            got += 1
            if got == 3:
                break
        await agen.aclose()
        for _ in range(100):
            if eng.stats().num_running == 0:
                break
            await asyncio.sleep(0.02)
        return got

    assert asyncio.run(main()) == 3
    stats = eng.stats()
    assert stats.num_running == 0 and stats.num_free_blocks == NUM_BLOCKS


def test_invalid_request_raises_before_queueing(async_engine):
    eng, _ = async_engine

    async def main():
        async for _ in eng.generate("bad", [], SamplingParams()):
            pass

    with pytest.raises(InvalidRequestError):
        asyncio.run(main())
    assert eng.stats().num_waiting == 0


def test_n_samples_finishing_in_the_same_step_all_arrive(async_engine):
    eng, llm = async_engine
    prompt = llm.tokenizer.encode("Hello")

    async def main():
        finished = {}
        async for d in eng.generate("n3", prompt, SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=4)):
            if d.finish_reason:
                finished[d.index] = d.finish_reason
        return finished

    assert asyncio.run(asyncio.wait_for(main(), 30)) == {0: "length", 1: "length", 2: "length"}


def test_the_tenant_reaches_every_sample_of_the_request(async_engine, monkeypatch):
    eng, llm = async_engine
    sched = eng.engine.scheduler
    seen: list[tuple[str, str]] = []
    add, fork = sched.add_request, sched.fork

    def add_and_note(request):
        seen.append((request.request_id, request.tenant))
        add(request)

    def fork_and_note(parent, child):
        seen.append((child.request_id, child.tenant))
        fork(parent, child)

    monkeypatch.setattr(sched, "add_request", add_and_note)
    monkeypatch.setattr(sched, "fork", fork_and_note)

    async def main():
        params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=2)
        async for _ in eng.generate("t2", llm.tokenizer.encode("Hello"), params, tenant="acme"):
            pass

    asyncio.run(asyncio.wait_for(main(), 30))
    assert seen == [("t2#0", "acme"), ("t2#1", "acme")]


def test_a_factory_builds_the_engine_on_the_loop_thread(tiny_model_dir):
    """The Worker passes a factory so that model loading and every step share one thread."""
    from baton_serve.workers.engine.config import EngineConfig
    from baton_serve.workers.llm import build_engine

    built_on: list[str] = []

    def build():
        built_on.append(threading.current_thread().name)
        return build_engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", block_size=8,
                                         num_kv_blocks=NUM_BLOCKS))[0]

    eng = AsyncEngine(build)
    try:
        assert built_on == ["baton-engine"]

        async def run() -> list[int]:
            return await _collect(eng, "f0", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))

        assert len(asyncio.run(run())) == 3
        assert eng.call(lambda e: threading.current_thread().name) == "baton-engine"
    finally:
        eng.shutdown()


def test_a_failing_factory_raises_its_own_error():
    def build():
        raise FileNotFoundError("no model here")

    with pytest.raises(FileNotFoundError, match="no model here"):
        AsyncEngine(build)


def test_a_loop_waiting_for_shared_cores_still_answers_commands(tiny_model_dir, tmp_path, monkeypatch):
    """While another worker holds the cores, the loop keeps handling its inbox (KV reservations,
    admissions, aborts): a command rings its bell. It steps once the cores are free."""
    from baton_serve.workers.actor import core_share
    from baton_serve.workers.actor.core_share import WAITING, CoreShare, create_board

    monkeypatch.setattr(core_share, "_RECHECK_S", 60.0)  # only the bells can wake the loop

    board = create_board(2, directory=str(tmp_path))
    other = CoreShare(board, 0, cores=2, threads=2)
    mine = CoreShare(board, 1, cores=2, threads=2)
    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS)
    eng = AsyncEngine(llm.engine, core_share=mine)
    other.before_step()  # the other worker is mid-step
    try:
        async def run() -> list[int]:
            task = asyncio.create_task(_collect(eng, "w0", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)))
            while other.state()[1][1] != WAITING:  # the loop has work and waits for its turn
                await asyncio.sleep(0.005)
            assert eng.call(lambda e: e.num_waiting, timeout=5.0) == 1  # answered meanwhile
            assert not task.done()
            other.after_step()
            return await asyncio.wait_for(task, 30)

        assert len(asyncio.run(run())) == 3
        assert mine.wait_seconds > 0
    finally:
        eng.shutdown()


class _RecordingShare:
    """Stands in for a CoreShare: records when the loop takes and gives back the cores."""

    wait_seconds = 0.0

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.team_ends: list[int] = []  # len(events) at each release(): when the team was ended

    def before_step(self, on_wake=None) -> None:
        self.events.append("turn")

    def release(self) -> None:
        self.team_ends.append(len(self.events))

    def after_step(self) -> None:
        self.events.append("release")

    def ring(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_call_in_turn_runs_while_holding_the_cores_and_its_requests_join_that_step(tiny_model_dir):
    import time

    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS)
    events: list[str] = []
    step = llm.engine.step

    def recorded_step():
        events.append("step")
        return step()

    llm.engine.step = recorded_step
    eng = AsyncEngine(llm.engine, core_share=_RecordingShare(events))
    try:
        assert eng.call(lambda e: events.append("call") or 1) == 1  # a plain call takes no turn
        assert eng.call_in_turn(lambda e: events.append("in turn") or e.num_running) == 0
        assert events == ["call", "turn", "in turn", "release"]  # idle, yet it asked for the cores
        events.clear()

        def add(e):
            e.add_request("t", [5, 6, 7], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            events.append("added")

        eng.call_in_turn(add)
        deadline = time.monotonic() + 10
        while "release" not in events and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events[:4] == ["turn", "added", "step", "release"]
        with pytest.raises(ZeroDivisionError):  # its error reaches the caller, the loop lives on
            eng.call_in_turn(lambda e: 1 / 0)
        assert eng.is_alive and eng.call_in_turn(lambda e: 2) == 2
    finally:
        eng.shutdown()


def test_a_loop_that_goes_idle_ends_its_team_once(tiny_model_dir):
    """Nothing of an idle worker should spin on shared cores (kernels.openmp.release_team)."""
    import time

    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=8, num_kv_blocks=NUM_BLOCKS)
    events: list[str] = []
    share = _RecordingShare(events)
    eng = AsyncEngine(llm.engine, core_share=share)
    eng.idle_wait_s = 0.01
    try:
        time.sleep(0.1)
        assert share.team_ends == []  # idle from the start: it never had a team to end
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        eng.call(lambda e: e.add_request("t", [5, 6, 7], params))
        deadline = time.monotonic() + 10
        while not share.team_ends and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # idle turns of the loop since then end nothing more
        steps = events.count("turn")
        assert steps >= 3 and share.team_ends == [len(events)]  # once, after the last step's turn
    finally:
        eng.shutdown()


def test_the_prefill_chunk_reported_is_a_cap_below_the_step_s_budget_or_none():
    from baton_serve.workers.engine.stats import _chunk

    assert _chunk(SchedulerConfig(max_num_batched_tokens=1024, max_prefill_chunk=256)) == 256
    assert _chunk(SchedulerConfig(max_num_batched_tokens=1024, max_prefill_chunk=1024)) == 0
    assert _chunk(SchedulerConfig(max_num_batched_tokens=1024)) == 0
