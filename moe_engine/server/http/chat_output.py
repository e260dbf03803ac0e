"""One chat choice's output read by the reasoning and tool parsers (`parsers.base.OutputStream`),
as OpenAI's message and delta JSON, with its reasoning tokens counted.

Reasoning appears as `reasoning_content` (DeepSeek's and vLLM's original field, which most
clients read) and as `reasoning` (vLLM's name since its PR #27752, November 2025), in messages
and deltas alike.

Reasoning tokens (`usage.completion_tokens_details.reasoning_tokens`): the tokens of every
engine output fed while the reasoning was still open, including the output that closed it; 0
when the choice showed no reasoning. Exact when each output carries one token (streams at
`--stream-interval 1`, and whole responses, which read the engine's per-step outputs when a
reasoning parser runs); otherwise the output that closes the reasoning may add up to
`stream_interval - 1` answer tokens to the count. Text the detokenizer holds back (an
incomplete UTF-8 character, a possible stop string) arrives with a later token, which may
shift one token across the boundary.
"""

from __future__ import annotations

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
    """

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self.stream = OutputStream(reasoning, tools)
        self.has_reasoning = reasoning is not None
        self._reasoning_tokens = 0

    def feed(self, out: EngineCoreOutput) -> DeltaMessage:
        """What `out` (one engine output of this choice) adds; its end too when it is the last."""
        still_open = self.has_reasoning and not self.stream.reasoning_ended
        delta = self.stream.feed(out.new_text)
        if out.finished:
            delta = merge(delta, self.stream.finish())
        if still_open:
            self._reasoning_tokens += len(out.new_token_ids)
        return delta

    @property
    def reasoning_tokens(self) -> int:
        return self._reasoning_tokens if self.stream.reasoning else 0

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
