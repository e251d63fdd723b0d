"""Per-request streams: engine iterators in, per-choice text out.

``EngineRun`` drives the engine streams of one HTTP request (one per prompt) through a bounded
queue; ``Choices`` keeps each choice's text state (incremental UTF-8-safe detokenization, then
stop-string hold-back) so streamed and non-streamed responses are built from the same text.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import tokenizers
from baton_serve.router.engine_client import EngineClient
from baton_serve.router.protocol import (
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)
from baton_serve.workers.engine.outputs import TokenDelta
from baton_serve.workers.sampling.params import SamplingParams
from baton_serve.workers.text.detokenizer import IncrementalDetokenizer
from baton_serve.workers.text.stop_strings import StopStringMatcher
from baton_serve.workers.text.tokenizer import Tokenizer

SSE_DONE = "data: [DONE]\n\n"
_END = object()  # a producer's engine iterator is exhausted


def sse(payload: str) -> str:
    """One server-sent event carrying a JSON payload."""
    return f"data: {payload}\n\n"


@dataclass
class EngineJob:
    """One engine request: a prompt of the HTTP request with its sampling parameters."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float | None = None
    ticket: Any = None  # the request's admission ticket (router.engine_client.Ticket), if any


class EngineRun:
    """The engine streams of one HTTP request, merged into one bounded queue.

    Backpressure: one producer task per engine iterator puts deltas into an
    ``asyncio.Queue(maxsize=queue_size)``. When the consumer (the SSE writer, itself held back
    by the socket through uvicorn's flow control) falls behind, the queue fills and producers
    await ``put`` instead of pulling their iterators, so this layer never buffers more than
    ``queue_size`` deltas per request (the engine's own per-request buffer holds token ids only,
    at most ``max_tokens`` of them).

    Closing (``cancel``/``close``) cancels the producers, which close their engine iterators:
    the engine aborts whatever is unfinished and frees its KV blocks.
    """

    def __init__(self, client: EngineClient, queue_size: int = 64) -> None:
        self._client = client
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=queue_size)
        self._tasks: list[asyncio.Task[None]] = []
        self._live = 0

    async def start(self, jobs: list[EngineJob]) -> None:
        """Submit every job; return once each has produced its first delta.

        The engine validates a request before its first delta, so if any job is rejected this
        raises that error after closing the others: nothing stays queued or allocated.
        """
        loop = asyncio.get_running_loop()
        primed = [loop.create_future() for _ in jobs]
        for job, fut in zip(jobs, primed):
            it = self._client.generate(job.request_id, job.prompt_token_ids, job.params,
                                       priority=job.priority, cache_salt=job.cache_salt,
                                       arrival_time=job.arrival_time, ticket=job.ticket)
            self._tasks.append(asyncio.create_task(self._produce(it, fut)))
        self._live = len(jobs)
        try:
            for next_done in asyncio.as_completed(primed):
                await next_done
        except BaseException:
            self.cancel()
            for fut in primed:  # mark every outcome retrieved; the first error is raised
                if fut.done() and not fut.cancelled():
                    fut.exception()
            raise

    async def _produce(self, it: Any, primed: asyncio.Future[None]) -> None:
        item: Any = _END
        try:
            async for delta in it:
                if not primed.done():
                    primed.set_result(None)  # before put: a full queue must not block start()
                await self._queue.put(delta)
        except asyncio.CancelledError:
            if not primed.done():
                primed.cancel()
            raise
        except Exception as exc:
            if not primed.done():
                primed.set_exception(exc)
                return
            item = exc
        finally:
            await it.aclose()  # no-op when exhausted; aborts the engine request otherwise
        if not primed.done():
            primed.set_result(None)
        await self._queue.put(item)

    async def next(self) -> TokenDelta | None:
        """The next delta of any job; None once every engine iterator has ended.

        Raises the error an engine stream failed with after it started.
        """
        while self._live:
            item = await self._queue.get()
            if item is _END:
                self._live -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            return item
        return None

    def cancel(self) -> None:
        """Stop every producer now (synchronous, so it also works inside a cancelled scope)."""
        for task in self._tasks:
            task.cancel()

    async def close(self) -> None:
        """Cancel the producers and wait until their engine iterators are closed."""
        self.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)


class SampleState:
    """One choice: token ids, logprobs, released text and finish reason.

    Contract: text returned by ``update`` never holds a broken UTF-8 character nor anything
    that may still turn out to be part of a stop string, and its concatenation does not
    depend on how the engine chunked the token ids.
    """

    def __init__(self, tokenizer: Tokenizer, job: EngineJob, index: int) -> None:
        params = job.params
        self.index = index
        self.detok = IncrementalDetokenizer(tokenizer, job.prompt_token_ids, params.skip_special_tokens)
        self.stops = (StopStringMatcher(params.stop, params.include_stop_str_in_output)
                      if params.stop else None)
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._taken = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def update(self, delta: TokenDelta) -> tuple[str, str | None]:
        """Apply a delta; return (text now safe to emit, stop string the engine must be told of).

        Deltas arriving after the sample finished (the engine ran on while a stop string was
        being reported) are ignored.
        """
        if self.done:
            return "", None
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs or [])
        self.top_logprobs.extend(delta.top_logprobs or [])
        finished = delta.finish_reason is not None
        text = self.detok.step(delta.token_ids) if delta.token_ids else ""
        if finished:
            text += self.detok.flush()
        matched = None
        if self.stops is not None:
            text, matched = self.stops.feed(text)
            if matched is None and finished:
                text += self.stops.flush()  # may settle a match that waited on a longer one
                matched = self.stops.matched
        self.text += text
        if matched is not None:
            self.finish_reason, self.stop_reason = "stop", matched
            return text, None if finished else matched
        if finished:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        return text, None

    def take_tokens(self) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
        """Token ids (with logprobs) not handed out by an earlier call: one stream chunk's worth."""
        start, self._taken = self._taken, len(self.token_ids)
        return (self.token_ids[start:], self.logprobs[start:], self.top_logprobs[start:])


