"""Forced tool choices (`required`, a named function) as structured output, and their readers.

The scheme is vLLM's (docs/features/tool_calling.md, "required" and named function calling):
- a named choice constrains the whole output to the tool's `parameters` schema, so the output
  text is the call's arguments object;
- `required` constrains it to a JSON array of at least one `{"name": <a tool's name>,
  "parameters": <that tool's arguments>}` object, each element one call.
The grammar is the engine's structured-output machinery (xgrammar), so even an untrained model
emits calls whose arguments validate. The readers are `ToolParser`s (pure functions of the text,
`parsers/base.py`), so streamed calls equal whole ones by construction.

This is the smallest version the Responses and Messages translations need; the chat pipeline's
own tool_choice enforcement replaces it where it exposes one.
"""

from __future__ import annotations

import json
from typing import Any

from moe_engine.sampling_params import StructuredOutputsParams
from moe_engine.server.http.errors import OpenAIError
from moe_engine.server.parsers.base import OutputStream, ParsedCalls, PartialCall, ToolParser

#: tool_choice values that do not force a call.
FREE_CHOICES = ("none", "auto")


def _functions(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    return {t["function"]["name"]: t["function"] for t in tools or []}


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def tool_choice_grammar(
    tools: list[dict[str, Any]] | None, tool_choice: str, field: str,
    parallel_tool_calls: bool = True,
) -> StructuredOutputsParams | None:
    """The structured-output constraint of a forced choice (None for "none" / "auto").

    Args:
        tools: chat function tools (`[{"type": "function", "function": {...}}]`).
        tool_choice: "none", "auto", "required" or a tool's name.
        field: the API's name of the tool_choice field, for errors.
        parallel_tool_calls: False limits `required` to exactly one call.

    Raises:
        OpenAIError: 400 naming `field`: `required` without tools, a name not among the tools.
    """
    if tool_choice in FREE_CHOICES:
        return None
    functions = _functions(tools)
    if tool_choice == "required":
        if not functions:
            raise OpenAIError(400, f"{field}: 'required' needs at least one tool", field,
                              "invalid_value")
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                   "parameters": _parameters(f)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, f in functions.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
    elif tool_choice in functions:
        schema = _parameters(functions[tool_choice])
    else:
        raise OpenAIError(
            400, f"{field}: no tool named {tool_choice!r} (tools: {sorted(functions)})", field,
            "invalid_value",
        )
    return StructuredOutputsParams(json=json.dumps(schema))


def forced_tool_stream(
    tools: list[dict[str, Any]] | None, tool_choice: str
) -> OutputStream | None:
    """The output stream that reads a forced choice's JSON as calls (None when not forced)."""
    if tool_choice in FREE_CHOICES:
        return None
    if tool_choice == "required":
        return OutputStream(None, RequiredCallsParser(tools))
    return OutputStream(None, NamedCallParser(tool_choice))


class NamedCallParser(ToolParser):
    """The whole output is the named tool's arguments object."""

    name = "named_choice"

    def __init__(self, function: str) -> None:
        super().__init__()
        self.function = function

    def parse(self, text: str, final: bool) -> ParsedCalls:
        return ParsedCalls("", [PartialCall(self.function, text.lstrip(), final)])


class RequiredCallsParser(ToolParser):
    """The output is `[{"name": ..., "parameters": {...}}, ...]`: one call per element.

    A scan of the JSON text so far (strings and escapes respected): an element's name is known
    once its "name" string closes; its arguments are the raw text of its "parameters" value
    from the value's first character, to the text's end while the value is open.
    """

    name = "required_choice"

    def parse(self, text: str, final: bool) -> ParsedCalls:
        calls: list[PartialCall] = []
        scan = _Scan(text)
        for element in scan.elements():
            name, start, end, done = element
            if start is None:
                arguments = ""
            else:
                arguments = text[start:end] if end is not None else text[start:]
            calls.append(PartialCall(name, arguments, done or final))
        return ParsedCalls("", calls)


class _Scan:
    """A single pass over a JSON array of objects, noting each element's "name" value and the
    span of its "parameters" value (container or string values; others are taken whole)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def elements(self) -> list[tuple[str | None, int | None, int | None, bool]]:
        text, out = self.text, []
        depth, i, key, expect_value = 0, 0, None, False
        current: list[Any] = []  # [name, start, end, done] of the element being read
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _string_end(text, i)
                if depth == 2 and current:
                    if expect_value:
                        if key == "name" and end is not None:
                            current[0] = json.loads(text[i:end])
                        elif key == "parameters":
                            current[1], current[2] = i, end
                        expect_value = False
                    else:
                        key = json.loads(text[i:end]) if end is not None else None
                if end is None:
                    break
                i = end
                continue
            if c in "[{":
                if depth == 2 and expect_value and key == "parameters":
                    current[1] = i
                expect_value = expect_value and depth != 2
                depth += 1
                if depth == 2:
                    current = [None, None, None, False]
                    out.append(current)
            elif c in "]}":
                depth -= 1
                if depth == 2 and key == "parameters" and current[1] is not None \
                        and current[2] is None:
                    current[2] = i + 1
                if depth == 1 and current:
                    current[3] = True
            elif c == ":" and depth == 2:
                expect_value = True
            elif c == "," and depth == 2:
                key, expect_value = None, False
            i += 1
        return [tuple(e) for e in out]


def _string_end(text: str, start: int) -> int | None:
    """The index after the closing quote of the JSON string opening at `start`, or None."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    return None
