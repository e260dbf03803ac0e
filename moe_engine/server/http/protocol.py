"""Request and response bodies of the OpenAI-compatible HTTP API (pydantic v2).

Field names and defaults are OpenAI's (https://platform.openai.com/docs/api-reference, the
legacy Completions and the Chat Completions APIs), with vLLM's extra sampling fields (`top_k`,
`min_tokens`, `ignore_eos`). Fields clients commonly send that change nothing here (`store`,
`metadata`, `service_tier`, `user`) are accepted; fields of features this server does not
implement are accepted only at their neutral value (`NEUTRAL`: no `functions`, `best_of` 1)
and refused otherwise, naming the field. Tool calling
(`tools`, `tool_choice`, `parallel_tool_calls`, `tool_calls` and `tool` messages) follows the
Chat Completions reference; `chat_template_kwargs`, `continue_final_message` and
`add_generation_prompt` are vLLM's.
Other unknown fields are refused with HTTP 400 naming them, so that a misspelt `max_token` is
not dropped in silence (vLLM instead accepts and logs them); `--allow-unknown-fields` makes an
app drop them with one warning per field name, for SDKs that send other engines' extras.
Integers and booleans are strict (JSON `true` is not 1, `"5"` is not 5).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)

from moe_engine.server.http.request_context import drop_unknown_fields

Number = StrictFloat | StrictInt


class RequestBody(BaseModel):
    """A request body: unknown fields are refused (400 naming them), or, where the app allows
    them (`--allow-unknown-fields`), dropped with one warning per field name
    (`request_context.drop_unknown_fields`)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _unknown_fields(cls, data: Any) -> Any:
        if cls.model_config.get("extra") != "forbid":
            return data
        known = [n for name, f in cls.model_fields.items() for n in (name, f.alias) if n]
        return drop_unknown_fields(cls.__name__, data, known)


class StreamOptions(RequestBody):
    """`stream_options`: `include_usage` adds a last chunk with `usage` and no choices."""

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _SamplingFields(RequestBody):
    """The sampling fields both endpoints share (OpenAI's names, vLLM's extras)."""

    model: StrictStr | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_tokens: StrictInt = 0
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    n: StrictInt = 1
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    #: vLLM's extension: also return the prompt's and each choice's token ids (not streamed).
    return_token_ids: StrictBool = False
    # Logits processors, prompt truncation and priority (`SamplingParams` checks the values;
    # OpenAI's logit_bias keys are token ids as strings).
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    logit_bias: dict[StrictStr, Number] | None = None
    repetition_penalty: Number = 1.0
    min_p: Number = 0.0
    truncate_prompt_tokens: StrictInt | None = None
    priority: StrictInt = 0
    # vLLM's detokenizer fields (`SamplingParams`).
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    #: SGLang's and vLLM's routing replay: each choice's `routed_experts` (`common.Choice`).
    return_routed_experts: StrictBool = False
    # OpenAI bookkeeping fields with no effect on the output here.
    store: StrictBool | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    service_tier: StrictStr | None = None


#: Fields of features this server does not implement, with the only values it accepts.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "functions": (None, []),
}


PromptIds = list[StrictInt]
Prompt = StrictStr | list[StrictStr] | PromptIds | list[PromptIds]


class CompletionRequest(_SamplingFields):
    """POST /v1/completions.

    `prompt`: one string, a list of strings, one list of token ids, or a list of them; each
    prompt gets `n` choices, choice index = prompt index * n + completion index (as OpenAI).
    `logprobs`: top logprobs per generated token (0..20; 0 gives the sampled token's only).
    """

    prompt: Prompt
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None  # NEUTRAL: only 1


class TextPart(RequestBody):
    type: Literal["text"]
    text: StrictStr


class ToolCallFunction(RequestBody):
    """`tool_calls[].function` of an assistant message: `arguments` is the JSON text of the
    arguments object (OpenAI's; an object is accepted too, as some clients send one)."""

    name: StrictStr
    arguments: StrictStr | dict[StrictStr, Any]


class MessageToolCall(RequestBody):
    """One `tool_calls[]` entry of an assistant message in the history."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(RequestBody):
    """One message: `content` is a string or a list of text parts (joined with newlines);
    required except on an assistant turn (as OpenAI). An assistant turn may carry
    `tool_calls` (its content then usually null) and the reasoning it showed
    (`reasoning_content`, or vLLM's newer name `reasoning`); a `tool` message answers one call
    and needs its `tool_call_id`."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None
    reasoning: StrictStr | None = None
    # Fields of OpenAI's response message that an agent loop sends back as they came
    # (`messages.append(choice.message.model_dump())`): a refusal is the turn's text; the
    # others are accepted only empty (this server never returns them).
    refusal: StrictStr | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.annotations:
            raise ValueError("annotations: only an empty list or null is accepted (this server "
                             "returns no annotations)")
        if self.refusal is not None and self.role != "assistant":
            raise ValueError(f"refusal: only an assistant message has one, not a {self.role} "
                             "message")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls: only an assistant message has them, not a {self.role} "
                             "message")
        return self

    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionDefinition(RequestBody):
    """`tools[].function`: the name the model calls, and its arguments' JSON schema."""

    name: Annotated[StrictStr, Field(min_length=1)]
    description: StrictStr | None = None
    parameters: dict[StrictStr, Any] | None = None
    strict: StrictBool | None = None


class ChatTool(RequestBody):
    """One `tools[]` entry: only functions (`{"type": "function", "function": {...}}`)."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestBody):
    name: StrictStr


class NamedToolChoice(RequestBody):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call this function."""

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(RequestBody):
    name: StrictStr = "schema"
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(RequestBody):
    """`response_format`: "text", "json_object" (any JSON object), or "json_schema"."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


#: OpenAI's `reasoning_effort` values (the openai SDK's `ReasoningEffort`).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. `max_completion_tokens` is OpenAI's newer name of
    `max_tokens` (it wins when both are given); without either, a reply may fill the context.
    `logprobs` true returns the sampled token's logprob, with `top_logprobs` (0..20) more."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: StrictBool = True
    #: vLLM's: render the last (assistant) message open-ended, for the model to continue it.
    continue_final_message: StrictBool = False
    #: vLLM's: extra variables for the chat template (e.g. `enable_thinking`, `thinking`).
    chat_template_kwargs: dict[StrictStr, Any] | None = None
    #: OpenAI's (the SDK's `ReasoningEffort`): passed to the chat template as the
    #: `reasoning_effort` variable, as vLLM does (gpt-oss's template reads it).
    reasoning_effort: ReasoningEffort | None = None
    tools: list[ChatTool] | None = None
    #: None: "auto" when `tools` are given, else "none" (as OpenAI and vLLM).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    #: False: at most one call per choice (None and True: any number).
    parallel_tool_calls: StrictBool | None = None
    functions: list[dict[StrictStr, Any]] | None = None  # NEUTRAL only (the legacy API)


class TokenizeRequest(RequestBody):
    """POST /tokenize: `prompt` text, or `messages` rendered through the chat template."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[StrictStr, Any] | None = None
    tools: list[ChatTool] | None = None


class DetokenizeRequest(RequestBody):
    """POST /detokenize: token ids back to text."""

    model: StrictStr | None = None
    tokens: list[StrictInt]
