"""Request bodies of POST /v1/responses (OpenAI's Responses API), pydantic v2.

Field names, item shapes and defaults are OpenAI's (https://platform.openai.com/docs/
api-reference/responses/create, and the `openai` SDK's `types/responses/`): `input` is a string
or a list of items: messages (`{"role", "content"}` with `input_text` / `output_text` parts,
`type: "message"` optional), `function_call` (`call_id`, `name`, `arguments`),
`function_call_output` (`call_id`, `output`) and `reasoning` items. Tools are Responses' flat
function tools (`{"type": "function", "name", "description", "parameters", "strict"}`).
Unknown fields are refused naming them (as the other endpoints); fields of hosted features
(built-in tools, `background`, `conversation`, `prompt`) are refused by name rather than
ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr

from moe_engine.server.http.protocol import Number, RequestBody


class _Item(RequestBody):
    """An input item: OpenAI's output items come back as input with their `id` / `status`."""

    id: StrictStr | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class InputText(RequestBody):
    """A text part: `input_text` (user, system, developer) or `output_text` (assistant)."""

    type: Literal["input_text", "output_text"]
    text: StrictStr
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_Item):
    """A message: `content` is a string or a list of text parts (joined without separator)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | list[InputText]
    phase: StrictStr | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(_Item):
    """A call the model made earlier (an output item fed back)."""

    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr


class FunctionCallOutputItem(_Item):
    """The result of running a call: `output` is text (or a list of `input_text` parts)."""

    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr | list[InputText]

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class ReasoningText(RequestBody):
    type: Literal["reasoning_text", "summary_text"]
    text: StrictStr


class ReasoningItem(_Item):
    """Reasoning the model produced earlier (its `content` text goes back to the template as
    the next assistant turn's `reasoning_content`; `encrypted_content` is not produced here)."""

    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: StrictStr | None = None

    def text(self) -> str:
        return "".join(part.text for part in self.content or [])


#: Models of each input item `type` (a message may leave `type` out).
ITEM_TYPES: dict[str, type[_Item]] = {
    "message": MessageItem, "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem,
}


class FunctionTool(RequestBody):
    """A function tool in Responses' flat shape."""

    type: Literal["function"]
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[StrictStr, Any] | None = None
    strict: StrictBool | None = None

    def to_chat(self) -> dict[str, Any]:
        """The chat API's nested tool (`{"type": "function", "function": {...}}`)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": function}


class FunctionChoice(RequestBody):
    type: Literal["function"]
    name: StrictStr


class Reasoning(RequestBody):
    """`reasoning`: `effort` goes to the chat template as `reasoning_effort`; a `summary` is
    not produced (reasoning comes back whole, as `reasoning_text`)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class TextFormat(RequestBody):
    """`text.format`: plain text, any JSON object, or JSON valid against `schema` (structured
    output, as chat's `response_format`)."""

    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    schema_: dict[StrictStr, Any] | None = Field(default=None, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None

    def to_chat(self) -> dict[str, Any] | None:
        """Chat's `response_format` (None for text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema",
                "json_schema": {"name": self.name or "schema", "schema": self.schema_}}

    def echo(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(RequestBody):
    """`text`: the output's format."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(RequestBody):
    """POST /v1/responses. `input` items are validated one by one (`ITEM_TYPES`), so an error
    names the item (`input[2].role`). Without `max_output_tokens` a reply may fill the context.
    `store` false keeps the response out of the store (it cannot be continued)."""

    model: StrictStr | None = None
    input: StrictStr | list[dict[StrictStr, Any]]
    instructions: StrictStr | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    stream: StrictBool = False
    previous_response_id: StrictStr | None = None
    store: StrictBool = True
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    user: StrictStr | None = None
    truncation: Literal["disabled"] | None = None
    service_tier: StrictStr | None = None
