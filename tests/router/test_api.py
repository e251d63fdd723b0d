"""The OpenAI-compatible API over real HTTP: the official SDK for the main cases, httpx for raw
SSE and error JSON."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.router.conftest import MODEL, NUM_BLOCKS, wait_idle

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello world!"}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def sdk(backend) -> openai.OpenAI:
    return openai.OpenAI(base_url=backend.base_url, api_key="unused", timeout=30, max_retries=0)


def sse_events(response: httpx.Response) -> list[str]:
    """Payloads of every ``data:`` event, checking the framing on the way."""
    raw = response.read().decode()
    assert raw.endswith("\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


def test_health_ready_models_metrics(backend, sdk):
    assert httpx.get(backend.url + "/health").status_code == 200
    r = httpx.get(backend.url + "/ready")
    assert r.status_code == 503 and r.json()["error"]["type"]
    backend.ready.set()
    assert httpx.get(backend.url + "/ready").status_code == 200
    assert [m.id for m in sdk.models.list().data] == [MODEL]
    assert sdk.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("other")
    r = httpx.get(backend.url + "/metrics")
    assert r.status_code == 200 and "baton_test_requests_total 1.0" in r.text


def test_chat_usage_counts_real_tokens(backend, sdk):
    tok = backend.tokenizer
    out = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=7, **GREEDY)
    expected_prompt = len(tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True)))
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion" and out.model == MODEL
    assert len(out.choices) == 1 and out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == expected_prompt
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == expected_prompt + 7
    assert out.usage.prompt_tokens_details.cached_tokens >= 0


def test_model_may_be_omitted(backend):
    r = httpx.post(backend.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == MODEL


def test_an_unknown_field_is_refused_naming_it(backend):
    r = httpx.post(backend.url + "/v1/chat/completions",
                   json={"messages": CHAT, "max_tokens": 2, "unknown_field": {"x": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "unknown_field"


def test_completion_usage_and_text(backend, sdk):
    prompt = "The quick brown fox"
    out = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=6, **GREEDY)
    assert out.id.startswith("cmpl-") and out.object == "text_completion"
    assert out.usage.prompt_tokens == len(backend.tokenizer.encode(prompt, add_special_tokens=True))
    assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"
    echoed = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=6, echo=True, **GREEDY)
    assert echoed.choices[0].text == prompt + out.choices[0].text


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_stream_concatenates_to_non_streamed_text(backend, sdk, kind):
    if kind == "chat":
        create, args = sdk.chat.completions.create, {"messages": CHAT}
    else:
        create, args = sdk.completions.create, {"prompt": "Hello world! How are"}
    full = create(model=MODEL, max_tokens=30, **args, **GREEDY)
    chunks = list(create(model=MODEL, max_tokens=30, stream=True, **args, **GREEDY))
    if kind == "chat":
        first = chunks[0].choices[0].delta
        assert first.role == "assistant" and first.content == ""
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert text == full.choices[0].message.content
    else:
        assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": CHAT}),
    ("/v1/completions", {"prompt": "Hello"}),
])
def test_raw_sse_usage_chunk_and_done(backend, path, body):
    req = {"model": MODEL, "max_tokens": 5, "stream": True, "ignore_eos": True, **body}
    r = httpx.post(backend.url + path, json={**req, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    usage = chunks[-1]["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    plain = [json.loads(e) for e in sse_events(httpx.post(backend.url + path, json=req))[:-1]]
    assert all("usage" not in c for c in plain)


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices(backend, stream):
    sdk = openai.OpenAI(base_url=backend.base_url, api_key="unused", timeout=5, max_retries=0)
    args = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "n": 2, "seed": 7, "temperature": 1.0}
    if not stream:
        out = sdk.chat.completions.create(**args)
        assert sorted(c.index for c in out.choices) == [0, 1]
        assert out.usage.completion_tokens == 8
    else:
        finished = {c.choices[0].index: c.choices[0].finish_reason
                    for c in sdk.chat.completions.create(stream=True, **args) if c.choices[0].finish_reason}
        assert finished == {0: "length", 1: "length"}


def test_batch_prompts_give_one_choice_each(backend, sdk):
    tok = backend.tokenizer
    prompts = ["Hello world", "The quick brown"]
    out = sdk.completions.create(model=MODEL, prompt=prompts, max_tokens=3, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == sum(len(tok.encode(p, add_special_tokens=True)) for p in prompts)
    assert out.usage.completion_tokens == 6
    singles = [sdk.completions.create(model=MODEL, prompt=p, max_tokens=3, **GREEDY).choices[0].text
               for p in prompts]
    assert [c.text for c in out.choices] == singles
    by_ids = sdk.completions.create(model=MODEL, prompt=[tok.encode(p) for p in prompts], max_tokens=3, **GREEDY)
    assert [c.text for c in by_ids.choices] == singles


def test_seed_reproducible_at_temperature_one(backend, sdk):
    def run(seed: int) -> str:
        out = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=1.0, seed=seed,
                                          extra_body={"ignore_eos": True})
        return out.choices[0].message.content

    assert run(1234) == run(1234)
    assert len({run(s) for s in (1, 2, 3)}) > 1


def test_chat_logprobs_shape(backend, sdk):
    special = backend.tokenizer.special_token_ids
    args = {"model": MODEL, "messages": CHAT, "max_tokens": 10, "logprobs": True, "top_logprobs": 3, **GREEDY}
    out = sdk.chat.completions.create(**args)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 10
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)  # greedy: the argmax
        assert all(isinstance(b, int) for b in entry.bytes)
    special_text = {backend.tokenizer.id_to_token(i) for i in special}
    raw = b"".join(bytes(e.bytes) for e in content if e.token not in special_text)
    assert raw.decode("utf-8", errors="replace") == out.choices[0].message.content
    streamed = [e for c in sdk.chat.completions.create(stream=True, **args) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)


def test_completion_logprobs_shape(backend, sdk):
    out = sdk.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, logprobs=2, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset == sorted(lp.text_offset)
    assert all(v <= 0 for v in lp.token_logprobs)


def _greedy_tokens(sdk, prompt: str, max_tokens: int) -> tuple[str, list[bytes]]:
    out = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                      max_tokens=max_tokens, logprobs=True, **GREEDY)
    return out.choices[0].message.content, [bytes(e.bytes) for e in out.choices[0].logprobs.content]


def _stop_across_boundary(sdk) -> tuple[str, str]:
    """(prompt, stop) where the stop string starts inside one token and ends in the next."""
    for prompt in ("Hello world!", "The quick brown fox", "Paris is the capital", "def add(a, b):"):
        text, pieces = _greedy_tokens(sdk, prompt, 60)
        for a, b in zip(pieces, pieces[1:]):
            if len(a) >= 2 and b and (a + b).isascii() and (a + b).decode().isprintable():
                stop = a[1:].decode() + b[:1].decode()
                if stop.strip():
                    return prompt, stop
    pytest.skip("no two printable ASCII tokens in a row in the tiny model's greedy output")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundary(backend, sdk, include):
    prompt, stop = _stop_across_boundary(sdk)
    full, _ = _greedy_tokens(sdk, prompt, 60)
    expected = full[:full.index(stop)] + (stop if include else "")
    args = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 60,
            "temperature": 0, "stop": [stop, "never-seen-stop"],
            "extra_body": {"ignore_eos": True, "include_stop_str_in_output": include}}
    out = sdk.chat.completions.create(**args)
    assert out.choices[0].message.content == expected
    assert out.choices[0].finish_reason == "stop" and out.choices[0].stop_reason == stop
    assert out.usage.completion_tokens < 60
    chunks = list(sdk.chat.completions.create(stream=True, **args))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    stats = wait_idle(backend.client)
    assert stats.num_running == 0 and stats.num_free_blocks == NUM_BLOCKS


LONG = "x " * 600
ERROR_CASES = [
    ("/v1/chat/completions", {"messages": CHAT, "temperature": -0.5}, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 1.5}, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 100_000}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"not-a-token": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"99999": 5}, "stream": True}, "logit_bias"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"prompt": LONG}, "prompt"),
    ("/v1/completions", {"prompt": LONG, "stream": True}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", ""]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [10**9]]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 9}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    # fields this server does not implement are refused, never silently ignored
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}], "stream": True}, "functions"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("/v1/completions", {"prompt": "hi", "suffix": "!"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True}, "use_beam_search"),
]


@pytest.mark.parametrize("path,body,param", ERROR_CASES)
def test_bad_requests_get_openai_400(backend, path, body, param):
    r = httpx.post(backend.url + path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert set(err) == {"message", "type", "param", "code"}


def test_body_parsing_ignores_content_type_and_rejects_bad_json(backend):
    body = json.dumps({"prompt": "Hello", "max_tokens": 2})
    r = httpx.post(backend.url + "/v1/completions", content=body,
                   headers={"content-type": "application/x-www-form-urlencoded"})  # what curl -d sends
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
    for bad in (b"{not json", b"[1, 2]", b""):
        r = httpx.post(backend.url + "/v1/chat/completions", content=bad,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_context_error_names_both_numbers(backend):
    r = httpx.post(backend.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 100_000})
    message = r.json()["error"]["message"]
    assert "100000" in message and str(backend.engine.max_model_len) in message


def test_unknown_model_is_404(backend, sdk):
    with pytest.raises(openai.NotFoundError) as info:
        sdk.chat.completions.create(model="gpt-17", messages=CHAT)
    assert info.value.body["param"] == "model"
    r = httpx.post(backend.url + "/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_sdk_raises_bad_request(sdk):
    with pytest.raises(openai.BadRequestError):
        sdk.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)


def test_errors_leave_engine_clean(backend):
    for path, body, _ in ERROR_CASES:
        httpx.post(backend.url + path, json={"model": MODEL, **body})
    stats = wait_idle(backend.client)
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, NUM_BLOCKS)
