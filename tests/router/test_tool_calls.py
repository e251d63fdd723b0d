"""Tool calling over HTTP on the embedded SmolLM2-135M-Instruct, through the official SDK.

Its chat template has no tool format, so these run through the documented fallback
(``router/tools.py``): the tools in a system message, calls as ``<tool_call>`` blocks."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from baton_serve.router import tools as tool_format
from baton_serve.router.api import build_app
from baton_serve.router.server import ServerThread
from baton_serve.workers.engine.async_engine import AsyncEngine
from baton_serve.workers.engine.config import EngineConfig
from baton_serve.workers.llm import build_engine

from tests.router.conftest import wait_idle

NUM_BLOCKS = 256
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(default_model_dir):
    engine, tokenizer, folder = build_engine(EngineConfig(model=str(default_model_dir), num_kv_blocks=NUM_BLOCKS))
    client = AsyncEngine(engine)
    srv = ServerThread(build_app(client, tokenizer, folder.name, engine.max_model_len)).start()
    sdk = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=300, max_retries=0)
    yield srv, sdk, folder.name, client
    srv.stop()
    client.shutdown()


def _valid_call(call, tools: list[dict]) -> dict:
    fn = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, fn["parameters"])
    assert call.id.startswith("call_") and call.type == "function"
    return args


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_a_required_or_named_call_is_a_valid_call_to_a_declared_tool(server, choice):
    _, sdk, model, _ = server
    r = sdk.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                    temperature=0, max_tokens=120, parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
    assert len(c.message.tool_calls) == 1
    _valid_call(c.message.tool_calls[0], [WEATHER, TIME])
    if isinstance(choice, dict):
        assert c.message.tool_calls[0].function.name == "get_time"


def test_a_call_streams_as_tool_call_deltas_and_the_sdk_reassembles_it(server):
    _, sdk, model, _ = server
    chunks = list(sdk.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                              temperature=0, max_tokens=120, stream=True))
    pieces = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert pieces[0].id and pieces[0].function.name == "get_weather"
    arguments = "".join(p.function.arguments or "" for p in pieces)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    # As the model writes it: the arguments come in several pieces, not in one at the end.
    assert sum(bool(p.function.arguments) for p in pieces) >= 3, pieces
    whole = sdk.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                        temperature=0, max_tokens=120)
    assert json.loads(whole.choices[0].message.tool_calls[0].function.arguments) == json.loads(arguments)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [
        "tool_calls"]


def test_a_tool_result_round_trips_and_yields_a_text_answer(server):
    _, sdk, model, _ = server
    first = sdk.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                        temperature=0, max_tokens=120)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    answer = sdk.chat.completions.create(model=model, messages=history, tools=[WEATHER], tool_choice="none",
                                         temperature=0, max_tokens=40)
    c = answer.choices[0]
    assert c.message.tool_calls is None and c.message.content and c.finish_reason in ("stop", "length")


def test_auto_parses_whatever_the_model_writes():
    content, calls = tool_format.parse('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", '
                                       '"unit": "celsius"}}</tool_call>')
    assert content == "Sure." and [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo", "unit": "celsius"}
    assert tool_format.parse("no call here") == ("no call here", [])
    assert tool_format.parse("<tool_call>not json</tool_call>")[1] == []


@pytest.mark.parametrize("body,param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
])
def test_bad_tool_requests_are_400s_and_leave_nothing(server, body, param):
    srv, _, model, client = server
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={"model": model, "messages": ASK, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    stats = wait_idle(client)
    assert stats.num_running == 0 and stats.num_free_blocks == NUM_BLOCKS
