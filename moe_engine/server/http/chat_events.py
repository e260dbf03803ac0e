"""The seam between the chat pipeline and the APIs translated onto it (/v1/responses,
/v1/messages): a normalized chat turn in, per-choice events out.

    run = await start_turn(state, ChatTurn(messages=[...], max_tokens=64, stream=True))
    async for event in run.events():      # TurnDelta ... then one TurnEnd per choice
        ...
    # run.prompt_tokens, run.request_id; run.close() aborts what still runs

`ChatTurn.messages` are OpenAI chat messages as dicts (`role` system/user/assistant/tool,
`content` text, an assistant's `tool_calls` `[{"id", "type": "function", "function": {"name",
"arguments"}}]`, a tool message's `tool_call_id`); `tools` are chat tools (`[{"type":
"function", "function": {"name", "description", "parameters"}}]`). Each API translates its own
request into this shape and the events back into its own items, so the rendering, sampling,
admission and parsing are the chat pipeline's, written once.

Every refusal happens in `start_turn`, before the caller sends a status line, and names the
caller's field (`ChatTurn.fields` maps the chat names "messages", "max_tokens", "stop",
"tools", "tool_choice", "temperature", "top_p", "top_k" to the API's own).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from moe_engine.core.validation import param_error
from moe_engine.errors import ParamError, RequestError
from moe_engine.sampling_params import OUTPUT_DELTA, OUTPUT_FINAL_ONLY, SamplingParams
from moe_engine.server.http.errors import OpenAIError
from moe_engine.server.http.state import HttpState, PromptStreams
from moe_engine.server.http.tool_choice import forced_tool_stream, tool_choice_grammar
from moe_engine.server.parsers.base import DeltaMessage, OutputStream, ToolCall


@dataclass
class ChatTurn:
    """A chat request normalized from another API (see the module docstring for shapes).

    Attributes:
        messages: the conversation (OpenAI chat messages as dicts).
        max_tokens: the most tokens to generate, or None (the rest of the context).
        tools: chat function tools, or None.
        tool_choice: "none", "auto", "required", or a function name (a named choice).
        parallel_tool_calls: False: at most one call (`required` forces exactly one).
        temperature, top_p, top_k, seed: sampling (None: the engine's defaults).
        stop: stop strings, or None.
        stream: deltas per engine step (True) or one output per choice (False).
        chat_template_kwargs: extra variables for the chat template (`enable_thinking`).
        continue_final_message: the reply continues the last (assistant) message instead of
            opening a new turn (transformers' `continue_final_message`).
        fields: chat field name -> the API's field name, for error messages.
    """

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] | None = None
    stream: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    continue_final_message: bool = False
    fields: dict[str, str] = field(default_factory=dict)

    def name_of(self, name: str) -> str:
        """The API's name of chat field `name`."""
        return self.fields.get(name, name)


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
            output held tool calls (OpenAI chat's word).
        stop_reason: the stop string or stop token id that ended it; None for EOS.
        content, reasoning: the whole answer text and reasoning text.
        tool_calls: the finished calls, in order.
        output_tokens: tokens generated; reasoning_tokens: of them, those before the
            reasoning ended (counted per engine output).
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
                 make_stream: Any) -> None:
        self.streams = streams
        self.request_id = streams.request_id
        self.prompt_tokens = prompt_tokens
        self._outputs = [make_stream() for _ in range(n)]
        self._reasoning_tokens = [0] * n

    async def events(self) -> AsyncIterator[TurnDelta | TurnEnd]:
        """TurnDelta for every engine output that added something, then TurnEnd per choice.

        Raises:
            RequestError: the engine failed the request while it ran.
        """
        async for batch in self.streams.outputs():
            for _, out in batch:
                stream = self._outputs[out.index]
                before = stream.reasoning_ended
                delta = stream.feed(out.new_text)
                if not before:
                    self._reasoning_tokens[out.index] += len(out.new_token_ids)
                if delta:
                    yield TurnDelta(out.index, delta)
                if out.finished:
                    last = stream.finish()
                    if last:
                        yield TurnDelta(out.index, last)
                    yield self._end(out)

    def _end(self, out: Any) -> TurnEnd:
        stream = self._outputs[out.index]
        reason = str(out.finish_reason) if out.finish_reason is not None else None
        calls = stream.tool_calls
        if calls and reason == "stop":
            reason = "tool_calls"
        return TurnEnd(out.index, reason, out.stop_reason, stream.content, stream.reasoning,
                       calls, out.num_output_tokens, self._reasoning_tokens[out.index])

    async def close(self) -> None:
        await self.streams.close()


def render_turn(state: HttpState, turn: ChatTurn) -> list[int]:
    """The conversation through the chat template (with `tools`), as token ids.

    Raises:
        OpenAIError: 400 naming the messages field without a chat template, or when the
            template refuses the conversation.
    """
    tok = state.tokenizer
    name = turn.name_of("messages")
    if tok is None or not getattr(tok, "chat_template", None):
        what = "no tokenizer" if tok is None else "a tokenizer without a chat template"
        raise OpenAIError(400, f"{name}: the served model has {what}", name, "unsupported_value")
    conversation = [{**m, "content": m.get("content") or ""} for m in turn.messages]
    try:
        text = tok.apply_chat_template(
            conversation, tools=turn.tools or None, tokenize=False,
            add_generation_prompt=not turn.continue_final_message,
            continue_final_message=turn.continue_final_message, **turn.chat_template_kwargs,
        )
    except Exception as exc:  # noqa: BLE001 - jinja's errors (TemplateError, raise_exception)
        raise OpenAIError(400, f"{name}: the chat template refused them: {exc}", name,
                          "invalid_value") from exc
    return list(tok.encode(text, add_special_tokens=False))


def turn_params(turn: ChatTurn, max_tokens: int) -> SamplingParams:
    """SamplingParams of a turn (greedy when temperature is 0; a forced tool choice adds its
    grammar).

    Raises:
        RequestError: INVALID_ARGUMENT naming the API's field SamplingParams refused.
    """
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens, "stop": turn.stop, "seed": turn.seed,
        "output_kind": OUTPUT_DELTA if turn.stream else OUTPUT_FINAL_ONLY,
    }
    for name in ("temperature", "top_p", "top_k"):
        if getattr(turn, name) is not None:
            kwargs[name] = getattr(turn, name)
    grammar = tool_choice_grammar(turn.tools, turn.tool_choice, turn.name_of("tool_choice"),
                                  turn.parallel_tool_calls)
    if grammar is not None:
        kwargs["structured_outputs"] = grammar
    try:
        return SamplingParams(**kwargs)
    except ParamError as exc:
        error = param_error(exc)
        raise _renamed(error, turn) from exc


def _renamed(exc: RequestError, turn: ChatTurn) -> RequestError:
    name = turn.name_of(exc.field)
    if name != exc.field and exc.message.startswith(exc.field):
        exc.message = name + exc.message[len(exc.field):]
    exc.field = name
    return exc


async def start_turn(state: HttpState, turn: ChatTurn, prefix: str = "turn") -> TurnRun:
    """Render, check and submit the turn; returns once the engine accepted it.

    Args:
        prefix: the engine request id's prefix (`resp`, `msg`: `<prefix>-<X-Request-Id>`).

    Raises:
        OpenAIError / RequestError: the HTTP error (400, 429, 503) naming the API's field.
    """
    state.check_ready()
    prompt = render_turn(state, turn)
    max_tokens = turn.max_tokens
    if max_tokens is None:
        max_tokens = max(1, state.max_model_len() - len(prompt))
    params = turn_params(turn, max_tokens)
    try:
        state.check_request(prompt, params, turn.name_of("messages"))
    except RequestError as exc:
        raise _renamed(exc, turn) from None
    streams = await state.open_streams([prompt], params, prefix)
    return TurnRun(streams, len(prompt), 1, lambda: _output_stream(turn))


def _output_stream(turn: ChatTurn) -> OutputStream:
    """One choice's parser stream: the forced tool choice's JSON reader, else plain text."""
    forced = forced_tool_stream(turn.tools, turn.tool_choice)
    if forced is not None:
        return forced
    return OutputStream(None, None)
