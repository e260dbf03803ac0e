"""Request bodies of POST /v1/messages (Anthropic's Messages API), pydantic v2, and the
Anthropic error shape.

Field names, block shapes and defaults are Anthropic's (https://docs.anthropic.com/en/api/
messages, and the `anthropic` SDK's `types/`): `max_tokens` is required; `system` is a string
or text blocks; message `content` is a string or blocks: `text`, `tool_use` (`id`, `name`,
`input` object), `tool_result` (`tool_use_id`, `content` string or text blocks, `is_error`),
`thinking` (`thinking`, `signature`; the signature is not checked) and `redacted_thinking`
(dropped: its data is encrypted by Anthropic). Tools are `{name, description, input_schema}`;
`tool_choice` `{type: auto | any | tool | none}`. `cache_control` on blocks and tools is
accepted and has no effect (this server's prefix cache needs no markers). `temperature`,
`top_p` and `top_k` are served (recent SDKs send them only through `extra_body`). Images, documents,
server tools, `container`, `mcp_servers` are refused as unknown fields or block types.
Errors: `{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr

from moe_engine.server.http.protocol import Number, RequestBody

#: Anthropic's error `type` for each HTTP status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "api_error", 503: "overloaded_error", 529: "overloaded_error",
}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """The body of an error in Anthropic's shape (the field named in `message`)."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error_bytes(status: int, message: str) -> bytes:
    return json.dumps(anthropic_error(status, message)).encode()


class CacheControl(RequestBody):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(RequestBody):
    type: Literal["text"]
    text: StrictStr
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None


class ToolUseBlock(RequestBody):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[StrictStr, Any]
    cache_control: CacheControl | None = None
    # What the SDK's response blocks carry when fed back as they are (no effect here).
    caller: dict[StrictStr, Any] | None = None
    toolset_name: StrictStr | None = None


class ToolResultBlock(RequestBody):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[TextBlock] = ""
    is_error: StrictBool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ThinkingBlock(RequestBody):
    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr | None = None


class RedactedThinkingBlock(RequestBody):
    type: Literal["redacted_thinking"]
    data: StrictStr


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(RequestBody):
    role: Literal["user", "assistant"]
    content: StrictStr | list[Block]


class Tool(RequestBody):
    """A client tool: `input_schema` is the arguments' JSON schema."""

    name: StrictStr
    description: StrictStr | None = None
    input_schema: dict[StrictStr, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None

    def to_chat(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(RequestBody):
    """`auto` (the model decides), `any` (some tool), `tool` (the one named), `none`."""

    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None


class ThinkingConfig(RequestBody):
    """`enabled` turns the template's thinking on (`enable_thinking` / `thinking` true),
    `disabled` off; `budget_tokens` is checked (>= 1, < max_tokens) but not enforced apart
    from `max_tokens` (the engine has no separate thinking budget)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: StrictInt | None = None
    display: Literal["summarized", "omitted"] | None = None


class JsonOutputFormat(RequestBody):
    type: Literal["json_schema"]
    schema_: dict[StrictStr, Any] = Field(alias="schema")


class OutputConfig(RequestBody):
    """`output_config`: `effort` goes to the chat template as `reasoning_effort`; `format`
    constrains the text to JSON valid against its schema (structured output)."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class Metadata(RequestBody):
    user_id: StrictStr | None = None


class MessagesRequest(RequestBody):
    """POST /v1/messages."""

    model: StrictStr
    max_tokens: StrictInt
    messages: Annotated[list[Message], Field(min_length=1)]
    system: StrictStr | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[StrictStr] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    stream: StrictBool = False
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    metadata: Metadata | None = None
    cache_control: CacheControl | None = None
    service_tier: Literal["auto", "standard_only"] | None = None


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages request with `max_tokens` optional (nothing
    is generated; the sampling fields are accepted and change nothing)."""

    max_tokens: StrictInt | None = None  # type: ignore[assignment]
