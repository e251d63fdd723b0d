"""OpenAI chat and completions on top of an ``EngineClient``.

A request becomes token ids and ``SamplingParams`` (checked against the context window), runs
as one engine request per prompt, and comes back as one response or as SSE chunks built from
the same per-choice text state, so a streamed response concatenates to the non-streamed one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from baton_serve.router import tools
from baton_serve.router.engine_client import EngineClient
from baton_serve.router.errors import APIError, to_api_error
from baton_serve.router.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ModelCard,
    ModelList,
    SamplingRequest,
    ToolCall,
    UsageInfo,
)
from baton_serve.router.server import ClientGone, EventStreamResponse, run_until_disconnected
from baton_serve.router.stream import (
    SSE_DONE,
    Choices,
    EngineJob,
    EngineRun,
    LogprobFormatter,
    SampleState,
    sse,
)
from baton_serve.router.tool_stream import ToolCallStreamer
from baton_serve.workers.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    OutOfBlocksError,
    OverloadedError,
)
from baton_serve.workers.sampling.structured import DEFAULT_BACKEND, StructuredSpec, make_backend
from baton_serve.workers.text.tokenizer import Tokenizer
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

logger = logging.getLogger(__name__)


@dataclass
class _Call:
    """One HTTP request on its way through: its id, the parsed body and its engine jobs."""

    kind: str  # "chat" | "completion"
    id: str
    body: SamplingRequest
    logprobs: int | None
    jobs: list[EngineJob] = field(default_factory=list)
    echo: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    tool_mode: str | None = None  # auto | required | function:NAME: parse the output for tool calls
    ticket: Any = None  # admission's handle (router.engine_client.Ticket); None: no admission

    def end(self, status: int, choices: Choices | None = None, reason: str | None = None) -> None:
        """Close the ticket once with what the client got (the first exit path to get here wins)."""
        if self.ticket is None:
            return
        if choices is None:
            self.ticket.finish(status, reason or "error")
            return
        usage = choices.usage()
        first = choices.samples[0] if choices.samples else None
        finish = reason or (first.finish_reason if first is not None else None) or "abort"
        if self.tool_mode and first is not None and finish == "stop" and tools.parse(first.text)[1]:
            finish = "tool_calls"
        self.ticket.finish(status, finish, usage.prompt_tokens,
                           usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0,
                           usage.completion_tokens)


def served_names(model_name: str | Sequence[str]) -> list[str]:
    """One served name or several (aliases, as vLLM's ``--served-model-name``), as a list."""
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    if not names:
        raise ValueError("at least one served model name is needed")
    return names


class OpenAIServing:
    """Serves chat and completions for one model through ``client``.

    ``queue_size`` bounds the deltas buffered per request between the engine and the SSE
    writer (see ``EngineRun``).
    """

    def __init__(self, client: EngineClient, tokenizer: Tokenizer, model_name: str | Sequence[str], max_model_len: int,
                 queue_size: int = 64) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.model_names = served_names(model_name)
        self.model_name = self.model_names[0]  # what responses and metrics carry, as vLLM's first name
        self.max_model_len = max_model_len
        self.queue_size = queue_size
        self.logprob_fmt = LogprobFormatter(tokenizer)
        self.created = int(time.time())
        self._grammars: Any = None  # a grammar backend of our own, to refuse a bad one with a 400 up front

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=name, created=self.created, root=self.model_name,
                                         max_model_len=self.max_model_len) for name in self.model_names])

    async def chat(self, body: ChatCompletionRequest, http: Request, ticket: Any = None) -> Response:
        """``POST /v1/chat/completions``: render the chat template, then generate."""
        call = _Call("chat", f"chatcmpl-{uuid.uuid4().hex}", body, body.engine_logprobs(), ticket=ticket)
        return await self._guarded(call, lambda: self._chat(call, http))

    async def _chat(self, call: _Call, http: Request) -> Response:
        body = call.body
        assert isinstance(body, ChatCompletionRequest)
        self._check_model(body.model)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        tool_list = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, BaseModel) else body.tool_choice
        mode = tools.check_choice(tool_list, choice)
        messages, template_tools = tools.render_messages(messages, tool_list, self.tokenizer.renders_tools)
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                    tools=template_tools)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        job = self._job(call, call.id, ids, None, body.requested_max_tokens(), "messages")
        if tool_list and mode != "none":
            call.tool_mode = mode
            spec = tools.grammar(tool_list, mode, body.parallel_tool_calls is not False)
            if spec is not None:
                if job.params.structured_outputs is not None:
                    raise InvalidRequestError("tool_choice required or a named function cannot be combined with "
                                              "another output constraint", param="tool_choice")
                job.params = dataclasses.replace(job.params, structured_outputs=spec.to_dict())
        call.jobs.append(job)
        await self._check_grammar(call)
        return await self._serve(call, http)

    async def completions(self, body: CompletionRequest, http: Request, ticket: Any = None) -> Response:
        """``POST /v1/completions``: a prompt or a batch of prompts, each giving ``n`` choices."""
        call = _Call("completion", f"cmpl-{uuid.uuid4().hex}", body, body.logprobs, echo=body.echo, ticket=ticket)
        return await self._guarded(call, lambda: self._completions(call, http))

    async def _guarded(self, call: _Call, serve: Any) -> Response:
        """Run a request; whatever way it fails before its response exists, its ticket is closed."""
        if call.ticket is not None:
            call.ticket.request_id, call.ticket.endpoint = call.id, call.kind
        try:
            return await serve()
        except BaseException as exc:
            status = _status_of(exc)
            call.end(status, reason="rejected" if status in (429, 503) else "abort" if status == 499 else "error")
            raise

    async def _completions(self, call: _Call, http: Request) -> Response:
        body = call.body
        assert isinstance(body, CompletionRequest)
        self._check_model(body.model)
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of different from n is not supported", param="best_of")
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs needs prompt logprobs, which this server does not "
                           "compute", param="echo")
        prompts = self._completion_prompts(body.prompt)
        for i, (text, ids) in enumerate(prompts):
            rid = call.id if len(prompts) == 1 else f"{call.id}-{i}"
            call.jobs.append(self._job(call, rid, ids, text, body.max_tokens, "prompt"))
        await self._check_grammar(call)
        return await self._serve(call, http)

    async def _check_grammar(self, call: _Call) -> None:
        """Compile the request's grammar here (off the event loop), so one that does not compile is a
        400 naming the reason before anything is queued; the workers' compile caches do the rest."""
        raw = call.jobs[0].params.structured_outputs if call.jobs else None
        if raw is None:
            return
        spec = StructuredSpec.from_dict(raw, param="structured_outputs")
        param = _grammar_param(call.body)
        await asyncio.to_thread(lambda: self._grammar_backend().compile(spec, param))

    def _grammar_backend(self) -> Any:
        if self._grammars is None:
            tok = self.tokenizer
            self._grammars = make_backend(DEFAULT_BACKEND, tok.backend.to_str(),
                                          tok.backend.get_vocab_size(with_added_tokens=True), tok.eos_token_ids)
        return self._grammars

    # ------------------------------------------------------------------ request -> engine jobs
    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def _completion_prompts(self, prompt: Any) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        out: list[tuple[str | None, list[int]]] = []
        for p in prompt:
            if isinstance(p, str):
                out.append((p, self.tokenizer.encode(p, add_special_tokens=True)))
            else:
                out.append((self.tokenizer.decode(p, skip_special_tokens=False), list(p)))
        return out

    def _job(self, call: _Call, request_id: str, ids: list[int], text: str | None, max_tokens: int | None,
             prompt_param: str) -> EngineJob:
        """Engine request for one prompt; absent ``max_tokens`` means the rest of the context."""
        limit, n_prompt = self.max_model_len, len(ids)
        if n_prompt == 0:
            raise InvalidRequestError("the prompt is empty", param=prompt_param)
        if n_prompt >= limit:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {limit} tokens, but the prompt has {n_prompt} "
                "tokens (at least one output token must fit).", param=prompt_param)
        if max_tokens is None:
            max_tokens = limit - n_prompt
        elif n_prompt + max_tokens > limit:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the "
                "completion). Please reduce the prompt or max_tokens.", param="max_tokens")
        body, ticket = call.body, call.ticket
        priority = body.priority if ticket is None else ticket.priority(body.priority)
        salt = body.cache_salt if ticket is None else ticket.cache_salt(body.cache_salt)
        return EngineJob(request_id, ids, body.to_sampling_params(max_tokens, call.logprobs), text,
                         priority=priority, cache_salt=salt, arrival_time=time.monotonic(), ticket=ticket)

    # ------------------------------------------------------------------ running
    async def _serve(self, call: _Call, http: Request) -> Response:
        logger.debug("request %s (%s) user=%s prompts=%d", call.id, call.kind, call.body.user, len(call.jobs))
        choices = Choices(self.client, self.tokenizer, call.jobs)
        run = EngineRun(self.client, self.queue_size)
        handed_off = False
        try:
            await run_until_disconnected(http.receive, run.start(call.jobs))
            choices.grant(getattr(call.ticket, "granted_n", None) or {})
            headers = _degraded_headers(call.ticket)
            if call.body.stream:
                events = self._chat_events if call.kind == "chat" else self._completion_events

                def closed() -> None:  # however the stream ended: a client gone mid-stream included
                    run.cancel()
                    call.end(200, choices, None if choices.done else "abort")

                handed_off = True  # the stream owns ``run`` from here
                return EventStreamResponse(events(call, choices, run), on_close=closed, headers=headers)
            await run_until_disconnected(http.receive, self._drain(choices, run))
        except ClientGone:
            call.end(499, choices, "abort")
            return Response(status_code=499)  # nobody is listening; the engine already aborted
        except Exception as exc:
            raise to_api_error(exc) from exc
        finally:
            if not handed_off:
                await run.close()
        build = self._chat_response if call.kind == "chat" else self._completion_response
        response = JSONResponse(build(call, choices).model_dump(mode="json"), headers=headers)
        call.end(200, choices)
        return response

    async def _updates(self, choices: Choices, run: EngineRun) -> AsyncIterator[tuple[SampleState, str]]:
        """(choice, new text) as deltas arrive, until every choice has finished."""
        ticket = choices.jobs[0].ticket if choices.jobs else None
        while not choices.done:
            delta = await run.next()
            if delta is None:  # streams ended without finishing every sample
                for item in choices.abort_unfinished():
                    yield item
                return
            if delta.token_ids and ticket is not None:
                ticket.mark_first_token()
            item = choices.apply(delta)
            if item is not None:
                yield item

    async def _drain(self, choices: Choices, run: EngineRun) -> None:
        async for _ in self._updates(choices, run):
            pass

    # ------------------------------------------------------------------ responses
    def _chat_response(self, call: _Call, choices: Choices) -> ChatCompletionResponse:
        out = []
        for s in choices.samples:
            content, calls = tools.parse(s.text) if call.tool_mode else (s.text, [])
            message = AssistantMessage(content=content, tool_calls=[
                ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls] or None)
            out.append(ChatChoice(index=s.index, message=message,
                                  logprobs=self._chat_logprobs(call, s.token_ids, s.logprobs, s.top_logprobs),
                                  finish_reason=_tool_finish(s.finish_reason, calls), stop_reason=s.stop_reason))
        return ChatCompletionResponse(id=call.id, created=call.created, model=self.model_name, choices=out,
                                      usage=choices.usage())

    def _completion_response(self, call: _Call, choices: Choices) -> CompletionResponse:
        out = []
        for s in choices.samples:
            prefix = self._echo_text(call, s)
            logprobs = None
            if call.logprobs is not None:
                logprobs, _ = self.logprob_fmt.completion(s.token_ids, s.logprobs, s.top_logprobs, len(prefix))
            out.append(CompletionChoice(index=s.index, text=prefix + s.text, logprobs=logprobs,
                                        finish_reason=s.finish_reason, stop_reason=s.stop_reason))
        return CompletionResponse(id=call.id, created=call.created, model=self.model_name, choices=out,
                                  usage=choices.usage())

    def _chat_logprobs(self, call: _Call, ids: list[int], lps: list[float],
                       tops: list[list[tuple[int, float]]]) -> Any:
        return None if call.logprobs is None else self.logprob_fmt.chat(ids, lps, tops)

    def _echo_text(self, call: _Call, sample: SampleState) -> str:
        if not call.echo:
            return ""
        n = call.jobs[0].params.n
        return call.jobs[sample.index // n].prompt_text or ""

    async def _chat_events(self, call: _Call, choices: Choices, run: EngineRun) -> AsyncIterator[str]:
        def chunk(items: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
            msg = ChatCompletionChunk(id=call.id, created=call.created, model=self.model_name, choices=items,
                                      usage=usage)
            return sse(msg.model_dump_json(exclude=None if call.body.include_usage else {"usage"}))

        streamers = {s.index: ToolCallStreamer() for s in choices.samples} if call.tool_mode else {}
        try:
            for s in choices.samples:
                yield chunk([ChatChunkChoice(index=s.index, delta=DeltaMessage(role="assistant", content=""))])
            async for s, text in self._updates(choices, run):
                if call.tool_mode:
                    # Calls stream as the model writes them: the name once it is complete, then the
                    # arguments' text; what lies outside the blocks streams as content.
                    for item in self._tool_chunks(call, s, streamers[s.index], text):
                        yield chunk([item])
                    continue
                if not text and not s.done:
                    continue  # text held back; its tokens' logprobs go with the next chunk
                ids, lps, tops = s.take_tokens()
                yield chunk([ChatChunkChoice(index=s.index, delta=DeltaMessage(content=text or None),
                                             logprobs=self._chat_logprobs(call, ids, lps, tops),
                                             finish_reason=s.finish_reason, stop_reason=s.stop_reason)])
            if call.body.include_usage:
                yield chunk([], choices.usage())
        except Exception as exc:
            yield sse(json.dumps(to_api_error(exc).body(), ensure_ascii=False))
        finally:
            await run.close()
            call.end(200, choices, None if choices.done else "abort")
        yield SSE_DONE

    def _tool_chunks(self, call: _Call, s: SampleState, streamer: ToolCallStreamer,
                     text: str) -> list[ChatChunkChoice]:
        """The chunks for a sample's new ``text`` (and, once it is done, its end); the tokens'
        logprobs ride on the first chunk that goes out."""
        events = streamer.feed(text or "")
        if s.done:
            events += streamer.finish()
        out = []
        for e in events:
            if e.content is not None:
                delta = DeltaMessage(content=e.content)
            elif e.name is not None:
                delta = DeltaMessage(tool_calls=[DeltaToolCall(index=e.index, id=e.id, type="function",
                                                               function=DeltaFunctionCall(name=e.name, arguments=""))])
            else:
                delta = DeltaMessage(tool_calls=[DeltaToolCall(index=e.index,
                                                               function=DeltaFunctionCall(arguments=e.arguments))])
            out.append(ChatChunkChoice(index=s.index, delta=delta))
        if s.done:
            finish = "tool_calls" if streamer.calls and s.finish_reason == "stop" else s.finish_reason
            out.append(ChatChunkChoice(index=s.index, delta=DeltaMessage(), finish_reason=finish,
                                       stop_reason=s.stop_reason))
        if out and call.logprobs is not None:
            ids, lps, tops = s.take_tokens()
            out[0].logprobs = self._chat_logprobs(call, ids, lps, tops)
        return out

    async def _completion_events(self, call: _Call, choices: Choices, run: EngineRun) -> AsyncIterator[str]:
        def chunk(items: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            msg = CompletionResponse(id=call.id, created=call.created, model=self.model_name, choices=items,
                                     usage=usage)
            return sse(msg.model_dump_json(exclude=None if call.body.include_usage else {"usage"}))

        offsets = {s.index: 0 for s in choices.samples}  # text_offset of the next token
        try:
            for s in choices.samples:
                if prefix := self._echo_text(call, s):
                    offsets[s.index] = len(prefix)
                    yield chunk([CompletionChoice(index=s.index, text=prefix)])
            async for s, text in self._updates(choices, run):
                if not text and not s.done:
                    continue
                ids, lps, tops = s.take_tokens()
                logprobs = None
                if call.logprobs is not None:
                    logprobs, offsets[s.index] = self.logprob_fmt.completion(ids, lps, tops, offsets[s.index])
                yield chunk([CompletionChoice(index=s.index, text=text, logprobs=logprobs,
                                              finish_reason=s.finish_reason, stop_reason=s.stop_reason)])
            if call.body.include_usage:
                yield chunk([], choices.usage())
        except Exception as exc:
            yield sse(json.dumps(to_api_error(exc).body(), ensure_ascii=False))
        finally:
            await run.close()
            call.end(200, choices, None if choices.done else "abort")
        yield SSE_DONE


def _status_of(exc: BaseException) -> int:
    """The HTTP status a failure reaches the client as (499: the client left, or the task was cancelled)."""
    if isinstance(exc, APIError):
        return exc.status_code
    if isinstance(exc, (InvalidRequestError, OutOfBlocksError)):
        return 400
    if isinstance(exc, OverloadedError):
        return 429
    return 500 if isinstance(exc, Exception) else 499


def _degraded_headers(ticket: Any) -> dict[str, str] | None:
    """``X-Baton-Degraded: max_tokens=N`` when admission capped what the request asked for."""
    degraded = getattr(ticket, "degraded", None)
    if not degraded:
        return None
    return {"X-Baton-Degraded": ", ".join(f"{k}={v}" for k, v in sorted(degraded.items()))}


def _tool_finish(finish: str | None, calls: list[Any]) -> str | None:
    """OpenAI ends an answer that is a call with ``tool_calls``, where it would have said ``stop``."""
    return "tool_calls" if calls and finish == "stop" else finish


def _grammar_param(body: Any) -> str:
    """The request field a grammar came from, for the 400's ``param``."""
    for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar", "tools"):
        if getattr(body, name, None) is not None:
            return name
    return "structured_outputs"
