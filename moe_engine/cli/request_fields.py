"""GenerateRequest from user input: `build_request` and the proto field checks behind it.

Each value is checked against its field's proto type (integer ranges, numbers, booleans,
UTF-8 strings) before a message is built, so a bad value is an error naming the field, the
expected type and the value, not a protobuf TypeError. The argparse types of `moe-client
generate`'s flags (`parse_ids`, `int_type`, `utf8_text`) use the same ranges.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from google.protobuf import descriptor

from moe_engine.server.pb import moe_engine_pb2 as pb

#: Request fields a batch line or build_request may set (besides prompt / prompt_ids).
REQUEST_FIELDS = {
    f.name for f in pb.GenerateRequest.DESCRIPTOR.fields if f.name not in ("text", "prompt_ids")
}

_FD = descriptor.FieldDescriptor
#: Integer proto types -> (low, high, description).
_INT_RANGES = {
    _FD.TYPE_INT32: (-(2**31), 2**31 - 1, "a 32-bit integer"),
    _FD.TYPE_INT64: (-(2**63), 2**63 - 1, "a 64-bit integer"),
    _FD.TYPE_UINT32: (0, 2**32 - 1, "an unsigned 32-bit integer"),
    _FD.TYPE_UINT64: (0, 2**64 - 1, "an unsigned 64-bit integer"),
}
_INT32 = _INT_RANGES[_FD.TYPE_INT32]
#: JSON value types -> their names in error messages.
JSON_TYPE_NAMES = {
    str: "a string",
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    list: "an array",
    dict: "an object",
    type(None): "null",
}


def _describe(value: Any) -> str:
    """`value` for an error message, with its JSON type."""
    kind = JSON_TYPE_NAMES.get(type(value), type(value).__name__)
    return f"{json.dumps(value)[:40]} ({kind})" if kind != "null" else "null"


def _check_utf8(value: str) -> str | None:
    """None when `value` can be sent (encodes as UTF-8), else why not."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8 (undecodable bytes in the argument)"
    return None


def _check_scalar(field: descriptor.FieldDescriptor, value: Any) -> str | None:
    """None when `value` fits `field`'s scalar type, else what was expected instead."""
    if field.type in _INT_RANGES:
        low, high, what = _INT_RANGES[field.type]
        if isinstance(value, bool) or not isinstance(value, int):
            return f"expected {what}, got {_describe(value)}"
        if not low <= value <= high:
            return f"expected {what} in {low}..{high}, got {value}"
    elif field.type in (_FD.TYPE_DOUBLE, _FD.TYPE_FLOAT):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"expected a number, got {_describe(value)}"
    elif field.type == _FD.TYPE_BOOL:
        if not isinstance(value, bool):
            return f"expected true or false, got {_describe(value)}"
    elif field.type == _FD.TYPE_STRING:
        if not isinstance(value, str):
            return f"expected a string, got {_describe(value)}"
        bad = _check_utf8(value)
        if bad is not None:
            return bad
    return None


def _check_field(name: str, value: Any) -> Any:
    """`value` for request field `name`, type-checked (a lone string is one stop string).

    Raises:
        ValueError: naming the field and the expected type.
    """
    field = pb.GenerateRequest.DESCRIPTOR.fields_by_name[name]
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        return _check_map(name, field, value)
    if field.is_repeated:
        if name == "stop" and isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            element = "strings" if field.type == _FD.TYPE_STRING else "integers"
            raise ValueError(f"{name}: expected an array of {element}, got {_describe(value)}")
        for i, item in enumerate(value):
            problem = _check_scalar(field, item)
            if problem is not None:
                raise ValueError(f"{name}[{i}]: {problem}")
        return value
    problem = _check_scalar(field, value)
    if problem is not None:
        raise ValueError(f"{name}: {problem}")
    return value


def _check_map(name: str, field: descriptor.FieldDescriptor, value: Any) -> dict:
    """A map field (`logit_bias`: token id -> bias) as a dict with int keys; keys may come as
    strings of integers (JSON objects have string keys, as OpenAI's logit_bias).

    Raises:
        ValueError: not an object, a key that is not an integer, or a value of the wrong type.
    """
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected an object of token id to number, got "
                         f"{_describe(value)}")  # fmt: skip
    key_field = field.message_type.fields_by_name["key"]
    value_field = field.message_type.fields_by_name["value"]
    out = {}
    for key, item in value.items():
        try:
            k = int(key) if isinstance(key, str) else key
        except ValueError:
            raise ValueError(f"{name}: key {key!r} is not a token id") from None
        problem = _check_scalar(key_field, k) or _check_scalar(value_field, item)
        if problem is not None:
            raise ValueError(f"{name}[{key}]: {problem}")
        out[k] = item
    return out


