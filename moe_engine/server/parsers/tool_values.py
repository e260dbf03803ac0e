"""Typed values for the XML-style formats (Qwen3-Coder, GLM-4.5): the model writes every
parameter as text, and the tool's JSON schema says what JSON value it stands for.

`ArgumentsText` builds the arguments JSON text one complete parameter at a time
(`{"p1": v1`, then `, "p2": v2`, then `}`), and the open start of a text value
(`, "p3": "partial`), so every streamed fragment is a prefix of the final text and the final
text is one valid JSON object.
"""

from __future__ import annotations

import ast
import json
from typing import Any

_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")


def find_properties(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """`parameters.properties` of the request's tool called `name` ({} if none)."""
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            parameters = function.get("parameters")
            if isinstance(parameters, dict) and isinstance(parameters.get("properties"), dict):
                return parameters["properties"]
    return {}


def schema_type(schema: Any) -> tuple[str, bool]:
    """(the first non-null JSON type a property schema names, lower-case; whether null is
    allowed). `"type": [...]` lists and `anyOf` are read; no type reads as "string"."""
    if not isinstance(schema, dict):
        return "string", False
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    elif isinstance(schema.get("anyOf"), list):
        types = [o["type"] for o in schema["anyOf"] if isinstance(o, dict) and "type" in o]
    else:
        return "string", False
    names = [str(t).strip().lower() for t in types]
    rest = [t for t in names if t != "null"]
    return (rest[0] if rest else "null"), "null" in names


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def _literal(text: str) -> tuple[bool, Any]:
    """`text` read as JSON, else as a Python literal; (False, None) if neither gives JSON."""
    try:
        value = json.loads(text, parse_constant=_reject)
        return True, value
    except (ValueError, RecursionError):
        pass
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None
    return (True, value) if _jsonable(value) else (False, None)


def _reject(constant: str) -> Any:
    raise ValueError(f"non-JSON constant {constant}")


def qwen3_coder_value(text: str, schema: Any, known: bool) -> Any:
    """Convert a Qwen3-Coder `<parameter=...>` text by its schema, as vLLM's
    `Qwen3CoderToolParser._convert_param_value` does: string types (and parameters the tool
    does not declare, `known=False`) stay text; integers, numbers, booleans, null, objects
    and arrays are parsed, falling back to the text when it does not parse."""
    if not known:
        return text
    kind, nullable = schema_type(schema)
    if nullable and text.lower() in ("null", "none"):
        return None
    if kind in _STRING_TYPES:
        return text
    if text.lower() in ("null", "none"):
        return None
    try:
        if kind.startswith(_INT_PREFIXES):
            return int(text)
        if kind.startswith(("num", "float")):
            number = float(text)
            return int(number) if number.is_integer() else number
    except (ValueError, OverflowError):
        return text
    if kind in ("boolean", "bool", "binary"):
        return text.lower() == "true"
    parsed, value = _literal(text)
    return value if parsed else text


def qwen3_coder_is_text(schema: Any, known: bool) -> bool:
    """Whatever the model writes, `qwen3_coder_value` keeps it as text (so it can stream)."""
    kind, nullable = schema_type(schema)
    return not known or (kind in _STRING_TYPES and not nullable)


def glm45_is_text(schema: Any, known: bool) -> bool:
    """The schema types the parameter as a (non-nullable) string: its value stays text."""
    return known and schema_type(schema) == ("string", False)


def glm45_value(text: str, schema: Any, known: bool) -> Any:
    """Convert a GLM-4.5 `<arg_value>` text, as vLLM's `Glm4MoeModelToolParser` does: a
    parameter the schema types as string stays text, whitespace included; any other is
    stripped and read as JSON, else as a Python literal, else kept as text."""
    if glm45_is_text(schema, known):
        return text
    parsed, value = _literal(text.strip())
    return value if parsed and _jsonable(value) else text.strip()


class ArgumentsText:
    """The arguments object's JSON text, one complete parameter at a time."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def add(self, key: str, value: Any) -> None:
        encoded = json.dumps(value, ensure_ascii=False, allow_nan=False)
        self.parts.append(f"{json.dumps(key, ensure_ascii=False)}: {encoded}")

    def text(self, closed: bool, partial: tuple[str, str] | None = None) -> str:
        """`{"p1": v1, "p2": v2` while open (empty before the first), `{...}` once closed.

        `partial`: (key, the start of a string value) of a parameter still being written,
        shown as `, "key": "start` (the JSON escape of a string is per character, so this is
        a prefix of the parameter's final `"key": "whole value"`).
        """
        parts = self.parts
        if partial is not None:
            key, start = partial
            opened = json.dumps(start, ensure_ascii=False)[:-1]
            parts = [*parts, f"{json.dumps(key, ensure_ascii=False)}: {opened}"]
        if not parts:
            return "{}" if closed else ""
        return "{" + ", ".join(parts) + ("}" if closed else "")
