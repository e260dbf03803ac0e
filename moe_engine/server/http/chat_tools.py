"""`tool_choice` on /v1/chat/completions: what each choice enforces and how its output is read.

- `none`: the tools are still rendered into the prompt (vLLM's default), nothing is parsed.
- `auto`: needs `--enable-auto-tool-choice` and a tool parser (vLLM's rule and error); the
  family's parser (`--tool-call-parser`, by default the checkpoint's) finds calls in the text
  (only the first with `parallel_tool_calls` false).
- a named function (`{"type": "function", "function": {"name": ...}}`): the output is
  constrained (structured outputs, a JSON schema) to that function's arguments object, its
  `parameters` schema; the whole output is the one call's arguments.
- `required`: the output is constrained to a JSON array of one or more
  `{"name": <a tool's name>, "parameters": <that tool's arguments>}` objects (one `anyOf` branch
  per tool, vLLM's `_get_json_schema_from_tool`); at most one with `parallel_tool_calls`
  false. The array is read by `RequiredCallsParser`, not by the family's parser.

Both constrained forms are read by small `ToolParser`s over their JSON text, so `OutputStream`
streams them like any family's calls (the first delta of a call carries its id and name, then
argument fragments), and streamed equals whole.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from moe_engine.sampling_params import StructuredOutputsParams
from moe_engine.server.http.chat_tool_schema import (
    check_tools,
    parameters_of,
    required_schema,
    structured,
)
from moe_engine.server.http.errors import OpenAIError
from moe_engine.server.http.protocol import ChatCompletionRequest
from moe_engine.server.parsers import registry
from moe_engine.server.parsers.base import ParsedCalls, PartialCall, ToolParser

__all__ = ["ToolPlan", "plan_tools", "required_schema", "FirstCallOnly", "NamedCallParser",
           "RequiredCallsParser"]


@dataclass(frozen=True)
class ToolPlan:
    """What one request's `tool_choice` asks of its choices.

    Attributes:
        mode: "none", "auto", "required" or "named".
        structured: the JSON constraint of "required" and "named", else None.
        make_parser: a fresh tool parser per choice (None: no parsing).
        keep_special_tokens: the parser reads special-token markers, so the text keeps them.
    """

    mode: str
    structured: StructuredOutputsParams | None = None
    make_parser: Callable[[], ToolParser] | None = None
    keep_special_tokens: bool = False


def plan_tools(
    body: ChatCompletionRequest, tool_parser: str | None, enable_auto: bool
) -> ToolPlan:
    """The plan for `body` on a server with the tool parser named `tool_parser` (a
    `registry.TOOL_PARSERS` name, or None) and `--enable-auto-tool-choice`.

    Raises:
        OpenAIError: 400 naming `tool_choice` (no tools, an unknown function, `auto` on a
            server without it), `response_format` (with a required or named choice), `tools`
            or a `tools[i].function` field (`chat_tool_schema`: a bad or repeated name, a
            non-object or too large schema, clashing `$defs`).
    """
    choice = body.tool_choice
    tools = body.tools or []
    check_tools(tools)
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan("none")
    if not tools:
        raise OpenAIError(400, "tool_choice: needs tools (a non-empty list of functions)",
                          "tool_choice", "invalid_value")
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "auto":
        if not enable_auto or tool_parser is None:
            raise OpenAIError(400, _auto_refusal(tool_parser, enable_auto), "tool_choice",
                              "unsupported_value")
        # The families' call markers are special tokens in several tokenizers (DeepSeek's,
        # Kimi-K2's, GLM-4.5's): keep them in the text, as vLLM's parsers' adjust_request does.
        if body.parallel_tool_calls is False:
            return ToolPlan("auto", None, lambda: FirstCallOnly(
                registry.tool_parser(tool_parser, tool_dicts)), keep_special_tokens=True)
        return ToolPlan("auto", None, lambda: registry.tool_parser(tool_parser, tool_dicts),
                        keep_special_tokens=True)
    if body.response_format is not None and body.response_format.type != "text":
        raise OpenAIError(
            400, f"response_format: cannot be combined with tool_choice {_shown(choice)} (both "
            "constrain the whole output)", "response_format", "invalid_value")
    if choice == "required":
        schema = required_schema(tools, body.parallel_tool_calls is not False)
        return ToolPlan("required", structured(
            schema, "tools", f"send fewer tools (this request has {len(tools)}) or name the "
            "one to call in tool_choice"), RequiredCallsParser)
    name = choice.function.name
    index = next((i for i, t in enumerate(tools) if t.function.name == name), None)
    if index is None:
        known = ", ".join(repr(t.function.name) for t in tools)
        raise OpenAIError(
            400, f"tool_choice: function {name!r} is not in tools (they are {known})",
            "tool_choice", "invalid_value")
    field = f"tools[{index}].function.parameters"
    return ToolPlan("named", structured(parameters_of(tools[index]), field,
                                        "send a smaller arguments schema"),
                    lambda: NamedCallParser(name))


def _auto_refusal(tool_parser: str | None, enable_auto: bool) -> str:
    """What `auto` lacks on this server: the flag, the parser, or both."""
    if tool_parser is None and not enable_auto:
        return ('tool_choice: "auto" requires --enable-auto-tool-choice and --tool-call-parser '
                "(this server has neither; use tool_choice \"required\", a named function or "
                '"none")')
    if tool_parser is None:
        return ('tool_choice: "auto" requires a tool parser, and this server has no tool '
                "parser (--tool-call-parser none, or none known for this checkpoint's chat "
                'template: start it with --tool-call-parser NAME); use tool_choice '
                '"required", a named function or "none"')
    return (f'tool_choice: "auto" requires --enable-auto-tool-choice, which this server was '
            f"started without (its tool parser is {tool_parser!r}); use tool_choice "
            '"required", a named function or "none"')


def _shown(choice: Any) -> str:
    return json.dumps(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


class FirstCallOnly(ToolParser):
    """A family's parser with `parallel_tool_calls: false`: only its first call is returned
    (later ones are dropped, as vLLM does for `auto`)."""

    name: ClassVar[str] = "first_call_only"

    def __init__(self, parser: ToolParser) -> None:
        super().__init__(parser.tools)
        self.parser = parser

    def parse(self, text: str, final: bool) -> ParsedCalls:
        parsed = self.parser.parse(text, final)
        return ParsedCalls(parsed.content, parsed.calls[:1])


class NamedCallParser(ToolParser):
    """The output of a named `tool_choice`: the whole text is that function's arguments."""

    name: ClassVar[str] = "named_function"

    def __init__(self, function_name: str) -> None:
        super().__init__(None)
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParsedCalls:
        return ParsedCalls("", [PartialCall(self.function_name, text.lstrip(), final)])


