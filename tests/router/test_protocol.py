"""Request/response models, their mapping to SamplingParams, and OpenAI error JSON."""

from __future__ import annotations

import pytest
from baton_serve.router.errors import APIError, to_api_error, validation_error
from baton_serve.router.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionRequest,
    DeltaMessage,
)
from baton_serve.workers.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    OutOfBlocksError,
    OverloadedError,
)
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

USER = [{"role": "user", "content": "hi"}]


def test_chat_request_maps_openai_and_vllm_fields():
    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": USER, "temperature": 0.5, "top_p": 0.9, "n": 3, "stop": "END", "seed": 4,
        "frequency_penalty": 0.1, "presence_penalty": -0.2, "logit_bias": {"17": -100, "3": 2.5},
        "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 2,
        "stop_token_ids": [9], "include_stop_str_in_output": True, "skip_special_tokens": False,
        "cache_salt": "tenant-a", "priority": 3,
    })
    p = req.to_sampling_params(max_tokens=32, logprobs=req.engine_logprobs())
    assert (p.temperature, p.top_p, p.n, p.stop, p.seed) == (0.5, 0.9, 3, ["END"], 4)
    assert p.logit_bias == {17: -100.0, 3: 2.5}
    assert (p.top_k, p.min_p, p.repetition_penalty, p.ignore_eos, p.min_tokens) == (40, 0.05, 1.1, True, 2)
    assert p.stop_token_ids == [9] and p.include_stop_str_in_output and not p.skip_special_tokens
    assert p.max_tokens == 32 and p.logprobs is None
    assert req.cache_salt == "tenant-a" and req.priority == 3


def test_chat_defaults_are_openai_defaults():
    req = ChatCompletionRequest.model_validate({"messages": USER})
    p = req.to_sampling_params(max_tokens=10, logprobs=None)
    assert (p.temperature, p.top_p, p.n, p.top_k, p.stop) == (1.0, 1.0, 1, 0, [])
    assert req.model is None and not req.stream and not req.include_usage


def test_max_completion_tokens_wins_and_logprobs_mapping():
    req = ChatCompletionRequest.model_validate(
        {"messages": USER, "max_tokens": 5, "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 4})
    assert req.requested_max_tokens() == 9 and req.engine_logprobs() == 4
    assert ChatCompletionRequest.model_validate({"messages": USER, "logprobs": True}).engine_logprobs() == 0
    with pytest.raises(InvalidRequestError) as info:
        ChatCompletionRequest.model_validate({"messages": USER, "top_logprobs": 2}).engine_logprobs()
    assert info.value.param == "top_logprobs"


def test_include_usage_only_when_streaming():
    base = {"messages": USER, "stream_options": {"include_usage": True}}
    assert ChatCompletionRequest.model_validate({**base, "stream": True}).include_usage
    assert not ChatCompletionRequest.model_validate(base).include_usage


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_completion_prompt_forms(prompt):
    assert CompletionRequest.model_validate({"prompt": prompt}).prompt == prompt


def test_message_content_parts_and_roles():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": parts},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "r", "tool_call_id": "1"}]})
    dumped = [m.model_dump(exclude_none=True) for m in req.messages]
    assert dumped[1]["content"] == parts and "content" not in dumped[2]
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": [{"role": "wizard", "content": "x"}]})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": []})


@pytest.mark.parametrize("body,param", [
    ({"messages": USER, "temperature": -1}, "temperature"),
    ({"messages": USER, "top_p": 0}, "top_p"),
    ({"messages": USER, "logit_bias": {"x": 1}}, "logit_bias"),
    ({"messages": USER, "logit_bias": {"1": 500}}, "logit_bias"),
    ({"messages": USER, "min_tokens": 50}, "min_tokens"),
])
def test_bad_sampling_values_name_the_param(body, param):
    req = ChatCompletionRequest.model_validate(body)
    with pytest.raises(InvalidRequestError) as info:
        req.to_sampling_params(max_tokens=10, logprobs=None)
    assert info.value.param == param


def test_pydantic_errors_become_400_with_param_path():
    try:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": 5}], "n": 0})
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
    err = validation_error(RequestValidationError(errors))
    assert err.status_code == 400 and err.type == "invalid_request_error"
    assert err.param == "n" and "messages[0].content:" in err.message  # first failing field is the param


def test_exception_mapping():
    err = to_api_error(ContextLengthExceededError("too long", param="max_tokens"))
    assert (err.status_code, err.param, err.message) == (400, "max_tokens", "too long")
    assert to_api_error(OutOfBlocksError("no room")).status_code == 400
    busy = to_api_error(OverloadedError("queue full", retry_after_s=2.5))
    assert (busy.status_code, busy.type, busy.headers) == (429, "rate_limit_error", {"Retry-After": "3"})
    boom = to_api_error(RuntimeError("boom"))
    assert boom.status_code == 500 and boom.body()["error"]["type"] == "server_error"
    nf = APIError(404, "no such model", param="model", code="model_not_found")
    assert nf.body() == {"error": {"message": "no such model", "type": "invalid_request_error",
                                   "param": "model", "code": "model_not_found"}}


def test_delta_serialization_keeps_only_set_keys():
    chunk = ChatCompletionChunk(id="c", created=1, model="m", choices=[
        ChatChunkChoice(index=0, delta=DeltaMessage(role="assistant", content="")),
        ChatChunkChoice(index=1, delta=DeltaMessage(), finish_reason="stop")])
    data = chunk.model_dump(exclude={"usage"})
    assert data["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert data["choices"][1]["delta"] == {} and data["choices"][1]["finish_reason"] == "stop"
    assert data["choices"][0]["finish_reason"] is None and "usage" not in data
    assert chunk.model_dump()["usage"] is None


def test_a_field_this_server_does_not_implement_is_named_in_a_400():
    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest.model_validate({"messages": USER, "modalities": ["audio"]})
    err = validation_error(exc.value)
    assert err.status_code == 400 and err.param == "modalities" and "not supported" in err.message
    with pytest.raises(ValidationError) as exc:
        CompletionRequest.model_validate({"prompt": "x", "use_beam_search": True})
    assert validation_error(exc.value).param == "use_beam_search"


def test_fields_that_change_nothing_in_the_answer_are_accepted():
    req = ChatCompletionRequest.model_validate({"messages": USER, "user": "u-1", "store": False,
                                                "metadata": {"team": "search"}})
    assert req.user == "u-1" and req.metadata == {"team": "search"}
