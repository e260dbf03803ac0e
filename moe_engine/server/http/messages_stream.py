"""The Messages API's content blocks and streaming events, built from a chat turn's events.

One `MessageBuilder` per message. The event order is Anthropic's (https://docs.anthropic.com/
en/docs/build-with-claude/streaming, and the `anthropic` SDK's `lib/streaming/_messages.py`,
which accumulates it):

    message_start                      (the message with empty content, usage.input_tokens)
    content_block_start  (index 0)     then one ping, after the first block starts
    content_block_delta ...            text_delta | thinking_delta | input_json_delta
    content_block_stop
    ... one start/deltas/stop per block, blocks sequential: thinking, text, tool_use ...
    message_delta                      (stop_reason, stop_sequence, usage.output_tokens)
    message_stop

Blocks are sequential as Anthropic streams them: reasoning text opens a `thinking` block, answer
text a `text` block, each tool call a `tool_use` block whose `input` streams as JSON text
(`input_json_delta.partial_json`, a prefix of the arguments object); a new kind closes the open
block. Thinking blocks carry an empty `signature` (nothing here signs reasoning). A whole
message runs the same builder and keeps its blocks.
"""

from __future__ import annotations

import json
from typing import Any

from moe_engine.server.parsers.base import DeltaMessage, ToolCallDelta


def tool_use_id(call_id: str) -> str:
    """The tool_use id of a call: Anthropic's `toolu_` prefix on the call id's digits."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments text as the `input` object ({} when cut short or not an object)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageBuilder:
    """Content blocks and events of one message.

    Args:
        message: the message object without content / stop_reason / usage (id, model, role).
        input_tokens: the prompt's length (tokens), reported in message_start's usage.
    """

    def __init__(self, message: dict[str, Any], input_tokens: int) -> None:
        self.message = message
        self.input_tokens = input_tokens
        self.blocks: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}
        self._pinged = False

    def start(self) -> list[dict[str, Any]]:
        """`message_start`."""
        return [{"type": "message_start", "message": self.snapshot(None, None, 0)}]

    def snapshot(self, stop_reason: str | None, stop_sequence: str | None,
                 output_tokens: int) -> dict[str, Any]:
        """The message now (its finished blocks)."""
        return {**self.message, "type": "message", "role": "assistant",
                "content": [self._public(b) for b in self.blocks if b is not self._open],
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": {"input_tokens": self.input_tokens, "output_tokens": output_tokens}}

    def add(self, delta: DeltaMessage) -> list[dict[str, Any]]:
        """The events of one delta: thinking first, then text, then tool_use blocks."""
        events: list[dict[str, Any]] = []
        if delta.reasoning_content:
            events += self._text("thinking", delta.reasoning_content)
        if delta.content:
            events += self._text("text", delta.content)
        for call in delta.tool_calls:
            events += self._call(call)
        return events

    def finish(self, stop_reason: str | None, stop_sequence: str | None,
               output_tokens: int) -> list[dict[str, Any]]:
        """Close the open block; `message_delta` and `message_stop`."""
        events = self._close()
        if not self._pinged:
            events.append({"type": "ping"})
            self._pinged = True
        events.append({"type": "message_delta",
                       "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                       "usage": {"output_tokens": output_tokens}})
        events.append({"type": "message_stop"})
        return events

    # -- blocks --------------------------------------------------------------------------------

    @staticmethod
    def _public(block: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in block.items() if not k.startswith("_")}
        if block["type"] == "tool_use":
            out["input"] = tool_input(block["_arguments"])
        return out

    def _begin(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self._open = block
        self.blocks.append(block)
        events.append({"type": "content_block_start", "index": len(self.blocks) - 1,
                       "content_block": {k: v for k, v in block.items()
                                         if not k.startswith("_")}})
        if not self._pinged:
            events.append({"type": "ping"})
            self._pinged = True
        return events

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            block = ({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                     else {"type": "text", "text": ""})
            events += self._begin(block)
        self._open[kind] += text
        delta = ({"type": "thinking_delta", "thinking": text} if kind == "thinking"
                 else {"type": "text_delta", "text": text})
        events.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                       "delta": delta})
        return events

    def _call(self, delta: ToolCallDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.id is not None:
            block = {"type": "tool_use", "id": tool_use_id(delta.id), "name": delta.name,
                     "input": {}, "_arguments": ""}
            events += self._begin(block)
            block["_index"] = len(self.blocks) - 1
            self._calls[delta.index] = block
        block = self._calls[delta.index]
        if delta.arguments:
            block["_arguments"] += delta.arguments
            events.append({"type": "content_block_delta", "index": block["_index"],
                           "delta": {"type": "input_json_delta",
                                     "partial_json": delta.arguments}})
        return events

    def _close(self) -> list[dict[str, Any]]:
        block, self._open = self._open, None
        if block is None:
            return []
        return [{"type": "content_block_stop", "index": self.blocks.index(block)}]
