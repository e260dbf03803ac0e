"""POST /v1/messages (Anthropic's Messages API), as a translation onto the chat pipeline
(`chat_events`), with every error in Anthropic's shape.

The request becomes one chat turn: `system` a system message; user text blocks user messages
and `tool_result` blocks `tool` messages (in block order); assistant text blocks the content,
`thinking` blocks the `reasoning_content` and `tool_use` blocks the `tool_calls` of one
assistant message; a last assistant message is continued (Anthropic's prefill: the reply goes
on from its text). `tools` go to the chat template in the chat shape; `tool_choice` `any` is
the chat `required`, `tool` a named choice (both enforced with structured output), `auto`
and `none` as in chat; `stop_sequences` are stop strings; `thinking` sets the template's
`enable_thinking` / `thinking`. The turn's events come back as content blocks and Anthropic's
streaming events (`messages_stream.py`).

Errors (`AnthropicRoute`): `{"type": "error", "error": {"type": "invalid_request_error",
"message": "max_tokens: field required"}}`, the field named first in the message, with the
status codes of the OpenAI endpoints (400, 404, 429, 503). A failure after the stream started
is an `error` event.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute

from moe_engine.errors import RequestError
from moe_engine.server.http.cancellation import with_cancellation
from moe_engine.server.http.chat_events import (
    ChatTurn,
    TurnDelta,
    TurnEnd,
    TurnRun,
    count_turn_tokens,
    start_turn,
)
from moe_engine.server.http.errors import OpenAIError, validation_error
from moe_engine.server.http.messages_protocol import (
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    anthropic_error,
)
from moe_engine.server.http.messages_stream import MessageBuilder
from moe_engine.server.http.state import HttpState

#: Chat field -> Messages field, for error messages.
_FIELDS = {"messages": "messages", "max_tokens": "max_tokens", "stop": "stop_sequences",
           "response_format": "output_config.format", "tools[].function": "input_schema"}


def _as_openai_error(exc: Exception) -> OpenAIError | None:
    if isinstance(exc, RequestValidationError):
        return validation_error(exc)
    if isinstance(exc, RequestError):
        return OpenAIError.from_request_error(exc)
    if isinstance(exc, OpenAIError):
        return exc
    return None


class AnthropicRoute(APIRoute):
    """A route whose refusals (pydantic's, the engine's, ours) answer in Anthropic's shape
    (FastAPI's documented pattern for a custom APIRoute: wrap `get_route_handler`)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except (RequestValidationError, RequestError, OpenAIError) as exc:
                err = _as_openai_error(exc)
                assert err is not None
                return JSONResponse(anthropic_error(err.status, err.message),
                                    status_code=err.status)

        return route


router = APIRouter(route_class=AnthropicRoute)


def system_text(system: str | list[TextBlock] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "\n".join(block.text for block in system)


def _user_messages(content: str | list[Any]) -> list[dict[str, Any]]:
    """A user turn's blocks, in order: text runs as user messages, tool results as tool ones."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict[str, Any]] = []
    for block in content:
        if isinstance(block, ToolResultBlock):
            text = block.text()
            if block.is_error:
                text = f"Error: {text}"
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
        elif isinstance(block, TextBlock):
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += "\n" + block.text
            else:
                out.append({"role": "user", "content": block.text})
        else:
            raise OpenAIError(400, f"messages: a user message cannot hold a {block.type} block",
                              "messages", "invalid_value")
    return out


def _assistant_message(content: str | list[Any]) -> dict[str, Any]:
    """An assistant turn's blocks as one chat message (text, reasoning, tool calls)."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for block in content:
        if isinstance(block, TextBlock):
            message["content"] += block.text
        elif isinstance(block, ThinkingBlock):
            message["reasoning_content"] = message.get("reasoning_content", "") + block.thinking
        elif isinstance(block, ToolUseBlock):
            message.setdefault("tool_calls", []).append(
                {"id": block.id, "type": "function",
                 "function": {"name": block.name, "arguments": json.dumps(block.input)}})
        elif isinstance(block, ToolResultBlock):
            raise OpenAIError(400, "messages: an assistant message cannot hold a tool_result "
                              "block", "messages", "invalid_value")
    if message.get("tool_calls") and not message["content"]:
        message["content"] = None  # as chat clients send it (DeepSeek's templates test none)
    return message


def to_turn(body: MessagesRequest) -> ChatTurn:
    """The chat turn of a Messages request.

    Raises:
        OpenAIError: 400 naming the field (max_tokens, tool_choice, thinking, a block).
    """
    if body.max_tokens is not None and body.max_tokens < 1:
        raise OpenAIError(400, f"max_tokens: must be at least 1, got {body.max_tokens}",
                          "max_tokens", "invalid_value")
    system = system_text(body.system)
    messages = [{"role": "system", "content": system}] if system else []
    for message in body.messages:
        if message.role == "user":
            messages += _user_messages(message.content)
        else:
            messages.append(_assistant_message(message.content))
    choice = body.tool_choice
    tool_choice = "auto"
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise OpenAIError(400, "tool_choice.name: required with type 'tool'",
                              "tool_choice.name", "invalid_value")
        tool_choice = {"auto": "auto", "none": "none", "any": "required"}.get(choice.type,
                                                                                choice.name)
    return ChatTurn(
        messages=messages, max_tokens=body.max_tokens,
        tools=[t.to_chat() for t in body.tools] if body.tools else None,
        tool_choice=tool_choice,
        parallel_tool_calls=not (choice is not None and choice.disable_parallel_tool_use),
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        stop=body.stop_sequences or None, stream=body.stream,
        chat_template_kwargs=_thinking_kwargs(body),
        continue_final_message=body.messages[-1].role == "assistant", fields=_FIELDS,
        response_format=_response_format(body),
    )


def _response_format(body: MessagesRequest) -> dict[str, Any] | None:
    """`output_config.format` as chat's `response_format`."""
    fmt = body.output_config.format if body.output_config is not None else None
    if fmt is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}


def _thinking_kwargs(body: MessagesRequest) -> dict[str, Any]:
    """The chat template variables of `thinking` (Qwen3's `enable_thinking`, DeepSeek-V3.1's
    and GLM-4.5's `thinking`), after checking `budget_tokens`, and of `output_config.effort`
    (`reasoning_effort`, gpt-oss's).

    Raises:
        OpenAIError: 400 naming thinking.budget_tokens (missing, < 1, >= max_tokens).
    """
    effort = body.output_config.effort if body.output_config is not None else None
    kwargs: dict[str, Any] = {} if effort is None else {"reasoning_effort": effort}
    thinking = body.thinking
    if thinking is None:
        return kwargs
    if thinking.type == "enabled":
        budget = thinking.budget_tokens
        limit = body.max_tokens
        if budget is None or budget < 1 or (limit is not None and budget >= limit):
            raise OpenAIError(
                400, f"thinking.budget_tokens: must be at least 1 and less than max_tokens "
                f"({body.max_tokens}), got {budget}", "thinking.budget_tokens", "invalid_value")
    on = thinking.type != "disabled"
    return {**kwargs, "enable_thinking": on, "thinking": on}


def stop_reason(end: TurnEnd, stop_sequences: list[str] | None) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of a finished turn (None for an abort)."""
    if end.finish_reason == "length":
        return "max_tokens", None
    if end.tool_calls and end.finish_reason in ("stop", "tool_calls"):
        return "tool_use", None
    if end.finish_reason == "stop":
        if isinstance(end.stop_reason, str) and end.stop_reason in (stop_sequences or []):
            return "stop_sequence", end.stop_reason
        return "end_turn", None
    return None, None


@router.post("/v1/messages")
@with_cancellation
async def create_message(body: MessagesRequest, request: Request):
    """A Message, or an SSE stream of Anthropic's events (`event:` + `data:` lines).

    Raises (as Anthropic-shaped responses, `AnthropicRoute`):
        OpenAIError / RequestError: the HTTP error (400, 404, 429, 503) before any output.
    """
    state: HttpState = request.app.state.http
    state.check_ready()
    state.check_model(body.model)
    run = await start_turn(state, to_turn(body), "msg")
    builder = MessageBuilder({"id": f"msg_{uuid.uuid4().hex}", "model": state.served_model_name},
                             run.prompt_tokens)
    if body.stream:
        return StreamingResponse(_stream(run, builder, body), media_type="text/event-stream")
    try:
        async for event in _events(run, builder, body):
            if event["type"] == "message_delta":
                final = builder.snapshot(event["delta"]["stop_reason"],
                                         event["delta"]["stop_sequence"],
                                         event["usage"]["output_tokens"])
    finally:
        await run.close()
    return JSONResponse(final)


async def _events(run: TurnRun, builder: MessageBuilder,
                  body: MessagesRequest) -> AsyncIterator[dict[str, Any]]:
    for event in builder.start():
        yield event
    async for event in run.events():
        if isinstance(event, TurnDelta):
            for e in builder.add(event.delta):
                yield e
        else:
            reason, sequence = stop_reason(event, body.stop_sequences)
            for e in builder.finish(reason, sequence, event.output_tokens):
                yield e


def sse_event(event: dict[str, Any]) -> bytes:
    """One SSE event with its `event:` line (Anthropic's streams name every event)."""
    data = json.dumps(event, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


async def _stream(run: TurnRun, builder: MessageBuilder,
                  body: MessagesRequest) -> AsyncIterator[bytes]:
    """The SSE body; an engine failure mid-stream ends it with an `error` event."""
    try:
        async for event in _events(run, builder, body):
            yield sse_event(event)
    except RequestError as exc:
        err = OpenAIError.from_request_error(exc)
        yield sse_event(anthropic_error(err.status, err.message))
    finally:
        await run.close()


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> JSONResponse:
    """`{"input_tokens": N}`: the prompt the request would have, through the same template
    (Anthropic's token-counting endpoint, which agents call before long requests)."""
    state: HttpState = request.app.state.http
    state.check_model(body.model)
    return JSONResponse({"input_tokens": count_turn_tokens(state, to_turn(body))})
