"""POST /v1/responses and GET /v1/responses/{id} (OpenAI's Responses API), as a translation
onto the chat pipeline (`chat_events`).

The request becomes one chat turn: `instructions` a system message, then the stored
conversation of `previous_response_id` (`responses_store`), then the `input` items (messages;
`function_call` items as an assistant message's `tool_calls`; `function_call_output` items as
`tool` messages; `reasoning` items as the next assistant message's `reasoning_content`);
`tools` go to the chat template in the chat shape; `tool_choice` "required" or a named
function is enforced with structured output (`tool_choice.py`); `max_output_tokens` is the
chat `max_tokens`; `reasoning.effort` goes to the template as `reasoning_effort`. The turn's
events come back as output items and streaming events (`responses_stream.py`).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from moe_engine.errors import RequestError
from moe_engine.server.http.cancellation import with_cancellation
from moe_engine.server.http.chat_events import ChatTurn, TurnDelta, TurnEnd, TurnRun, start_turn
from moe_engine.server.http.errors import OpenAIError, validation_error
from moe_engine.server.http.responses_protocol import (
    ITEM_TYPES,
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)
from moe_engine.server.http.responses_store import ResponseStore
from moe_engine.server.http.responses_stream import ResponseBuilder, item_id
from moe_engine.server.http.state import HttpState

router = APIRouter()

#: Chat field -> Responses field, for error messages.
_FIELDS = {"messages": "input", "max_tokens": "max_output_tokens", "tools": "tools",
           "tool_choice": "tool_choice", "response_format": "text.format",
           "tools[].function": "flat"}


def response_store(request: Request) -> ResponseStore:
    """The app's response store (made on first use; one per app, for the server's life)."""
    store = getattr(request.app.state, "responses", None)
    if store is None:
        store = request.app.state.responses = ResponseStore()
    return store


def parse_items(items: list[dict[str, Any]]) -> list[Any]:
    """Validate each input item by its `type` (a message may leave it out).

    Raises:
        OpenAIError: 400 naming the item and field (`input[1].role`).
    """
    parsed = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        model = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise OpenAIError(
                400, f"input[{i}].type: {kind!r} is not an item type served here (one of "
                f"{sorted(ITEM_TYPES)})", f"input[{i}].type", "invalid_value",
            )
        try:
            parsed.append(model.model_validate(item))
        except ValidationError as exc:
            errors = [{**e, "loc": ("body", "input", i, *e["loc"])} for e in exc.errors()]
            raise validation_error(RequestValidationError(errors)) from None
    return parsed


def items_to_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as chat messages (consecutive function calls share one assistant turn)."""
    messages: list[dict[str, Any]] = []
    reasoning = ""
    names: dict[str, str] = {}
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning += item.text()
            continue
        if isinstance(item, FunctionCallOutputItem):
            message = {"role": "tool", "tool_call_id": item.call_id, "content": item.text()}
            if item.call_id in names:
                message["name"] = names[item.call_id]
            messages.append(message)
            continue
        if isinstance(item, FunctionCallItem):
            names[item.call_id] = item.name
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
                continue
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        else:
            assert isinstance(item, MessageItem)
            role = "system" if item.role == "developer" else item.role
            message = {"role": role, "content": item.text()}
        if message["role"] == "assistant" and reasoning:
            message["reasoning_content"], reasoning = reasoning, ""
        messages.append(message)
    return messages


def output_messages(end: TurnEnd) -> list[dict[str, Any]]:
    """A finished output as the chat message that continues the conversation."""
    content = end.content if end.content or not end.tool_calls else None
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if end.reasoning:
        message["reasoning_content"] = end.reasoning
    if end.tool_calls:
        message["tool_calls"] = [c.to_openai() for c in end.tool_calls]
    return [message]


