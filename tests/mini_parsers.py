"""Two small parsers over `moe_engine.server.parsers.base` for the chat wiring's tests: Hermes /
Qwen3 `<tool_call>{"name", "arguments"}</tool_call>` calls and a `<think>...</think>` block.
They test the HTTP pipeline (what the route does with a parser's result), not the families'
formats: those are the parser modules' own tests."""

from __future__ import annotations

import json
from typing import ClassVar

from moe_engine.server.parsers.base import (
    ParsedCalls,
    ParsedReasoning,
    PartialCall,
    ReasoningParser,
    ToolParser,
)


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class MiniHermesParser(ToolParser):
    name: ClassVar[str] = "mini_hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> ParsedCalls:
        first = text.find(self.OPEN)
        if first == -1:
            keep = len(text) if final else len(text) - _held(text, self.OPEN)
            return ParsedCalls(text[:keep])
        content, calls, i = text[:first], [], first
        while i != -1:
            end = text.find(self.CLOSE, i)
            if end == -1:
                if final:
                    content += text[i:]
                break
            body = json.loads(text[i + len(self.OPEN):end])
            calls.append(PartialCall(body["name"], json.dumps(body["arguments"]), True))
            i = text.find(self.OPEN, end)
        return ParsedCalls(content, calls)


class MiniThinkParser(ReasoningParser):
    name: ClassVar[str] = "mini_think"
    start_marker: ClassVar[str] = "<think>"
    OPEN, CLOSE = "<think>", "</think>"

    def parse(self, text: str, final: bool) -> ParsedReasoning:
        body = text
        if not self.starts_in_reasoning:
            if not text.startswith(self.OPEN):
                if self.OPEN.startswith(text) and not final:
                    return ParsedReasoning("", "", False)
                return ParsedReasoning("", text, True)
            body = text[len(self.OPEN):]
        end = body.find(self.CLOSE)
        if end != -1:
            return ParsedReasoning(body[:end], body[end + len(self.CLOSE):].lstrip("\n"), True)
        keep = len(body) if final else len(body) - _held(body, self.CLOSE)
        return ParsedReasoning(body[:keep], "", final)
