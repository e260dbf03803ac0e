"""The two parser interfaces (tool calls, reasoning) and the one streaming driver over both.

Every parser is a pure function of the text so far: `parse(text, final)` returns what is
already certain. `OutputStream` re-parses the accumulated text at each delta and sends only what
grew, so a stream split anywhere (every token boundary, any character) yields exactly what one
parse of the whole text yields; there is no per-format streaming state to get wrong under
concurrency (vLLM's most reported parser bugs: empty or duplicated streamed `tool_calls`).
Each choice of each request owns its own `OutputStream`; parsers keep no state between calls.

Cost: a parse is linear in the text, so a stream of n characters costs O(n * deltas); parsers
are plain string scanning (no regex backtracking over the whole text), a few microseconds per
kilobyte.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class PartialCall:
    """One tool call as far as the text shows it.

    Attributes:
        name: the function name, None until it is complete.
        arguments: the JSON text of the arguments object known so far; always a prefix of the
            call's final arguments text (a parser never returns text it may take back).
        done: the call's closing marker was seen (or the text is final).
        id: the call id the format itself carries (Kimi-K2's `functions.get_weather:0`), else
            None and the stream makes one.
    """

    name: str | None
    arguments: str = ""
    done: bool = False
    id: str | None = None


@dataclass
class ParsedCalls:
    """A tool parser's reading of the content text so far.

    Attributes:
        content: the text outside tool calls that can no longer turn into a call (a tail that
            may start a call marker is held back until the next parse; with `final` nothing is
            held back).
        calls: the calls begun so far, in order.
    """

    content: str
    calls: list[PartialCall] = field(default_factory=list)


@dataclass
class ParsedReasoning:
    """A reasoning parser's reading of the output text so far.

    Attributes:
        reasoning: the reasoning text so far (without its markers), certain.
        content: the text after the reasoning (the answer), certain; it goes on to the tool
            parser.
        ended: the reasoning's end marker was seen (or the output never reasoned).
    """

    reasoning: str
    content: str
    ended: bool


class ToolParser(ABC):
    """Finds a family's tool calls in its output text.

    Args:
        tools: the request's `tools` (OpenAI's `[{"type": "function", "function": {...}}]`),
            for formats that need the parameters' types (XML styles); may be empty.
    """

    #: The parser's name (`--tool-call-parser NAME`).
    name: ClassVar[str]

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedCalls:
        """Read `text`, all content the model produced so far (after reasoning).

        Not `final`: hold back what may still change (a partial marker, a partial name,
        argument text a later character could rewrite). `final`: the text is complete; a call
        whose markup is malformed is returned as content, never dropped.
        """


class ReasoningParser(ABC):
    """Splits a family's output into reasoning and answer.

    Args:
        starts_in_reasoning: the prompt already opened the reasoning block (DeepSeek-R1's
            template ends the prompt with `<think>\\n`), so the output begins inside it.
    """

    name: ClassVar[str]

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self.starts_in_reasoning = starts_in_reasoning

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedReasoning:
        """Read `text`, the whole output so far; not `final`: hold back a partial marker."""


@dataclass
class ToolCallDelta:
    """One streamed piece of a tool call (OpenAI's `choices[].delta.tool_calls[]`): the first
    piece of a call carries `id` and `name`, later ones argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index, "function": function}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
            function["name"] = self.name
        return out


@dataclass
class DeltaMessage:
    """What one step adds to a choice's message."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning_content or self.tool_calls)


@dataclass(frozen=True)
class ToolCall:
    """One finished tool call (OpenAI's `message.tool_calls[]`)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def make_call_id() -> str:
    """A fresh call id in OpenAI's shape (`call_` + 24 hex digits)."""
    return "call_" + uuid.uuid4().hex[:24]


class OutputStream:
    """One choice's output through a reasoning parser, then a tool parser (either may be None).

    `feed(delta)` returns what the delta adds; `finish()` what the end of the output adds; then
    `reasoning`, `content` and `tool_calls` hold the whole message, equal to what the deltas
    added up to.
    """

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self.reasoning_parser = reasoning
        self.tool_parser = tools
        self.text = ""
        self.reasoning = ""
        self.content = ""
        self._calls: list[PartialCall] = []
        self._ids: list[str] = []
        self.finished = False

    def feed(self, delta: str) -> DeltaMessage:
        self.text += delta
        return self._advance(final=False)

    def finish(self) -> DeltaMessage:
        out = self._advance(final=True)
        self.finished = True
        return out

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(self._ids[i], c.name or "", c.arguments)
                for i, c in enumerate(self._calls) if c.name is not None]

    @property
    def reasoning_ended(self) -> bool:
        return self.reasoning_parser is None or self._reasoning_ended

    _reasoning_ended = False

    def _advance(self, final: bool) -> DeltaMessage:
        out = DeltaMessage()
        answer = self.text
        if self.reasoning_parser is not None:
            parsed = self.reasoning_parser.parse(self.text, final)
            out.reasoning_content = _grow(self.reasoning, parsed.reasoning, "reasoning")
            self.reasoning = parsed.reasoning
            self._reasoning_ended = parsed.ended
            answer = parsed.content
        if self.tool_parser is None:
            out.content = _grow(self.content, answer, "content")
            self.content = answer
            return out
        calls = self.tool_parser.parse(answer, final)
        out.content = _grow(self.content, calls.content, "content")
        self.content = calls.content
        out.tool_calls = self._call_deltas(calls.calls)
        return out

    def _call_deltas(self, calls: list[PartialCall]) -> list[ToolCallDelta]:
        deltas = []
        for i, call in enumerate(calls):
            if call.name is None:
                break  # later calls cannot be named before this one
            if i == len(self._calls):
                self._ids.append(call.id or make_call_id())
                self._calls.append(PartialCall(call.name, "", False, call.id))
                deltas.append(ToolCallDelta(i, self._ids[i], call.name, ""))
            known = self._calls[i]
            grown = _grow(known.arguments, call.arguments, f"tool call {i} arguments")
            known.arguments, known.done = call.arguments, call.done
            if grown:
                if deltas and deltas[-1].index == i:
                    deltas[-1].arguments += grown
                else:
                    deltas.append(ToolCallDelta(i, None, None, grown))
        return deltas


def _grow(old: str, new: str, what: str) -> str:
    """The text `new` adds to `old`; a parser that took text back is a bug in that parser."""
    if not new.startswith(old):
        raise AssertionError(f"parser took back {what}: had {old!r}, now {new!r}")
    return new[len(old):]
