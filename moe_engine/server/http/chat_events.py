"""The seam between the chat pipeline and the APIs translated onto it (/v1/responses,
/v1/messages): a normalized chat turn in, per-choice events out.

    run = await start_turn(state, ChatTurn(messages=[...], max_tokens=64, stream=True))
    async for event in run.events():      # TurnDelta ... then one TurnEnd per choice
        ...
    # run.prompt_tokens, run.request_id; run.close() aborts what still runs

`ChatTurn.messages` are OpenAI chat messages as dicts (`role` system/user/assistant/tool,
`content` text or None, an assistant's `tool_calls` `[{"id", "type": "function", "function":
{"name", "arguments"}}]` and `reasoning_content`, a tool message's `tool_call_id`); `tools` are
chat tools (`[{"type": "function", "function": {"name", "description", "parameters"}}]`). Each
API translates its own request into this shape and the events back into its own items.

The turn becomes a `ChatCompletionRequest` and goes through the chat pipeline's own pieces, as
`/v1/chat/completions` uses them: `chat_tools.plan_tools` (tool_choice: `auto` through the
server's tool parser, `required` / named enforced with structured output), `response_format`
(structured output), `chat_render`
(`--chat-template`, tools, `continue_final_message`, `chat_template_kwargs`), the server's
reasoning parser, `common.sampling_params`, and one `chat_output.ChoiceParse` per choice.

Every refusal happens in `start_turn`, before the caller sends a status line, and names the
caller's field (`ChatTurn.fields` maps the chat names "messages", "max_tokens", "stop",
"tools", "tool_choice", ... to the API's own).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from moe_engine.errors import RequestError
from moe_engine.server.http.chat_output import ChoiceParse
from moe_engine.server.http.chat_prepare import prepare_chat, render_body, submit_chat
from moe_engine.server.http.common import Choice
from moe_engine.server.http.errors import OpenAIError, validation_error
from moe_engine.server.http.protocol import ChatCompletionRequest
from moe_engine.server.http.state import HttpState, PromptStreams
from moe_engine.server.parsers.base import DeltaMessage, ToolCall

#: Choices that do not name a function.
_CHOICES = ("none", "auto", "required")


@dataclass
class ChatTurn:
    """A chat request normalized from another API (see the module docstring for shapes).

    Attributes:
        messages: the conversation (OpenAI chat messages as dicts).
        max_tokens: the most tokens to generate, or None (the rest of the context).
        tools: chat function tools, or None.
        tool_choice: "none", "auto", "required", or a function name (a named choice); None:
            "auto" with tools, else "none".
        parallel_tool_calls: False: at most one call (`required` forces exactly one).
        temperature, top_p, top_k, seed: sampling (None: the engine's defaults).
        stop: stop strings, or None.
        stream: deltas per engine step (True) or one output per choice (False).
        chat_template_kwargs: extra variables for the chat template (`enable_thinking`).
        continue_final_message: the reply continues the last (assistant) message instead of
            opening a new turn (transformers' `continue_final_message`).
        response_format: chat's `response_format` (`{"type": "json_schema", "json_schema":
            {"name", "schema"}}` or `{"type": "json_object"}`): structured output.
        fields: chat field name -> the API's field name, for error messages.
    """

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | None = None
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] | None = None
    stream: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    continue_final_message: bool = False
    response_format: dict[str, Any] | None = None
    fields: dict[str, str] = field(default_factory=dict)

    def name_of(self, name: str) -> str:
        """The API's name of chat field `name` (or of a path under it: `messages[2].role`)."""
        head = name.split("[")[0].split(".")[0]
        return self.fields.get(head, head) + name[len(head):]

    def chat_request(self) -> ChatCompletionRequest:
        """The turn as the chat API's request body.

        Raises:
            OpenAIError: 400 naming the API's field for a message or tool the chat API refuses.
        """
        choice: Any = self.tool_choice
        if choice is not None and choice not in _CHOICES:
            choice = {"type": "function", "function": {"name": choice}}
        body: dict[str, Any] = {
            "messages": self.messages, "max_tokens": self.max_tokens, "tools": self.tools,
            "tool_choice": choice if self.tools or choice not in ("auto", None) else None,
            "parallel_tool_calls": self.parallel_tool_calls, "stop": self.stop,
            "seed": self.seed, "stream": self.stream,
            "chat_template_kwargs": self.chat_template_kwargs or None,
            "add_generation_prompt": not self.continue_final_message,
            "continue_final_message": self.continue_final_message,
            "response_format": self.response_format,
        }
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise self.renamed(validation_error(RequestValidationError(
                [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]))) from None

    def renamed(self, exc: OpenAIError | RequestError) -> Any:
        """`exc` with its field (and the message's leading field) in the API's names."""
        old = exc.param if isinstance(exc, OpenAIError) else exc.field
        if not old:
            return exc
        new = self.name_of(old)
        if new != old and exc.message.startswith(old):
            exc.message = new + exc.message[len(old):]
            exc.args = (exc.message,)
        if isinstance(exc, OpenAIError):
            exc.param = new
        else:
            exc.field = new
        return exc


@dataclass
class TurnDelta:
    """What one engine output added to choice `index` (text, reasoning, tool-call pieces)."""

    index: int
    delta: DeltaMessage


@dataclass
class TurnEnd:
    """Choice `index` finished.

    Attributes:
        finish_reason: "stop", "length", "abort" (the engine's), or "tool_calls" when the
            output held tool calls and the model stopped by itself (chat's rule).
        stop_reason: the stop string or stop token id that ended it; None for EOS.
        content, reasoning: the whole answer text and reasoning text.
        tool_calls: the finished calls, in order.
        output_tokens: tokens generated; reasoning_tokens: of them, the reasoning's (the
            shortest prefix whose text ends it, `chat_output.count_reasoning_tokens`).
    """

    index: int
    finish_reason: str | None
    stop_reason: int | str | None
    content: str
    reasoning: str
    tool_calls: list[ToolCall]
    output_tokens: int
    reasoning_tokens: int


class TurnRun:
    """The running engine request of one turn (see `start_turn`)."""

    def __init__(self, streams: PromptStreams, prompt_tokens: int, n: int,
                 new_parse: Callable[[], ChoiceParse]) -> None:
        self.streams = streams
        self.request_id = streams.request_id
        self.prompt_tokens = prompt_tokens
        self._parses = [new_parse() for _ in range(n)]
        self._choices = [Choice(i) for i in range(n)]

    async def events(self) -> AsyncIterator[TurnDelta | TurnEnd]:
        """TurnDelta for every engine output that added something, then TurnEnd per choice.

        Raises:
            RequestError: the engine failed the request while it ran.
        """
        async for batch in self.streams.outputs():
            for _, out in batch:
                parse, choice = self._parses[out.index], self._choices[out.index]
                choice.add(out)
                delta = parse.feed(out)
                if delta:
                    yield TurnDelta(out.index, delta)
                if out.finished:
                    yield self._end(parse, choice, out)

    @staticmethod
    def _end(parse: ChoiceParse, choice: Choice, out: Any) -> TurnEnd:
        s = parse.stream
        return TurnEnd(out.index, parse.finish_reason(choice.finish_reason), out.stop_reason,
                       s.content, s.reasoning, s.tool_calls, choice.num_output_tokens,
                       parse.reasoning_tokens(choice.token_ids))

    async def close(self) -> None:
        await self.streams.close()


def count_turn_tokens(state: HttpState, turn: ChatTurn) -> int:
    """The prompt length of a turn (tokens), as `start_turn` would submit it.

    Raises:
        OpenAIError: 400 naming the API's field the chat template or the chat API refuses.
    """
    state.check_ready()
    body = turn.chat_request()
    try:
        text = render_body(state, body)
    except OpenAIError as exc:
        raise turn.renamed(exc) from None
    return len(state.tokenizer.encode(text, add_special_tokens=False))


async def start_turn(state: HttpState, turn: ChatTurn, prefix: str = "turn") -> TurnRun:
    """Render, check and submit the turn as `/v1/chat/completions` does; returns once the
    engine accepted it.

    Args:
        prefix: the engine request id's prefix (`resp`, `msg`: `<prefix>-<X-Request-Id>`).

    Raises:
        OpenAIError / RequestError: the HTTP error (400, 429, 503) naming the API's field.
    """
    state.check_ready()
    body = turn.chat_request()
    try:
        prep = prepare_chat(state, body, None)
        streams = await submit_chat(state, prep, prefix)
    except (OpenAIError, RequestError) as exc:
        raise turn.renamed(exc) from None
    return TurnRun(streams, len(prep.prompt), 1, lambda: prep.new_parse(state))
