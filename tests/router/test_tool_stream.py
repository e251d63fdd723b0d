"""The streaming tool-call parser: however the text is cut into pieces, the content and calls it
streams are the same, and they agree with ``router.tools.parse`` reading the whole text."""

from __future__ import annotations

import json

from baton_serve.router import tools
from baton_serve.router.tool_stream import ToolCallStreamer
from hypothesis import given, settings
from hypothesis import strategies as st

_JSON = st.recursive(st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                 max_size=3), max_leaves=6)
_CALL = st.builds(lambda name, args, gap: f"{tools.OPEN}{gap}" + json.dumps({"name": name, "arguments": args})
                  + f"{gap}{tools.CLOSE}",
                  st.text("abcdef_", min_size=1, max_size=8), st.dictionaries(st.text(max_size=5), _JSON, max_size=3),
                  st.sampled_from(["", " ", "\n"]))
_TEXT = st.lists(st.sampled_from(list("ab <>/{}\"\n") + ["<tool", "</tool_call"]), max_size=12).map("".join)


def _run(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    streamer, events, last = ToolCallStreamer(), [], 0
    for cut in sorted(cuts) + [len(text)]:
        events += streamer.feed(text[last:cut])
        last = max(last, cut)
    events += streamer.finish()
    calls: dict[int, list[str]] = {}
    for e in events:
        if e.name is not None:
            assert e.id.startswith("call_") and e.index == len(calls)
            calls[e.index] = [e.name, ""]
        if e.arguments is not None:
            calls[e.index][1] += e.arguments
    assert streamer.calls == len(calls)
    return "".join(e.content or "" for e in events), [tuple(c) for c in calls.values()]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(_CALL, _TEXT), max_size=4), st.lists(st.integers(0, 200), max_size=12))
def test_any_cut_streams_what_the_whole_text_parses_to(parts, cuts):
    text = "".join(parts)
    content, calls = _run(text, cuts)
    assert (content, calls) == _run(text, [])  # the cut does not matter
    _, parsed = tools.parse(text)
    assert [(c[0], json.loads(c[1])) for c in calls] == [(c.name, json.loads(c.arguments)) for c in parsed]
    assert content == tools._CALL.sub("", text)  # content: the text outside the blocks, as it was


def test_other_key_orders_string_arguments_and_unclosed_blocks():
    assert _run('<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>', [5, 20]) == ("", [("f", '{"x": 1}')])
    assert _run('<tool_call>{"name": "s", "arguments": "{\\"a\\": 1}"}</tool_call>', [30]) == (
        "", [("s", '{"a": 1}')])
    assert _run('x <tool_call>{"name": "u", "argu', [3, 9]) == ('x <tool_call>{"name": "u", "argu', [])
    assert _run("a < b <tool_ca", [7]) == ("a < b <tool_ca", [])


def test_arguments_go_out_as_they_arrive():
    streamer = ToolCallStreamer()
    assert streamer.feed('<tool_call>{"name": "get') == []
    header = streamer.feed('_weather", "arguments": {"ci')
    assert header[0].name == "get_weather" and header[1].arguments == '{"ci'
    assert [e.arguments for e in streamer.feed('ty": "Oslo"}}</tool')] == ['ty": "Oslo"}']
    assert [e.content for e in streamer.feed("_call> done")] == [" done"] and streamer.finish() == []