def build_request(
    *, prompt: str | None = None, prompt_ids: list[int] | None = None, **fields: Any
) -> pb.GenerateRequest:
    """A GenerateRequest from a text or token-id prompt and sampling fields (None = unset).

    Each field's value is checked against its proto type; `stop` may be one string.

    Raises:
        ValueError: an unknown field, a value of the wrong type or out of the proto type's
            range (naming the field and the expected type), or neither/both prompt forms.
    """
    if (prompt is None) == (prompt_ids is None):
        raise ValueError("give exactly one of prompt (text) and prompt_ids")
    unknown = set(fields) - REQUEST_FIELDS
    if unknown:
        raise ValueError(
            f"unknown request fields {sorted(unknown)}; known: {sorted(REQUEST_FIELDS)}"
        )
    checked = {k: _check_field(k, v) for k, v in fields.items() if v is not None}
    request = pb.GenerateRequest(**checked)
    if prompt is not None:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt: expected a string, got {_describe(prompt)}")
        bad = _check_utf8(prompt)
        if bad is not None:
            raise ValueError(f"prompt: {bad}")
        request.text = prompt
    else:
        if not isinstance(prompt_ids, list):
            raise ValueError(
                f"prompt_ids: expected an array of integers, got {_describe(prompt_ids)}"
            )
        ids_field = pb.TokenIds.DESCRIPTOR.fields_by_name["ids"]
        for i, item in enumerate(prompt_ids):
            problem = _check_scalar(ids_field, item)
            if problem is not None:
                raise ValueError(f"prompt_ids[{i}]: {problem}")
        request.prompt_ids.ids.extend(prompt_ids)
        request.prompt_ids.SetInParent()
    return request


def parse_ids(text: str) -> list[int]:
    """Comma-separated 32-bit token ids ("1,2,3"; spaces allowed, empty elements not)."""
    parts = text.replace(" ", "").split(",")
    if any(not part for part in parts):
        raise argparse.ArgumentTypeError(
            f"expected ids like 1,2,3 (no empty elements), got {text!r}"
        )
    try:
        ids = [int(part) for part in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ids like 1,2,3, got {text!r}") from None
    low, high, what = _INT32
    for value in ids:
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"each id must be {what} in {low}..{high}, got {value}"
            )
    return ids


def int_type(field_name: str) -> Callable[[str], int]:
    """An argparse type: an integer in the range of GenerateRequest's `field_name`."""
    field = pb.GenerateRequest.DESCRIPTOR.fields_by_name[field_name]
    low, high, what = _INT_RANGES[field.type]

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {what} in {low}..{high}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def utf8_text(text: str) -> str:
    """An argparse type: text that can be sent (valid UTF-8)."""
    bad = _check_utf8(text)
    if bad is not None:
        raise argparse.ArgumentTypeError(f"{ascii(text)} {bad}")
    return text


def parse_logit_bias(text: str) -> dict[int, float]:
    """--logit-bias: comma-separated ID:BIAS pairs ("50256:-100,13:2.5").

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    out: dict[int, float] = {}
    for part in text.replace(" ", "").split(","):
        key, sep, value = part.partition(":")
        try:
            if not sep:
                raise ValueError
            out[int(key)] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected ID:BIAS pairs like 50256:-100,13:2.5, got {text!r}"
            ) from None
    return out


#: `moe-client generate`'s flags of the logits processors, truncation and priority, as
#: (flag, GenerateRequest field, argparse type, help).
PROCESSOR_FLAGS: tuple[tuple[str, str, Callable[[str], Any], str], ...] = (
    ("--repetition-penalty", "repetition_penalty", float,
     "> 0; divide (multiply, when negative) the logits of tokens already in the prompt or "
     "output by it (default: 1, off)"),
    ("--frequency-penalty", "frequency_penalty", float,
     "in [-2, 2]; lower each token's logit by this times its count in the output (default: 0)"),
    ("--presence-penalty", "presence_penalty", float,
     "in [-2, 2]; lower the logit of each token already in the output by this (default: 0)"),
    ("--min-p", "min_p", float,
     "in [0, 1]; keep tokens at least this fraction as likely as the best (default: 0, off)"),
    ("--logit-bias", "logit_bias", parse_logit_bias,
     "ID:BIAS pairs, 50256:-100,13:2.5: add BIAS (in [-100, 100]) to token ID's logit "
     "(default: none)"),
    ("--truncate-prompt-tokens", "truncate_prompt_tokens", int_type("truncate_prompt_tokens"),
     "keep only the prompt's last N tokens, -1 for max_model_len (default: whole prompt)"),
    ("--priority", "priority", int_type("priority"),
     "lower runs earlier on a server with --scheduling-policy priority (default: 0)"),
)


def add_processor_flags(g: argparse.ArgumentParser) -> None:
    """Add `PROCESSOR_FLAGS` (all unset by default: the server's defaults apply)."""
    for flag, _, kind, text in PROCESSOR_FLAGS:
        g.add_argument(flag, type=kind, default=None, metavar="V", help=text)


def processor_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The GenerateRequest fields `PROCESSOR_FLAGS` set (None: unset)."""
    return {field: getattr(args, field) for _, field, _, _ in PROCESSOR_FLAGS}
