"""One chat choice's output read by the reasoning and tool parsers (`parsers.base.OutputStream`),
as OpenAI's message and delta JSON, with its reasoning tokens counted.

Reasoning appears as `reasoning_content` (DeepSeek's and vLLM's original field, which most
clients read) and as `reasoning` (vLLM's name since its PR #27752, November 2025), in messages
and deltas alike.

Reasoning tokens (`usage.completion_tokens_details.reasoning_tokens`, `count_reasoning_tokens`):
the output tokens up to and including the one that completes the reasoning's end marker (all of
them when the reasoning never ended; 0 when the choice showed no reasoning), found once the
choice has finished by a binary search over its token ids: the shortest prefix whose decoded
text the reasoning parser reads as ended (a parser never takes text back, so "ended" holds for
every longer prefix). That is O(log n) decodes of at most n tokens per choice, whatever the
stream interval, and exact for whole and streamed responses alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moe_engine.core.outputs import EngineCoreOutput
from moe_engine.server.parsers.base import (
    DeltaMessage,
    OutputStream,
    ReasoningParser,
    ToolCallDelta,
    ToolParser,
)


class ChoiceParse:
    """One choice's parsers and counts.

    Args:
        reasoning: the choice's reasoning parser, or None.
        tools: the choice's tool parser, or None.
        count_reasoning: the choice's output token ids -> its reasoning tokens
            (`count_reasoning_tokens` bound to the tokenizer and parser), with `reasoning`.
    """

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None,
                 count_reasoning: Callable[[list[int]], int] | None = None) -> None:
        self.stream = OutputStream(reasoning, tools)
        self.has_reasoning = reasoning is not None
        self._count_reasoning = count_reasoning

    def feed(self, out: EngineCoreOutput) -> DeltaMessage:
        """What `out` (one engine output of this choice) adds; its end too when it is the last."""
        delta = self.stream.feed(out.new_text)
        if out.finished:
            delta = merge(delta, self.stream.finish())
        return delta

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        """The reasoning's tokens among the finished choice's output `token_ids`."""
        if not self.stream.reasoning or self._count_reasoning is None:
            return 0
        return self._count_reasoning(token_ids)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """"tool_calls" when calls were returned and the model stopped by itself; else the
        engine's reason ("length" stays "length": the calls may be cut)."""
        if engine_reason == "stop" and self.stream.tool_calls:
            return "tool_calls"
        return engine_reason

    def message(self) -> dict[str, Any]:
        """The whole choice's `message` (content null when it made calls and said nothing)."""
        s = self.stream
        calls = [c.to_openai() for c in s.tool_calls]
        msg: dict[str, Any] = {"role": "assistant",
                               "content": s.content if s.content or not calls else None}
        if self.has_reasoning:
            reasoning = s.reasoning if s.reasoning else None
            msg["reasoning_content"] = msg["reasoning"] = reasoning
        if s.tool_parser is not None:
            msg["tool_calls"] = calls
        return msg


def delta_json(delta: DeltaMessage) -> dict[str, Any]:
    """OpenAI's `choices[].delta` of a step: only the parts it adds. A call's first piece
    carries its index, id, type and name with empty arguments (as OpenAI streams them), its
    argument fragments follow in later pieces."""
    out: dict[str, Any] = {}
    if delta.reasoning_content:
        out["reasoning_content"] = out["reasoning"] = delta.reasoning_content
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        out["tool_calls"] = calls = []
        for c in delta.tool_calls:
            if c.id is not None and c.arguments:  # OpenAI's first piece: id and name only
                calls.append(ToolCallDelta(c.index, c.id, c.name, "").to_openai())
                c = ToolCallDelta(c.index, None, None, c.arguments)
            calls.append(c.to_openai())
    return out


def merge(first: DeltaMessage, second: DeltaMessage) -> DeltaMessage:
    """Two consecutive deltas as one (a call's argument fragments joined)."""
    calls = list(first.tool_calls)
    for c in second.tool_calls:
        if calls and calls[-1].index == c.index and c.id is None:
            last = calls[-1]
            calls[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + c.arguments)
        else:
            calls.append(c)
    return DeltaMessage(first.content + second.content,
                        first.reasoning_content + second.reasoning_content, calls)


def count_reasoning_tokens(
    token_ids: list[int], decode: Callable[[list[int]], str],
    new_parser: Callable[[], ReasoningParser],
) -> int:
    """How many of `token_ids` (a finished output) the reasoning spans: the shortest prefix
    whose text `new_parser()` reads as ended, or all of them if it never ends.

    Args:
        token_ids: the output's token ids (tokens).
        decode: token ids -> text, as the engine decoded them (same special-token setting).
        new_parser: a fresh reasoning parser, started where the prompt left the output.
    """
    if not new_parser().parse(decode(token_ids), False).ended:
        return len(token_ids)
    lo, hi = 0, len(token_ids)  # ended at hi; not known at lo
    while lo < hi:
        mid = (lo + hi) // 2
        if new_parser().parse(decode(token_ids[:mid]), False).ended:
            hi = mid
        else:
            lo = mid + 1
    return lo
