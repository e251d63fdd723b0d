"""Tool calls streamed as the model writes them: ``<tool_call>{"name": ..., "arguments": ...}``
becomes OpenAI's ``delta.tool_calls`` pieces (id, type and name once the name is complete, then
the arguments' JSON text as it arrives), and text outside the blocks streams as content.

One ``ToolCallStreamer`` per sample, fed each new piece of its text. Text that could still be the
start of ``<tool_call>`` is held back until it is not. A block whose keys come in another order,
or whose arguments are a JSON string, is sent whole when it closes; one never closed ends as the
content it was, as ``router.tools.parse`` would read it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from baton_serve.router.tools import CLOSE, OPEN

# The head of a block in the order the grammar (and Hermes-style models) write it.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*', re.DOTALL)


@dataclass
class ToolEvent:
    """One piece to stream: content text, or a call's header (``id`` and ``name``) or arguments text."""

    content: str | None = None
    index: int | None = None  # the call's position in the sample
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


class ToolCallStreamer:
    """Turns one sample's text, piece by piece, into content and tool-call events."""

    def __init__(self) -> None:
        self._buf = ""  # text not yet turned into events
        self._mode = "text"  # text | head | args | tail
        self.calls = 0  # call headers sent
        self._depth = 0  # the arguments value's nesting, strings skipped
        self._in_string = False
        self._escape = False

    def feed(self, text: str) -> list[ToolEvent]:
        """Events for the sample's next ``text``."""
        self._buf += text
        out: list[ToolEvent] = []
        while True:
            before = (self._mode, len(self._buf))
            getattr(self, f"_{self._mode}")(out)
            if (self._mode, len(self._buf)) == before:
                return out

    def finish(self) -> list[ToolEvent]:
        """The sample ended: what was held back goes out (a block never closed, as content)."""
        out: list[ToolEvent] = []
        if self._mode == "text" and self._buf:
            out.append(ToolEvent(content=self._buf))
        elif self._mode == "head":
            out.append(ToolEvent(content=OPEN + self._buf))  # a head never completed: what it was
        self._buf = ""
        return out

    # ------------------------------------------------------------------ states
    def _text(self, out: list[ToolEvent]) -> None:
        at = self._buf.find(OPEN)
        if at >= 0:
            if at:
                out.append(ToolEvent(content=self._buf[:at]))
            self._buf, self._mode = self._buf[at + len(OPEN):], "head"
            return
        keep = _partial_suffix(self._buf, OPEN)
        if len(self._buf) > keep:
            out.append(ToolEvent(content=self._buf[:len(self._buf) - keep]))
            self._buf = self._buf[len(self._buf) - keep:]

    def _head(self, out: list[ToolEvent]) -> None:
        m = _HEAD.match(self._buf)
        if m is not None and len(self._buf) == m.end():
            return  # the value's first character decides: JSON text streams, a JSON string goes whole
        if m is not None and self._buf[m.end()] != '"':
            out.append(ToolEvent(index=self.calls, id=f"call_{uuid.uuid4().hex[:24]}",
                                 name=json.loads(f'"{m.group(1)}"')))
            self.calls += 1
            self._buf, self._mode = self._buf[m.end():], "args"
            self._depth, self._in_string, self._escape = 0, False, False
            return
        end = self._buf.find(CLOSE)
        if end < 0:
            return  # the head is not complete yet
        body, self._buf, self._mode = self._buf[:end], self._buf[end + len(CLOSE):], "text"
        whole = _whole_call(body)
        if whole is None:  # not a call after all: what the model wrote is content
            out.append(ToolEvent(content=OPEN + body + CLOSE))
            return
        name, arguments = whole
        out.append(ToolEvent(index=self.calls, id=f"call_{uuid.uuid4().hex[:24]}", name=name))
        out.append(ToolEvent(index=self.calls, arguments=arguments))
        self.calls += 1

    def _args(self, out: list[ToolEvent]) -> None:
        """Pass the arguments' JSON text on until its value is complete."""
        end = None
        for i, ch in enumerate(self._buf):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                if self._depth == 0:  # a bare scalar ended: this closes the block's object
                    end = i
                    break
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
            elif self._depth == 0 and (ch == "," or ch.isspace()):
                end = i
                break
        piece = self._buf if end is None else self._buf[:end]
        if piece:
            out.append(ToolEvent(index=self.calls - 1, arguments=piece))
        self._buf = "" if end is None else self._buf[end:]
        if end is not None:
            self._mode = "tail"

    def _tail(self, out: list[ToolEvent]) -> None:
        end = self._buf.find(CLOSE)
        if end >= 0:
            self._buf, self._mode = self._buf[end + len(CLOSE):], "text"


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that ``tag`` starts with (it may be completed)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _whole_call(body: str) -> tuple[str, str] | None:
    """A closed block read whole: (name, arguments as JSON text), or None when it is not a call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    return obj["name"], args if isinstance(args, str) else json.dumps(args)
