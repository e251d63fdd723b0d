"""Turns the engine's token deltas into text: incremental detokenization and stop strings.

Runs beside the engine (offline API) or in the HTTP front; it never touches KV. When a stop
string matches, it tells the caller which samples to finish so the engine frees them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from baton_serve.workers.engine.outputs import CompletionOutput, RequestOutput, TokenDelta
from baton_serve.workers.sampling.params import SamplingParams
from baton_serve.workers.text.detokenizer import IncrementalDetokenizer
from baton_serve.workers.text.stop_strings import StopStringMatcher
from baton_serve.workers.text.tokenizer import Tokenizer


@dataclass
class _SampleState:
    detok: IncrementalDetokenizer
    stops: StopStringMatcher | None
    output: CompletionOutput
    done: bool = False


@dataclass
class _RequestState:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: dict[int, _SampleState] = field(default_factory=dict)
    num_cached_tokens: int = 0


@dataclass
class StopMatch:
    """A stop string matched: the engine must finish this sample."""

    request_id: str
    index: int
    stop: str


class OutputProcessor:
    """Accumulates per-request text; ``process`` returns updated outputs and stop-string matches."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        self.requests[request_id] = _RequestState(prompt, list(prompt_token_ids), params)

    def _sample(self, state: _RequestState, index: int) -> _SampleState:
        sample = state.samples.get(index)
        if sample is None:
            p = state.params
            sample = _SampleState(
                IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids, p.skip_special_tokens),
                StopStringMatcher(p.stop, p.include_stop_str_in_output) if p.stop else None,
                CompletionOutput(index, "", [], logprobs=[] if p.logprobs is not None else None,
                                 top_logprobs=[] if p.logprobs else None),
            )
            state.samples[index] = sample
        return sample

    def process(self, deltas: Sequence[TokenDelta]) -> tuple[list[RequestOutput], list[StopMatch]]:
        """Apply one step's deltas. Returns outputs of touched requests and new stop matches."""
        touched: dict[str, RequestOutput] = {}
        matches: list[StopMatch] = []
        for d in deltas:
            state = self.requests.get(d.request_id)
            if state is None:
                continue
            sample = self._sample(state, d.index)
            if sample.done:
                continue
            state.num_cached_tokens = d.num_cached_tokens
            out = sample.output
            out.token_ids.extend(d.token_ids)
            if d.logprobs is not None and out.logprobs is not None:
                out.logprobs.extend(d.logprobs)
            if d.top_logprobs is not None and out.top_logprobs is not None:
                out.top_logprobs.extend(d.top_logprobs)
            text = sample.detok.step(d.token_ids) if d.token_ids else ""
            finished = d.finish_reason is not None
            if finished:
                text += sample.detok.flush()
            if sample.stops is not None:
                text, matched = sample.stops.feed(text)
                if matched is None and finished:
                    text += sample.stops.flush()  # may settle a deferred match
                    matched = sample.stops.matched
                if matched is not None:
                    out.text += text
                    out.finish_reason, out.stop_reason = "stop", matched
                    sample.done = True
                    if not finished:
                        matches.append(StopMatch(d.request_id, d.index, matched))
                    touched[d.request_id] = self._snapshot(d.request_id, state)
                    continue
            out.text += text
            if finished:
                out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
                sample.done = True
            touched[d.request_id] = self._snapshot(d.request_id, state)
        return list(touched.values()), matches

    def _snapshot(self, request_id: str, state: _RequestState) -> RequestOutput:
        n = state.params.n
        outputs = [state.samples[i].output for i in sorted(state.samples)]
        finished = len(outputs) == n and all(s.done for s in state.samples.values())
        if finished:
            del self.requests[request_id]
        return RequestOutput(request_id, state.prompt, state.prompt_token_ids, outputs, finished,
                             num_cached_tokens=state.num_cached_tokens)

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
