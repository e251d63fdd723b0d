"""Structured output over HTTP on the embedded SmolLM2-135M-Instruct, through the official SDK:
JSON schemas, json_object, regex, choice and Lark grammars in every spelling clients use, streamed
and not, and the 400s for what cannot be compiled."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from baton_serve.router.api import build_app
from baton_serve.router.server import ServerThread
from baton_serve.workers.engine.async_engine import AsyncEngine
from baton_serve.workers.engine.config import EngineConfig
from baton_serve.workers.llm import build_engine

from tests.router.conftest import wait_idle

NUM_BLOCKS = 512
NAME = {"type": "string", "maxLength": 12}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}


def _obj(props: dict, required: list[str] | None = None, closed: bool = True) -> dict:
    out = {"type": "object", "properties": props, "required": list(props) if required is None else required}
    if closed:
        out["additionalProperties"] = False
    return out


# 20 schemas: nested objects, arrays, enums, bounded integers, booleans, required and optional keys.
# Strings and arrays are bounded so that greedy decoding of a small model always finishes (and
# patterns anchored: JSON Schema's ``pattern`` is a search, so an unanchored one bounds nothing).
SCHEMAS = [
    _obj({"name": NAME}),
    _obj({"name": NAME, "age": AGE}),
    _obj({"city": NAME, "population": {"type": "integer", "minimum": 1, "maximum": 99999999}}),
    _obj({"ok": {"type": "boolean"}}),
    _obj({"color": {"enum": ["red", "green", "blue"]}}),
    _obj({"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}}),
    _obj({"scores": {"type": "array", "items": AGE, "maxItems": 4}}),
    _obj({"person": _obj({"name": NAME, "age": AGE})}),
    _obj({"person": _obj({"name": NAME, "address": _obj({"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})}),
    _obj({"name": NAME, "nickname": NAME}, required=["name"]),
    _obj({"id": {"type": "integer", "minimum": 1, "maximum": 1000}, "label": NAME}, required=["id"]),
    _obj({"items": {"type": "array", "items": _obj({"sku": NAME, "qty": AGE}), "minItems": 1, "maxItems": 2}}),
    _obj({"status": {"enum": ["open", "closed"]}, "priority": {"enum": [1, 2, 3]}}),
    _obj({"title": NAME, "done": {"type": "boolean"}, "votes": AGE}),
    _obj({"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "integer", "minimum": 0, "maximum": 100}}),
    _obj({"matrix": {"type": "array", "items": {"type": "array", "items": AGE, "maxItems": 2}, "maxItems": 2}}),
    _obj({"name": NAME, "langs": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "maxItems": 3}}),
    _obj({"a": _obj({"b": _obj({"c": NAME})})}),
    _obj({"name": NAME, "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}),
    {"type": "array", "items": _obj({"k": NAME, "v": AGE}), "minItems": 1, "maxItems": 2},
]


@pytest.fixture(scope="module")
def server(default_model_dir):
    engine, tokenizer, folder = build_engine(EngineConfig(model=str(default_model_dir), num_kv_blocks=NUM_BLOCKS))
    client = AsyncEngine(engine)
    app = build_app(client, tokenizer, folder.name, engine.max_model_len)
    srv = ServerThread(app).start()
    sdk = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=300, max_retries=0)
    yield srv, sdk, folder.name, client
    srv.stop()
    client.shutdown()


def _ask(sdk, model: str, stream: bool, content: str, max_tokens: int = 256, **kw):
    messages = [{"role": "user", "content": content}]
    if not stream:
        r = sdk.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    chunks = list(sdk.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens,
                                              stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_output_parses_and_validates(server, i, stream):
    _, sdk, model, _ = server
    schema = SCHEMAS[i]
    text, finish = _ask(sdk, model, stream, "Give me an example as JSON.",
                        response_format={"type": "json_schema",
                                         "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), schema)


def test_json_object_and_the_vllm_spellings(server):
    _, sdk, model, _ = server
    # json_object bounds nothing, so the prompt asks for something short (a cat description loops
    # past 256 tokens on this model: finish_reason "length", as in vLLM)
    text, finish = _ask(sdk, model, False, 'Reply with a JSON object like {"answer": ...}: what is 2+2?',
                        response_format={"type": "json_object"})
    assert finish == "stop" and isinstance(json.loads(text), dict)
    schema = SCHEMAS[1]
    for body in ({"structured_outputs": {"json": schema}}, {"guided_json": schema}):
        text, _ = _ask(sdk, model, False, "A person as JSON.", extra_body=body)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("field", ["structured_outputs", "guided"])
def test_regex_choice_and_grammar_outputs_match(server, field):
    _, sdk, model, _ = server

    def extra(kind: str, value):
        return {"structured_outputs": {kind: value}} if field == "structured_outputs" else {f"guided_{kind}": value}

    pattern = r"[A-Z][a-z]{2,8} [0-9]{2}"
    text, _ = _ask(sdk, model, False, "A word and a number.", extra_body=extra("regex", pattern))
    assert re.fullmatch(pattern, text), text
    choices = ["positive", "negative", "neutral"]
    for stream in (False, True):
        text, _ = _ask(sdk, model, stream, "I love this movie! Sentiment?", extra_body=extra("choice", choices))
        assert text in choices
    lark = 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'
    text, _ = _ask(sdk, model, False, "Answer.", extra_body=extra("grammar", lark))
    assert re.fullmatch(r"yes|no|maybe [0-9]", text), text


def test_completions_endpoint_and_n_samples(server):
    srv, sdk, model, _ = server
    schema = SCHEMAS[6]
    r = sdk.completions.create(model=model, prompt="Scores as JSON:", max_tokens=128, temperature=0.9, seed=3, n=3,
                               extra_body={"response_format": {"type": "json_schema",
                                                               "json_schema": {"name": "x", "schema": schema}}})
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)


def test_max_tokens_still_ends_a_constrained_request_with_length(server):
    _, sdk, model, _ = server
    text, finish = _ask(sdk, model, False, "A person.", max_tokens=3,
                        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[1]}})
    assert finish == "length" and text.startswith("{")


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: foo"}, "guided_grammar"),
    ({"guided_regex": "[0-9]+", "response_format": {"type": "json_object"}}, "guided_regex"),
]


@pytest.mark.parametrize("extra,param", BAD)
def test_what_cannot_be_compiled_is_a_400_and_leaves_nothing(server, extra, param):
    srv, _, model, client = server
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                   json={"model": model, "messages": [{"role": "user", "content": "hi"}], **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err
    stats = wait_idle(client)
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.num_free_blocks == NUM_BLOCKS
