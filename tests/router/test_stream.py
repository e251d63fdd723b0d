"""Unit tests of the per-request stream machinery: bounded queue, rejection cleanup, text state."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from baton_serve.router.stream import Choices, EngineJob, EngineRun, LogprobFormatter
from baton_serve.workers.engine.outputs import TokenDelta
from baton_serve.workers.errors import InvalidRequestError
from baton_serve.workers.sampling.params import SamplingParams
from baton_serve.workers.text.tokenizer import Tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st


class _EndlessClient:
    """Yields deltas forever, counting how many were pulled; rejects prompts starting with 0."""

    def __init__(self) -> None:
        self.pulled: dict[str, int] = {}
        self.closed: list[str] = []
        self.finished: list[tuple[str, int, str]] = []

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str | None = None,
                       arrival_time: float | None = None, ticket: object = None) -> AsyncIterator[TokenDelta]:
        if prompt_token_ids[0] == 0:
            raise InvalidRequestError("bad prompt", param="prompt")
        self.pulled[request_id] = 0
        try:
            while True:
                self.pulled[request_id] += 1
                yield TokenDelta(request_id, 0, [prompt_token_ids[0]])
                await asyncio.sleep(0)
        finally:
            self.closed.append(request_id)

    def abort(self, request_id: str) -> None:
        pass

    def finish_sample(self, request_id: str, index: int, stop: str) -> None:
        self.finished.append((request_id, index, stop))

    def stats(self) -> None:
        return None


def _job(rid: str, first: int) -> EngineJob:
    return EngineJob(rid, [first, 5], SamplingParams(max_tokens=8))


def test_slow_consumer_bounds_buffering_and_close_stops_producers():
    client = _EndlessClient()

    async def main() -> None:
        run = EngineRun(client, queue_size=4)
        await run.start([_job("a", 7), _job("b", 8)])
        for _ in range(50):  # the consumer sleeps; producers must stall on the full queue
            await asyncio.sleep(0)
        assert sum(client.pulled.values()) <= 4 + 2 * 2
        assert (await run.next()).request_id in ("a", "b")
        await run.close()
        assert sorted(client.closed) == ["a", "b"]

    asyncio.run(main())


def test_rejected_job_closes_the_others():
    client = _EndlessClient()

    async def main() -> None:
        run = EngineRun(client)
        with pytest.raises(InvalidRequestError):
            await run.start([_job("ok", 7), _job("bad", 0), _job("ok2", 9)])
        await asyncio.sleep(0.01)

    asyncio.run(main())
    assert set(client.closed) == set(client.pulled)  # every started stream was closed


def _deltas(rid: str, ids: list[int], cuts: list[int], finish: str = "length") -> list[TokenDelta]:
    bounds = sorted({0, len(ids), *[c % (len(ids) + 1) for c in cuts]})
    out = [TokenDelta(rid, 0, ids[a:b]) for a, b in zip(bounds, bounds[1:])]
    out[-1].finish_reason = finish
    return out


TEXTS = ["Hello world! How are you today?", "你好，世界！今天天气很好。", "Emoji 🙂👍🏽 and e\u0301 n\u0303."]


@settings(max_examples=40, deadline=None)
@given(text=st.sampled_from(TEXTS), cuts=st.lists(st.integers(0, 60), max_size=8), stop_at=st.integers(1, 20),
       stop_len=st.integers(1, 4))
def test_choice_text_is_chunking_independent(tiny_tokenizer, text, cuts, stop_at, stop_len):
    ids = tiny_tokenizer.encode(text)
    full = tiny_tokenizer.decode(ids)
    stop = full[stop_at % len(full):][:stop_len] or full[-1]
    client = _EndlessClient()
    params = SamplingParams(max_tokens=64, stop=[stop])
    choices = Choices(client, tiny_tokenizer, [EngineJob("r", [1], params)])
    released = []
    for d in _deltas("r", ids, cuts):
        item = choices.apply(d)
        if item is not None:
            assert "\ufffd" not in item[1] or "\ufffd" in full
            released.append(item[1])
    sample = choices.samples[0]
    assert "".join(released) == sample.text == full[:full.index(stop)]
    assert sample.finish_reason == "stop" and sample.stop_reason == stop
    assert client.finished in ([], [("r", 0, stop)])  # told once, unless the engine had already finished


def test_unfinished_samples_end_as_abort(tiny_tokenizer):
    choices = Choices(_EndlessClient(), tiny_tokenizer, [EngineJob("r", [1], SamplingParams(n=2))])
    choices.apply(TokenDelta("r", 0, tiny_tokenizer.encode("Hello"), finish_reason="length"))
    choices.apply(TokenDelta("r", 1, tiny_tokenizer.encode("Hi")))
    ended = choices.abort_unfinished()
    assert [(s.index, s.finish_reason) for s, _ in ended] == [(1, "abort")]
    assert choices.done and choices.samples[1].text == "Hi"
    expected = len(tiny_tokenizer.encode("Hello")) + len(tiny_tokenizer.encode("Hi"))
    assert choices.usage().completion_tokens == expected


def test_logprob_bytes_rebuild_the_text(tiny_tokenizer):
    fmt = LogprobFormatter(tiny_tokenizer)
    for text in TEXTS:
        ids = tiny_tokenizer.encode(text)
        raw = b"".join(bytes(fmt.token(i)[1]) for i in ids)
        assert raw.decode("utf-8") == text
    chat = fmt.chat(ids[:2], [-0.5, float("-inf")], [[(ids[0], -0.5)], [(ids[1], float("-inf"))]])
    assert chat.content[1].logprob == -9999.0 and chat.content[0].top_logprobs[0].token == fmt.token(ids[0])[0]
    comp, end = fmt.completion(ids[:3], [-1.0, -2.0, -3.0], [], offset=5)
    assert comp.text_offset[0] == 5 and comp.top_logprobs == [None, None, None]
    assert end == 5 + sum(len(t) for t in comp.tokens)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_folder(tiny_model_dir)