class RequiredCallsParser(ToolParser):
    """The output of `tool_choice: "required"`: `[{"name": ..., "parameters": {...}}, ...]`.

    A linear scan of the JSON text: a call is named once its `name` string is complete; its
    arguments are the raw text of its `parameters` value so far (so they only grow). At the end,
    text that holds no named call (cut by max_tokens before one) is returned as content.
    """

    name: ClassVar[str] = "required_array"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)

    def parse(self, text: str, final: bool) -> ParsedCalls:
        calls = _scan_array(text)
        if final and not any(c.name is not None for c in calls):
            return ParsedCalls(text, [])
        return ParsedCalls("", calls)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _scan_array(text: str) -> list[PartialCall]:
    calls: list[PartialCall] = []
    i = _skip_ws(text, 0)
    if not text.startswith("[", i):
        return calls
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i < len(text) and text[i] == ",":
            i += 1
            continue
        if i >= len(text) or text[i] != "{":
            return calls
        end, call = _scan_call(text, i + 1)
        calls.append(call)
        if end is None:
            return calls
        i = end


def _scan_call(text: str, i: int) -> tuple[int | None, PartialCall]:
    """One `{"name": ..., "parameters": ...}` object from just after its `{`: the index after
    its `}` (None while it is incomplete) and the call as far as it goes."""
    call = PartialCall(None)
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            return None, call
        if text[i] == "}":
            call.done = True
            return i + 1, call
        if text[i] == ",":
            i += 1
            continue
        key_end = _value_end(text, i)
        if key_end is None or text[i] != '"':
            return None, call
        key = json.loads(text[i:key_end])
        i = _skip_ws(text, key_end)
        if not text.startswith(":", i):
            return None, call
        i = _skip_ws(text, i + 1)
        end = _value_end(text, i)
        if key == "name" and end is not None:
            name = json.loads(text[i:end])
            call.name = name if isinstance(name, str) else None
        elif key == "parameters":
            call.arguments = text[i:end] if end is not None else text[i:]
        if end is None:
            return None, call
        i = end


def _value_end(text: str, i: int) -> int | None:
    """The index just after the JSON value starting at `text[i]`, None if it is not complete
    (a number or literal that reaches the end of the text may still grow)."""
    if i >= len(text):
        return None
    if text[i] == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
                continue
            if text[j] == '"':
                return j + 1
            j += 1
        return None
    if text[i] in "{[":
        return _container_end(text, i)
    j = i
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(text) else None


def _container_end(text: str, i: int) -> int | None:
    depth, j, in_string = 0, i, False
    while j < len(text):
        c = text[j]
        if in_string:
            if c == "\\":
                j += 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None