class Choices:
    """Every choice of one HTTP request: choice ``p * n + i`` is sample ``i`` of prompt ``p``."""

    def __init__(self, client: EngineClient, tokenizer: Tokenizer, jobs: list[EngineJob]) -> None:
        self.client = client
        self.jobs = jobs
        self.samples: list[SampleState] = []
        self._by_key: dict[tuple[str, int], SampleState] = {}  # (request id, sample index) -> its choice
        self._cached: dict[str, int] = {}
        for job in jobs:
            base = len(self.samples)
            for i in range(job.params.n):
                sample = SampleState(tokenizer, job, base + i)
                self.samples.append(sample)
                self._by_key[(job.request_id, i)] = sample

    def grant(self, granted_n: dict[str, int]) -> None:
        """Admission ran fewer samples than asked for these requests (degraded ``n``): their other
        choices are not in the response (the rest keep their indices)."""
        for (rid, i), sample in list(self._by_key.items()):
            if i >= granted_n.get(rid, i + 1):
                del self._by_key[(rid, i)]
                self.samples.remove(sample)

    @property
    def done(self) -> bool:
        return all(s.done for s in self.samples)

    def apply(self, delta: TokenDelta) -> tuple[SampleState, str] | None:
        """Route a delta to its choice; on a stop-string match, stop that sample in the engine."""
        sample = self._by_key.get((delta.request_id, delta.index))
        if sample is None:
            return None
        self._cached[delta.request_id] = max(self._cached.get(delta.request_id, 0), delta.num_cached_tokens)
        was_done = sample.done
        text, stop = sample.update(delta)
        if stop is not None:
            self.client.finish_sample(delta.request_id, delta.index, stop)
        return None if was_done else (sample, text)

    def abort_unfinished(self) -> list[tuple[SampleState, str]]:
        """The engine streams ended early: finish what is left as "abort", flushing held text."""
        out = []
        for (rid, i), sample in list(self._by_key.items()):
            if not sample.done:
                result = self.apply(TokenDelta(rid, i, [], finish_reason="abort"))
                if result is not None:
                    out.append(result)
        return out

    def usage(self) -> UsageInfo:
        """Prompt tokens count once per prompt; completion tokens sum over every choice."""
        prompt = sum(len(j.prompt_token_ids) for j in self.jobs)
        completion = sum(len(s.token_ids) for s in self.samples)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self._cached.values())))


def _byte_level_alphabet() -> dict[str, int]:
    """Inverse of byte-level BPE's byte -> printable character table (GPT-2 and descendants)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table = {b: b for b in printable}
    shift = 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + shift
            shift += 1
    return {chr(c): b for b, c in table.items()}


_BYTE_LEVEL = MappingProxyType(_byte_level_alphabet())
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback pieces
_MIN_LOGPROB = -9999.0  # JSON has no -inf


class LogprobFormatter:
    """Token strings and raw bytes for logprobs, in OpenAI's chat and completions shapes.

    ``bytes`` are the token's own bytes (a token may hold part of a UTF-8 character); the
    ``token`` string is those bytes decoded with U+FFFD for an incomplete character.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_level = isinstance(tokenizer.backend.decoder, tokenizers.decoders.ByteLevel)
        self._added = set(tokenizer.backend.get_added_tokens_decoder())
        self._cache: dict[int, tuple[str, list[int]]] = {}  # bounded by the vocabulary

    def token(self, token_id: int) -> tuple[str, list[int]]:
        """(display string, bytes) of one token id."""
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            hit = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return hit

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added:
            return piece.encode()
        if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        if m := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def chat(self, ids: list[int], lps: list[float], tops: list[list[tuple[int, float]]]) -> ChatChoiceLogprobs:
        """``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}``."""
        content = []
        for i, (tid, lp) in enumerate(zip(ids, lps)):
            tok, raw = self.token(tid)
            alts = [TopLogprob(token=self.token(a)[0], logprob=_clamp(v), bytes=self.token(a)[1])
                    for a, v in (tops[i] if i < len(tops) else [])]
            content.append(ChatTokenLogprob(token=tok, logprob=_clamp(lp), bytes=raw, top_logprobs=alts))
        return ChatChoiceLogprobs(content=content)

    def completion(self, ids: list[int], lps: list[float], tops: list[list[tuple[int, float]]],
                   offset: int) -> tuple[CompletionLogprobs, int]:
        """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` and the next offset."""
        out = CompletionLogprobs()
        for i, (tid, lp) in enumerate(zip(ids, lps)):
            tok = self.token(tid)[0]
            out.tokens.append(tok)
            out.token_logprobs.append(_clamp(lp))
            out.text_offset.append(offset)
            out.top_logprobs.append({self.token(a)[0]: _clamp(v) for a, v in tops[i]} if i < len(tops) else None)
            offset += len(tok)
        return out, offset


def _clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)
