"""Request and response bodies of the OpenAI-compatible HTTP API (pydantic v2).

Field names and defaults are OpenAI's (https://platform.openai.com/docs/api-reference, the
legacy Completions and the Chat Completions APIs), with vLLM's extra sampling fields (`top_k`,
`min_tokens`, `ignore_eos`). Unknown fields are refused with HTTP 400 naming them, as vLLM's
server does by default (OpenAI's own API ignores some): a misspelt `max_token` must not be
dropped in silence. Integers and booleans are strict (JSON `true` is not 1, `"5"` is not 5).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = StrictFloat | StrictInt


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    """`stream_options`: `include_usage` adds a last chunk with `usage` and no choices."""

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _SamplingFields(_Body):
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
    # Accepted only at their neutral value (checked by the route): some clients always send them.
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0


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


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Body):
    """One message: `content` is a string or a list of text parts (joined with newlines)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class JsonSchemaFormat(_Body):
    name: StrictStr = "schema"
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    """`response_format`: "text", "json_object" (any JSON object), or "json_schema"."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


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


class TokenizeRequest(_Body):
    """POST /tokenize: `prompt` text, or `messages` rendered through the chat template."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(_Body):
    """POST /detokenize: token ids back to text."""

    model: StrictStr | None = None
    tokens: list[StrictInt]
