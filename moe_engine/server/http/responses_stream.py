"""The Responses API's output items and streaming events, built from a chat turn's events.

One `ResponseBuilder` per response: `start()` gives `response.created` and
`response.in_progress`; `add(delta)` the events a `DeltaMessage` adds; `finish(end, usage)` the
closing events of the open item and `response.completed` (or `response.incomplete` when
`max_output_tokens` cut the output, `response.cancelled` never: an aborted output is
`incomplete` too, as a drain ends it). Items are sequential, as OpenAI streams them:
reasoning text opens a `reasoning` item, answer text a `message` item with one `output_text`
part, each tool call a `function_call` item; a new kind closes the open item. Per item the
order is OpenAI's (`openai` SDK `types/responses/response_stream_event.py`, and
`lib/streaming/responses/_responses.py`, which checks it):

    response.output_item.added
      response.content_part.added            (message, reasoning)
        response.output_text.delta ...       (message)  | response.reasoning_text.delta ...
      response.output_text.done               (message)  | response.reasoning_text.done
      response.content_part.done
      response.function_call_arguments.delta ... / .done   (function_call)
    response.output_item.done

Every event carries `sequence_number`, counting from 0. A whole (not streamed) response runs
the same builder and keeps its items, so both shapes come from one code path.
"""

from __future__ import annotations

import uuid
from typing import Any

from moe_engine.server.http.chat_events import TurnEnd
from moe_engine.server.parsers.base import DeltaMessage, ToolCallDelta


def item_id(prefix: str) -> str:
    """A fresh item id in OpenAI's shape (`msg_`, `rs_`, `fc_`, `resp_` + 32 hex digits)."""
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """Output items and events of one response.

    Args:
        response: the response object without `output` / `status` / `usage` (id, model,
            created_at, the echoed request fields); `snapshot` fills those in.
    """

    def __init__(self, response: dict[str, Any]) -> None:
        self.response = response
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}
        self._seq = 0
        #: The turn's end, once `finish` ran.
        self.end: TurnEnd | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, **fields, "sequence_number": self._seq}
        self._seq += 1
        return event

    def snapshot(self, status: str, usage: dict[str, Any] | None = None,
                 incomplete: str | None = None) -> dict[str, Any]:
        """The response object now (output items finished so far)."""
        return {**self.response, "status": status, "output": [dict(i) for i in self.items],
                "usage": usage, "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None}

    def start(self) -> list[dict[str, Any]]:
        """`response.created` and `response.in_progress`."""
        snap = self.snapshot("in_progress")
        return [self._event("response.created", response=snap),
                self._event("response.in_progress", response=snap)]

    def add(self, delta: DeltaMessage) -> list[dict[str, Any]]:
        """The events of one delta: reasoning first, then answer text, then tool calls."""
        events: list[dict[str, Any]] = []
        if delta.reasoning_content:
            events += self._text("reasoning", delta.reasoning_content)
        if delta.content:
            events += self._text("message", delta.content)
        for call in delta.tool_calls:
            events += self._call(call)
        return events

    def finish(self, end: TurnEnd, usage: dict[str, Any]) -> list[dict[str, Any]]:
        """Close the open item; `response.completed`, or `response.incomplete` for an output
        cut by `max_output_tokens` (or aborted)."""
        self.end = end
        incomplete = {"length": "max_output_tokens", "abort": "max_output_tokens"}.get(
            end.finish_reason or "")
        status = "incomplete" if incomplete else "completed"
        events = self._close(status)
        snap = self.snapshot(status, usage, incomplete)
        kind = "response.incomplete" if incomplete else "response.completed"
        events.append(self._event(kind, response=snap))
        return events

    def error(self, code: str | None, message: str, param: str | None) -> dict[str, Any]:
        """An `error` event (the engine failed the request mid-stream)."""
        return self._event("error", code=code, message=message, param=param)

    # -- items ---------------------------------------------------------------------------------

    def _add_item(self, item: dict[str, Any]) -> dict[str, Any]:
        self._open = item
        self.items.append(item)
        return self._event("response.output_item.added", output_index=len(self.items) - 1,
                           item=dict(item))

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            if kind == "reasoning":
                item = {"id": item_id("rs"), "type": "reasoning", "summary": [], "content": [],
                        "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"id": item_id("msg"), "type": "message", "role": "assistant",
                        "status": "in_progress", "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self._add_item(item))
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=len(self.items) - 1, content_index=0,
                                      part=dict(part)))
            item["_text"] = ""
        item = self._open
        item["_text"] += text
        where = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        if kind == "reasoning":
            events.append(self._event("response.reasoning_text.delta", **where, delta=text))
        else:
            events.append(self._event("response.output_text.delta", **where, delta=text,
                                      logprobs=[]))
        return events

    def _call(self, delta: ToolCallDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.id is not None:
            events += self._close("completed")
            item = {"id": item_id("fc"), "type": "function_call", "call_id": delta.id,
                    "name": delta.name, "arguments": "", "status": "in_progress"}
            events.append(self._add_item(item))
            item["_index"] = len(self.items) - 1
            self._calls[delta.index] = item
        item = self._calls[delta.index]
        if delta.arguments:
            item["arguments"] += delta.arguments
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=item["id"], output_index=item["_index"],
                                      delta=delta.arguments))
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        """The closing events of the open item (none when nothing is open)."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        where = {"item_id": item["id"], "output_index": index}
        events = []
        if item["type"] == "function_call":
            item.pop("_index")
            events.append(self._event("response.function_call_arguments.done", **where,
                                      name=item["name"], arguments=item["arguments"]))
        else:
            text = item.pop("_text")
            if item["type"] == "reasoning":
                part = {"type": "reasoning_text", "text": text}
                events.append(self._event("response.reasoning_text.done", **where,
                                          content_index=0, text=text))
            else:
                part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                events.append(self._event("response.output_text.done", **where,
                                          content_index=0, text=text, logprobs=[]))
            events.append(self._event("response.content_part.done", **where, content_index=0,
                                      part=dict(part)))
            item["content"] = [part]
        item["status"] = status  # "incomplete": the output was cut inside this item
        events.append(self._event("response.output_item.done", output_index=index,
                                  item=dict(item)))
        return events
