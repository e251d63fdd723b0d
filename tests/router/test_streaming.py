"""Streaming under real HTTP: client disconnects, concurrency, and failures mid-stream."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from baton_serve.router.api import build_app
from baton_serve.router.server import ServerThread
from baton_serve.workers.engine.outputs import TokenDelta
from baton_serve.workers.errors import InvalidRequestError, OverloadedError
from baton_serve.workers.sampling.params import SamplingParams

from tests.router.conftest import MODEL, NUM_BLOCKS, wait_idle


def test_disconnect_aborts_the_request_and_frees_blocks(backend):
    max_tokens = 450
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    events = []
    with httpx.Client(timeout=10) as http, http.stream("POST", backend.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
            if len(events) == 3:
                break  # leaving both blocks closes the connection mid-stream
    request_id = events[0]["id"]
    stats = wait_idle(backend.client)
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.num_free_blocks == NUM_BLOCKS
    assert 3 <= backend.generated[request_id] < max_tokens  # stopped early: aborted, not finished


def test_disconnect_before_a_non_streamed_answer_aborts(backend):
    max_tokens = 450
    before = set(backend.generated)
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": max_tokens, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(backend.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.2))
    stats = wait_idle(backend.client)
    assert stats.num_running == 0 and stats.num_free_blocks == NUM_BLOCKS
    (request_id,) = set(backend.generated) - before
    assert backend.generated[request_id] < max_tokens


def test_sixteen_concurrent_streams(backend):
    stop_prompt = "Paris is the capital of"
    greedy = httpx.post(backend.url + "/v1/completions", json={
        "prompt": stop_prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True}).json()
    reference = greedy["choices"][0]["text"]
    stop = reference[4:7]
    assert len(stop) == 3

    async def one(sdk: openai.AsyncOpenAI, i: int) -> tuple[str, str, str]:
        common = {"model": MODEL, "stream": True, "extra_body": {"ignore_eos": True}}
        kind = i % 4
        if kind == 0:
            stream = await sdk.chat.completions.create(
                messages=[{"role": "user", "content": f"Say something about {i}"}], max_tokens=8 + i,
                temperature=0, **common)
        elif kind == 1:
            stream = await sdk.completions.create(prompt=f"Request {i}:", max_tokens=10, temperature=0.8,
                                                  seed=i, **common)
        elif kind == 2:
            stream = await sdk.completions.create(prompt=stop_prompt, max_tokens=20, temperature=0,
                                                  stop=[stop], **common)
        else:
            stream = await sdk.chat.completions.create(
                messages=[{"role": "user", "content": "Count"}], max_tokens=12, temperature=0.8, seed=i, **common)
        text, finish = await _collect(stream, i)
        return ("stop" if kind == 2 else "length"), finish, text

    async def main() -> list[tuple[str, str, str]]:
        async with openai.AsyncOpenAI(base_url=backend.base_url, api_key="unused", timeout=60,
                                      max_retries=0) as sdk:
            return await asyncio.gather(*(one(sdk, i) for i in range(16)))

    results = asyncio.run(main())
    assert [finish for _, finish, _ in results] == [expected for expected, _, _ in results]
    for i, (expected, _, text) in enumerate(results):
        if expected == "stop":
            assert text == reference[:reference.index(stop)], i
    stats = wait_idle(backend.client)
    assert stats.num_running == 0 and stats.num_free_blocks == NUM_BLOCKS


async def _collect(stream: AsyncIterator, i: int) -> tuple[str, str | None]:
    """(text, finish_reason) of a one-choice stream; nothing may follow the finishing chunk."""
    parts, finish = [], None
    async for chunk in stream:
        for choice in chunk.choices:
            assert finish is None, f"request {i}: a chunk after the finish"
            parts.append((choice.delta.content or "") if hasattr(choice, "delta") else choice.text)
            finish = choice.finish_reason
    return "".join(parts), finish


class _FailingClient:
    """An EngineClient whose stream breaks after ``good`` deltas (or is rejected up front)."""

    def __init__(self, good: int, reject: Exception | None = None) -> None:
        self.good, self.reject, self.closed = good, reject, []

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str | None = None,
                       arrival_time: float | None = None, ticket: object = None) -> AsyncIterator[TokenDelta]:
        if self.reject is not None:
            raise self.reject
        try:
            for _ in range(self.good):
                await asyncio.sleep(0)
                yield TokenDelta(request_id, 0, [prompt_token_ids[0]])
            raise RuntimeError("engine worker died")
        finally:
            self.closed.append(request_id)

    def abort(self, request_id: str) -> None:
        pass

    def finish_sample(self, request_id: str, index: int, stop: str) -> None:
        pass

    def stats(self) -> None:
        return None


@pytest.fixture(scope="module")
def failing_server(backend):
    client = _FailingClient(good=2)
    app = build_app(client, backend.tokenizer, MODEL, 512)
    with ServerThread(app) as server:
        yield server, client


def test_failure_after_stream_started_is_an_error_event(failing_server):
    server, client = failing_server
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert r.status_code == 200
    events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "engine worker died" in error["message"]
    assert client.closed  # the engine iterator was closed


def test_failure_without_streaming_is_a_500(failing_server):
    server, _ = failing_server
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"


@pytest.mark.parametrize("reject,status", [(InvalidRequestError("rejected", param="prompt"), 400),
                                           (OverloadedError("rejected", retry_after_s=2), 429)])
def test_engine_rejection_comes_before_the_stream(backend, reject, status):
    app = build_app(_FailingClient(good=0, reject=reject), backend.tokenizer, MODEL, 512)
    with ServerThread(app) as server:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "stream": True})
    assert r.status_code == status and r.json()["error"]["message"] == "rejected"
    if status == 429:
        assert r.headers["retry-after"] == "2"


def test_server_thread_runs_lifespan_hooks_and_stops(backend):
    calls = []

    async def async_stop() -> None:
        calls.append("async-stop")

    app = build_app(backend.client, backend.tokenizer, MODEL, 512, on_startup=[lambda: calls.append("start")],
                    on_shutdown=[async_stop])
    server = ServerThread(app).start()
    assert calls == ["start"]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 404  # no registry given
    start = time.monotonic()
    server.stop()
    assert time.monotonic() - start < 5 and calls == ["start", "async-stop"]
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health")


def test_failing_startup_hook_fails_start(backend):
    def boom() -> None:
        raise RuntimeError("pool did not come up")

    server = ServerThread(build_app(backend.client, backend.tokenizer, MODEL, 512, on_startup=[boom]))
    with pytest.raises(RuntimeError, match="failed to start"):
        server.start(timeout=10)
    server.stop()