def to_turn(body: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[ChatTurn, list]:
    """The chat turn of a request, and the conversation to store after it (no instructions).

    Raises:
        OpenAIError: 400 naming the field (an input item, an empty input).
    """
    if isinstance(body.input, str):
        new = [{"role": "user", "content": body.input}]
    else:
        new = items_to_messages(parse_items(body.input))
    conversation = history + new
    if not conversation:
        raise OpenAIError(400, "input: must not be empty", "input", "invalid_value")
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    choice = body.tool_choice
    tool_choice = choice if isinstance(choice, str) else choice.name if choice else "auto"
    kwargs = {}
    if body.reasoning is not None and body.reasoning.effort is not None:
        kwargs["reasoning_effort"] = body.reasoning.effort
    turn = ChatTurn(
        messages=system + conversation, max_tokens=body.max_output_tokens,
        tools=[t.to_chat() for t in body.tools] if body.tools else None,
        tool_choice=tool_choice, parallel_tool_calls=body.parallel_tool_calls is not False,
        temperature=body.temperature, top_p=body.top_p,
        stream=body.stream, chat_template_kwargs=kwargs, fields=_FIELDS,
        response_format=fmt.to_chat() if (fmt := _text_format(body)) else None,
    )
    return turn, conversation


def _text_format(body: ResponsesRequest) -> Any:
    return body.text.format if body.text is not None else None


def _skeleton(state: HttpState, body: ResponsesRequest, response_id: str) -> dict[str, Any]:
    """The response object's echoed request fields (everything but output/status/usage)."""
    choice = body.tool_choice
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()),
        "model": state.served_model_name, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                      "summary": None},
        "store": body.store, "temperature": body.temperature, "top_p": body.top_p,
        "text": {"format": fmt.echo() if (fmt := _text_format(body)) else {"type": "text"}},
        "tool_choice": choice.model_dump() if choice is not None and not isinstance(choice, str)
        else (choice or "auto"),
        "tools": [{**t.model_dump(), "parameters": t.to_chat()["function"]["parameters"]}
                  for t in body.tools or []],
        "truncation": "disabled", "user": body.user,
    }


def responses_usage(run: TurnRun, end: TurnEnd) -> dict[str, Any]:
    return {
        "input_tokens": run.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": end.output_tokens,
        "output_tokens_details": {"reasoning_tokens": end.reasoning_tokens},
        "total_tokens": run.prompt_tokens + end.output_tokens,
    }


@router.post("/v1/responses")
@with_cancellation
async def create_response(body: ResponsesRequest, request: Request):
    """A Response object, or an SSE stream of its events (`event:` + `data:` lines).

    Raises:
        OpenAIError / RequestError: the HTTP error (400, 404, 429, 503) before any output.
    """
    state: HttpState = request.app.state.http
    state.check_ready()
    state.check_model(body.model)
    store = response_store(request)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        history = list(store.get(body.previous_response_id).conversation)
    turn, conversation = to_turn(body, history)
    run = await start_turn(state, turn, "resp")
    response_id = item_id("resp")
    builder = ResponseBuilder(_skeleton(state, body, response_id))

    def keep(end: TurnEnd, response: dict[str, Any]) -> None:
        if body.store:
            store.put(response_id, conversation + output_messages(end), response)

    if body.stream:
        return StreamingResponse(_stream(run, builder, keep), media_type="text/event-stream")
    try:
        events = [e async for e in _events(run, builder)]
    finally:
        await run.close()
    final = events[-1]["response"]
    keep(builder.end, final)
    return JSONResponse(final)


async def _events(run: TurnRun, builder: ResponseBuilder) -> AsyncIterator[dict[str, Any]]:
    """Every event of the response, in order (the last holds the final response)."""
    for event in builder.start():
        yield event
    async for event in run.events():
        if isinstance(event, TurnDelta):
            for e in builder.add(event.delta):
                yield e
        else:
            for e in builder.finish(event, responses_usage(run, event)):
                yield e


def sse_event(event: dict[str, Any]) -> bytes:
    """One SSE event with its `event:` line (the Responses API names each event)."""
    data = json.dumps(event, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


async def _stream(run: TurnRun, builder: ResponseBuilder, keep: Any) -> AsyncIterator[bytes]:
    """The SSE body; an engine failure mid-stream ends it with an `error` event."""
    try:
        async for event in _events(run, builder):
            if event["type"] in ("response.completed", "response.incomplete"):
                keep(builder.end, event["response"])
            yield sse_event(event)
    except RequestError as exc:
        err = OpenAIError.from_request_error(exc)
        yield sse_event(builder.error(err.code, err.message, err.param))
    finally:
        await run.close()


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> JSONResponse:
    """A stored response (404 in OpenAI's shape when unknown or evicted)."""
    request.app.state.http.check_ready()
    return JSONResponse(response_store(request).get(response_id, "response_id").response)
