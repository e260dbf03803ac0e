"""The checks of a chat request's `tools` and the JSON schemas that `required` and named
`tool_choice` constrain the output to.

- Names: OpenAI's function-name rule (`^[a-zA-Z0-9_-]{1,64}$`, the Chat Completions reference's
  `tools[].function.name`), and no two tools with one name (a call names its tool).
- `parameters`: absent (any arguments object, `{"type": "object", "properties": {}}`) or an
  object schema (`"type": "object"`, or no `type` but `properties`): a call's arguments are a
  JSON object in every API that reads them.
- `required`: the array-of-calls schema nests each tool's schema under
  `items.anyOf[i].properties.parameters`, so a `#/$defs/X` reference (Pydantic's tool schemas)
  would no longer resolve from the root. As vLLM's `get_tool_schema_defs`
  (vllm/entrypoints/openai/chat_completion/serving.py, `_get_json_schema_from_tool`) does,
  every tool's `$defs` (and `definitions`, draft-07's name) are hoisted to the root of the
  combined schema; one name defined differently by two tools is refused.
- Size: a schema over `MAX_JSON_SCHEMA_CHARS` is refused as a 400 naming `tools`, not the
  `response_format` the structured-output parameters would name.
"""

from __future__ import annotations

import json
import re
from typing import Any

from moe_engine.errors import ParamError
from moe_engine.sampling_params import MAX_JSON_SCHEMA_CHARS, StructuredOutputsParams
from moe_engine.server.http.errors import OpenAIError
from moe_engine.server.http.protocol import ChatTool

#: OpenAI's rule for a function's name (Chat Completions reference, `tools[].function.name`).
NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")
#: A tool without `parameters` takes any arguments object (OpenAI: "omitting parameters
#: defines a function with an empty parameter list").
ANY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}
#: The keywords whose sub-schemas `#/<keyword>/<name>` references point at.
_DEFS_KEYS = ("$defs", "definitions")


def _bad(field: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{field}: {message}", field, "invalid_value")


def check_tools(tools: list[ChatTool]) -> None:
    """Refuse bad names, duplicate names and non-object `parameters` schemas.

    Raises:
        OpenAIError: 400 naming `tools[i].function.name` (with the value) or
            `tools[i].function.parameters`.
    """
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        name, field = tool.function.name, f"tools[{i}].function.name"
        if NAME_PATTERN.fullmatch(name) is None:
            raise _bad(field, f"{name!r} is not a valid function name (1 to 64 of a-z, A-Z, "
                       "0-9, _ and -)")
        if name in seen:
            raise _bad(field, f"{name!r} is also the name of tools[{seen[name]}]; function "
                       "names must be unique")
        seen[name] = i
        params = tool.function.parameters
        if params is not None and not is_object_schema(params):
            raise _bad(f"tools[{i}].function.parameters",
                       f"must be an object schema (\"type\": \"object\"), got "
                       f"{json.dumps(params)[:200]}; a call's arguments are a JSON object")


def is_object_schema(schema: dict[str, Any]) -> bool:
    """Whether `schema` describes JSON objects: `type` "object" (or a list holding only it),
    or no `type` at all (`{}` or only `properties`, `$defs`, ...)."""
    kind = schema.get("type")
    if kind is None:
        return True
    return kind == "object" or kind == ["object"]


def parameters_of(tool: ChatTool) -> dict[str, Any]:
    """The tool's arguments schema (`ANY_OBJECT` when it has none)."""
    return tool.function.parameters if tool.function.parameters is not None else ANY_OBJECT


def required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """The JSON schema of `tool_choice: "required"`: an array of 1+ (exactly 1 unless
    `parallel`) calls, each `{"name": <const>, "parameters": <the tool's schema>}`, with every
    tool's `$defs`/`definitions` hoisted to the root.

    Raises:
        OpenAIError: 400 naming `tools` when two tools define one name differently.
    """
    hoisted: dict[str, dict[str, Any]] = {key: {} for key in _DEFS_KEYS}
    owners: dict[tuple[str, str], str] = {}
    branches = []
    for tool in tools:
        params = dict(parameters_of(tool))
        for key in _DEFS_KEYS:
            defs = params.pop(key, None)
            if not isinstance(defs, dict):
                if defs is not None:
                    params[key] = defs
                continue
            for def_name, definition in defs.items():
                _hoist(hoisted[key], owners, key, def_name, definition, tool.function.name)
        branches.append(
            {"type": "object",
             "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                            "parameters": params},
             "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    for key in _DEFS_KEYS:
        if hoisted[key]:
            schema[key] = hoisted[key]
    return schema


def _hoist(into: dict[str, Any], owners: dict[tuple[str, str], str], key: str, name: str,
           definition: Any, tool: str) -> None:
    if name in into and into[name] != definition:
        first = owners[(key, name)]
        raise OpenAIError(
            400, f"tools: {key} {name!r} is defined differently by functions {first!r} and "
            f"{tool!r}; tool_choice \"required\" combines all tools' {key} into one schema, "
            "so a name must mean one schema (rename one, or use a named tool_choice)",
            "tools", "invalid_value")
    into[name] = definition
    owners.setdefault((key, name), tool)


def structured(schema: dict[str, Any], field: str, what: str) -> StructuredOutputsParams:
    """The structured-output constraint of a tool choice's `schema`.

    Args:
        field: the request field the schema comes from (`tools`, `tools[i].function.parameters`).
        what: how to shrink it, for the message.

    Raises:
        OpenAIError: 400 naming `field`: the schema is over MAX_JSON_SCHEMA_CHARS characters
            (with its size and the limit) or otherwise refused.
    """
    text = json.dumps(schema)
    if len(text) > MAX_JSON_SCHEMA_CHARS:
        raise _bad(field, f"the JSON schema of the tool choice has {len(text)} characters, at "
                   f"most {MAX_JSON_SCHEMA_CHARS}; {what}")
    try:
        return StructuredOutputsParams(json=text)
    except ParamError as exc:
        message = exc.message.removeprefix("response_format: ")
        raise _bad(field, message) from None
