"""Hermes-style JSON tool calls (`hermes`): Qwen2.5, Qwen3 (non-Coder), Hermes 2/3.

Format (Qwen3's chat template in `tokenizer_config.json`: "For each function call, return a
json object with function name and arguments within <tool_call></tool_call> XML tags";
vLLM's `hermes_tool_parser.py`), one block per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {}}
    </tool_call>

Keys may come in either order (vLLM's Hermes template writes `arguments` first); a call is
named once its `"name"` string is complete, and its arguments stream as the raw JSON text of
the `"arguments"` value, checked as a valid JSON prefix (`tool_text.scan_value`). A call
without `"arguments"` gets `{}`; arguments given as a JSON string holding an object (some
fine-tunes do that) are unwrapped once complete. Several objects in one block (Qwen2.5 writes
that at times) are several calls. A missing `</tool_call>` is tolerated: the call ends with
its JSON object and what follows is content; an extra `}` before `</tool_call>` is markup.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from moe_engine.server.parsers.base import PartialCall
from moe_engine.server.parsers.tool_text import (
    Match,
    Scan,
    match_marker,
    scan_string,
    scan_value,
    skip_ws,
)
from moe_engine.server.parsers.tools_common import (
    Block,
    BlockToolParser,
    broken_tail,
    malformed,
    pending,
)

START = "<tool_call>"
END = "</tool_call>"
_STRAY = re.compile(r"[ \t\n\r}]*")


@dataclass
class _CallObject:
    """What the text shows of one `{"name": ..., "arguments": ...}` object."""

    state: Scan = Scan.PARTIAL
    end: int = -1  # COMPLETE: index after "}"; INVALID: index of the bad character
    name: str | None = None
    args_start: int = -1
    args_state: Scan = Scan.PARTIAL
    args_end: int = -1


def _scan_member(text: str, pos: int, obj: _CallObject) -> int:
    """Scan `"key": value` at `pos`; returns the index after it, or -1 (obj.state says why)."""
    n = len(text)
    state, key_end = scan_string(text, pos) if text[pos] == '"' else (Scan.INVALID, pos)
    if state != Scan.COMPLETE:
        obj.state, obj.end = state, key_end
        return -1
    key = json.loads(text[pos:key_end])
    colon = skip_ws(text, key_end)
    if colon >= n or text[colon] != ":":
        obj.state, obj.end = (Scan.PARTIAL, n) if colon >= n else (Scan.INVALID, colon)
        return -1
    value = skip_ws(text, colon + 1)
    if value >= n:
        obj.state, obj.end = Scan.PARTIAL, n
        return -1
    state, value_end = scan_value(text, value)
    if key == "name" and obj.name is None and state == Scan.COMPLETE:
        name = json.loads(text[value:value_end])
        if not isinstance(name, str) or not name.strip():
            obj.state, obj.end = Scan.INVALID, value
            return -1
        obj.name = name
    elif key == "arguments" and obj.args_start < 0:
        obj.args_start, obj.args_state, obj.args_end = value, state, value_end
    if state != Scan.COMPLETE:
        obj.state, obj.end = state, value_end
        return -1
    return value_end


def scan_call_object(text: str, pos: int) -> _CallObject:
    """Walk the top-level members of the JSON object that starts at `text[pos] == "{"`."""
    obj = _CallObject()
    n = len(text)
    pos = skip_ws(text, pos + 1)
    if pos < n and text[pos] == "}":
        obj.state, obj.end = Scan.COMPLETE, pos + 1
        return obj
    while pos < n:
        pos = _scan_member(text, pos, obj)
        if pos < 0:
            return obj
        pos = skip_ws(text, pos)
        if pos >= n:
            break
        if text[pos] == "}":
            obj.state, obj.end = Scan.COMPLETE, pos + 1
            return obj
        if text[pos] != ",":
            obj.state, obj.end = Scan.INVALID, pos
            return obj
        pos = skip_ws(text, pos + 1)
    obj.state, obj.end = Scan.PARTIAL, n
    return obj


def _arguments(text: str, obj: _CallObject, settled: bool) -> str:
    """The arguments text as far as it is certain; `settled`: the object will not grow."""
    if obj.args_start < 0:
        return "{}" if settled else ""
    if text[obj.args_start] == '"':
        if obj.args_state != Scan.COMPLETE:
            return text[obj.args_start:obj.args_end] if settled else ""
        inner = json.loads(text[obj.args_start:obj.args_end])
        try:
            if isinstance(json.loads(inner), dict):
                return inner
        except (ValueError, RecursionError):
            pass
        return text[obj.args_start:obj.args_end]
    end = obj.args_end if obj.args_state != Scan.PARTIAL else len(text)
    return text[obj.args_start:end]


class HermesToolParser(BlockToolParser):
    """`<tool_call>{"name": NAME, "arguments": {...}}</tool_call>` per call."""

    name = "hermes"
    start_markers = (START,)

    def parse_block(self, text: str, start: int, marker: str, final: bool) -> Block:
        pos = skip_ws(text, start + len(marker))
        if pos >= len(text):
            return malformed(start, marker) if final else pending()
        if text[pos] != "{":
            return malformed(start, marker)
        calls: list[PartialCall] = []
        while True:  # Qwen2.5 sometimes writes several objects in one block
            obj = scan_call_object(text, pos)
            if obj.name is None:
                if obj.state == Scan.PARTIAL and not final:
                    return Block(calls, None) if calls else pending()
                if not calls:
                    return malformed(start, marker)
                return broken_tail(calls, text, pos, (END,), final)
            settled = final or obj.state != Scan.PARTIAL
            calls.append(PartialCall(obj.name, _arguments(text, obj, settled), settled))
            if obj.state == Scan.PARTIAL:
                return Block(calls, len(text) if final else None)
            if obj.state == Scan.INVALID:
                return broken_tail(calls, text, obj.end, (END,), final)
            close = skip_ws(text, obj.end)
            if close < len(text) and text[close] == "{":
                pos = close
                continue
            return self._close(text, obj.end, calls, final)

    @staticmethod
    def _close(text: str, end: int, calls: list[PartialCall], final: bool) -> Block:
        """After the last object of a block (ending at `end`): `</tool_call>` closes it. Stray
        `}` before it (models that close the object twice) belong to the markup."""
        close = _STRAY.match(text, end).end()
        found = match_marker(text, close, END, final)
        if found == Match.YES:
            return Block(calls, min(close + len(END), len(text)))
        if found == Match.PENDING:
            calls[-1].done = False
            return Block(calls, None)
        return Block(calls, end)  # no </tool_call>: what follows is content
