"""One chat request, from body to submitted engine request: what `/v1/chat/completions` and the
APIs translated onto it (`chat_events`: /v1/responses, /v1/messages) share.

`prepare_chat` decides what `tool_choice` enforces and parses (`chat_tools.plan_tools`),
renders the messages and tools through the chat template (`chat_render`), tokenizes, applies
`truncate_prompt_tokens`, picks the reasoning parser (none for a constrained output: JSON from
its first token) and builds the `SamplingParams` (special tokens kept where the parsers read
marker tokens). `submit_chat` checks and submits it, naming the chat field that a refusal is
about. `PreparedChat.new_parse` makes one choice's parser state.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_engine.core.validation import truncate_prompt
from moe_engine.errors import RequestError
from moe_engine.sampling_params import SamplingParams
from moe_engine.server.http.chat_output import ChoiceParse, count_reasoning_tokens
from moe_engine.server.http.chat_render import render_text
from moe_engine.server.http.chat_tools import ToolPlan, plan_tools
from moe_engine.server.http.common import sampling_params, structured_outputs_from
from moe_engine.server.http.protocol import ChatCompletionRequest
from moe_engine.server.http.state import HttpState, PromptStreams
from moe_engine.server.parsers import registry


@dataclass
class PreparedChat:
    """A chat request ready to submit.

    Attributes:
        text: the rendered prompt text (the reasoning parser reads where it leaves the output).
        prompt: its token ids, after `truncate_prompt_tokens`.
        params: the request's SamplingParams.
        plan: what `tool_choice` enforces and which parser reads calls.
        reasoning: the reasoning parser's name, or None (off, or a constrained output).
        max_tokens_field: the body's field that set the token budget (for error messages).
    """

    text: str
    prompt: list[int]
    params: SamplingParams
    plan: ToolPlan
    reasoning: str | None
    max_tokens_field: str

    @property
    def parses(self) -> bool:
        """Whether any parser reads the output."""
        return self.reasoning is not None or self.plan.make_parser is not None

    def new_parse(self, state: HttpState) -> ChoiceParse:
        """One choice's parsers (reasoning, then tool calls; either may be absent)."""
        tools = self.plan.make_parser() if self.plan.make_parser else None
        if self.reasoning is None:
            return ChoiceParse(None, tools)
        skip, name, text = self.params.skip_special_tokens, self.reasoning, self.text

        def count(ids: list[int]) -> int:
            return count_reasoning_tokens(
                ids, lambda i: state.tokenizer.decode(i, skip_special_tokens=skip),
                lambda: registry.reasoning_parser(name, text))

        return ChoiceParse(registry.reasoning_parser(name, text), tools, count)


def render_body(state: HttpState, body: ChatCompletionRequest) -> str:
    """The prompt text of a chat body (`--chat-template` or the tokenizer's template).

    Raises:
        OpenAIError: 400 ("messages" or the template field) the template refuses.
    """
    return render_text(state.tokenizer, state.chat.chat_template, body.messages, body.tools,
                       add_generation_prompt=body.add_generation_prompt,
                       continue_final_message=body.continue_final_message,
                       chat_template_kwargs=body.chat_template_kwargs)


def prepare_chat(
    state: HttpState, body: ChatCompletionRequest, logprobs: int | None
) -> PreparedChat:
    """Render and tokenize `body` and build its SamplingParams (`logprobs` top alternatives
    per token, None: none).

    Raises:
        OpenAIError: 400 naming the field (tools, tool_choice, messages, response_format, a
            sampling field) the chat API or the template refuses.
    """
    settings = state.chat
    plan = plan_tools(body, settings.tool_parser, settings.enable_auto_tool_choice)
    structured = plan.structured or structured_outputs_from(body)
    text = render_body(state, body)
    prompt = list(state.tokenizer.encode(text, add_special_tokens=False))
    prompt = truncate_prompt(prompt, body.truncate_prompt_tokens, state.max_model_len())
    reasoning = None if structured is not None else settings.reasoning_parser
    max_tokens = body.max_completion_tokens or body.max_tokens
    field_name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    if max_tokens is None:
        max_tokens = max(1, state.max_model_len() - len(prompt))
    params = sampling_params(body, max_tokens, logprobs, structured)
    if plan.keep_special_tokens or (reasoning and settings.reasoning_keeps_special_tokens):
        params.skip_special_tokens = False  # the parsers read the formats' marker tokens
    return PreparedChat(text, prompt, params, plan, reasoning, field_name)


async def submit_chat(state: HttpState, prep: PreparedChat, prefix: str) -> PromptStreams:
    """Check and submit the request (engine request ids `<prefix>-...`).

    Raises:
        RequestError: the engine's refusal, its field named as the chat body names it
            (`max_completion_tokens` where that set the budget; `tools` for a schema of a
            forced tool choice that the grammar compiler refuses).
    """
    try:
        state.check_request(prep.prompt, prep.params, "messages")
        return await state.open_streams([prep.prompt], prep.params, prefix)
    except RequestError as exc:
        if exc.field == "max_tokens":
            exc.field = prep.max_tokens_field
        elif exc.field == "response_format" and prep.plan.structured is not None:
            exc = RequestError(exc.code, "tools", "tools" + exc.message[len("response_format"):])
        raise exc from None
