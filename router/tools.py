"""Tool calling: tools into the prompt, ``tool_choice`` into a grammar, calls out of the text.

The call format is the one Hermes and Qwen templates use, ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``, one block per call. A chat template that renders ``tools`` itself (the HF
convention) gets them as they are; one that does not (the default SmolLM2 template) gets the
documented fallback: a system message listing the tools and this format, earlier calls rendered
as such blocks in the assistant's turn, and tool results as user turns that name their call.

``tool_choice``: ``none`` renders the tools but neither constrains nor parses; ``auto`` parses
whatever blocks the model writes; ``required`` and a named function are enforced by a Lark
grammar whose call bodies are JSON schemas (llguidance's ``%json``), so the arguments always
validate against the tool's ``parameters``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from baton_serve.workers.errors import InvalidRequestError
from baton_serve.workers.sampling.structured.spec import StructuredSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
# The same compact JSON the schema kind emits: a model cannot pad a call with whitespace forever.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ParsedCall:
    """One call found in the output: its id, the function's name and its arguments as JSON text."""

    id: str
    name: str
    arguments: str


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def check_choice(tools: list[dict[str, Any]] | None, choice: Any) -> str | None:
    """The mode (``none``/``auto``/``required``) or the named function; 400 for a choice that names
    no declared tool, or tools given without any."""
    if choice is None:
        return "auto" if tools else None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequestError(f"tool_choice must be none, auto, required or a function, got {choice!r}",
                                      param="tool_choice")
        if choice != "none" and not tools:
            raise InvalidRequestError(f"tool_choice {choice!r} needs tools", param="tool_choice")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not tools or name not in tool_names(tools):
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools "
                                  f"({', '.join(tool_names(tools or [])) or 'none given'})", param="tool_choice")
    return f"function:{name}"


def grammar(tools: list[dict[str, Any]], mode: str, parallel: bool) -> StructuredSpec | None:
    """The grammar that enforces ``required`` or a named function (None for ``auto``/``none``)."""
    if mode in ("none", "auto"):
        return None
    chosen = [t for t in tools if mode == "required" or f"function:{t['function']['name']}" == mode]
    bodies = []
    for t in chosen:
        fn = t["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        bodies.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                       "required": ["name", "arguments"], "additionalProperties": False})
    schema = {"anyOf": bodies} if len(bodies) > 1 else bodies[0]
    schema = {**schema, "x-guidance": _COMPACT}
    repeat = "+" if parallel and mode == "required" else ""
    lark = (f"start: call{repeat}\n"
            f'call: "{OPEN}" body "{CLOSE}"\n'
            f"body: %json {json.dumps(schema)}\n")
    return StructuredSpec.grammar(lark, param="tools")


def render_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    template_knows_tools: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages (and tools) to hand the chat template: unchanged where it renders tools itself,
    else the fallback format."""
    if template_knows_tools or not tools:
        return messages, tools
    lines = ["You can call these functions. To call one, answer with nothing but",
             f'{OPEN}{{"name": <function name>, "arguments": <arguments as JSON>}}{CLOSE}',
             "(one block per call). Functions:"]
    for t in tools:
        fn = t["function"]
        lines.append(json.dumps({"name": fn["name"], "description": fn.get("description", ""),
                                 "parameters": fn.get("parameters") or {}}))
    out: list[dict[str, Any]] = [{"role": "system", "content": "\n".join(lines)}]
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = "".join(f"{OPEN}{json.dumps({'name': c['function']['name'], 'arguments': _args(c)})}{CLOSE}"
                            for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m.get("content") or "") + calls})
        elif m.get("role") == "tool":
            out.append({"role": "user", "content": f"Result of call {m.get('tool_call_id', '')}: {m.get('content', '')}"})
        else:
            out.append(m)
    return out, None


def parse(text: str) -> tuple[str | None, list[ParsedCall]]:
    """The text outside any call block (None when empty), and the calls whose JSON parses."""
    calls = []
    for body in _CALL.findall(text):
        try:
            obj = json.loads(body)
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", {})
        calls.append(ParsedCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"],
                                args if isinstance(args, str) else json.dumps(args)))
    if not calls:
        return text, []
    rest = _CALL.sub("", text).strip()
    return rest or None, calls


def _args(call: dict[str, Any]) -> Any:
    raw = call.get("function", {}).get("arguments", "{}")
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return raw
