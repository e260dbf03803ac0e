"""Value checks shared by `SamplingParams` and its parts: integers, reals, stop lists and the
`logit_bias` map, each refused with a `ParamError` naming the field, the value and the limit.
"""

from __future__ import annotations

import numbers

from moe_engine.errors import ParamError

#: OpenAI's range of each `logit_bias` value ([-100, 100]).
MAX_ABS_LOGIT_BIAS = 100.0
#: Most entries of one `logit_bias` (OpenAI documents none; this bounds a request's work).
MAX_LOGIT_BIAS_ENTRIES = 1024


def integer(name: str, value: object) -> int:
    """`value` as an int; bools and non-integral numbers are refused (ParamError)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ParamError(
            name, f"{name} must be an integer, got {value!r} ({type(value).__name__})"
        )
    return int(value)


def real(name: str, value: object) -> float:
    """`value` as a float; bools and non-numbers are refused (ParamError)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ParamError(name, f"{name} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)


def logit_bias_map(value: object) -> dict[int, float] | None:
    """`logit_bias` as {int token id: float bias}; None and {} are None (off).

    Raises:
        ParamError: not a dict, a key that is not a token id >= 0, a bias that is not a
            number in [-100, 100], or more than MAX_LOGIT_BIAS_ENTRIES entries.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ParamError(
            "logit_bias",
            f"logit_bias must be a map of token id to bias, got {type(value).__name__}",
        )
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise ParamError(
            "logit_bias",
            f"logit_bias: {len(value)} entries given, at most {MAX_LOGIT_BIAS_ENTRIES}",
        )
    out: dict[int, float] = {}
    for key, bias in value.items():
        tok = integer("logit_bias", key)
        if tok < 0:
            raise ParamError("logit_bias", f"logit_bias token id {tok} is negative (ids are >= 0)")
        b = real("logit_bias", bias)
        if not -MAX_ABS_LOGIT_BIAS <= b <= MAX_ABS_LOGIT_BIAS:
            raise ParamError(
                "logit_bias",
                f"logit_bias value for token {tok} must be in [-{MAX_ABS_LOGIT_BIAS:g}, "
                f"{MAX_ABS_LOGIT_BIAS:g}], got {b}",
            )
        out[tok] = b
    return out or None


def as_list(name: str, value: object, kind: type) -> list:
    """A stop field as a list: None is empty, one `kind` value is a list of one (so "abc" is
    one stop string, not three), a list or tuple keeps its entries, each of type `kind`."""
    if value is None:
        return []
    if kind is str and isinstance(value, str):
        return [value]
    if kind is int and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return [int(value)]
    if not isinstance(value, (list, tuple)):
        what = "an integer" if kind is int else "a string"
        raise ParamError(
            name, f"{name} must be {what} or a list of them, got {type(value).__name__}"
        )
    if kind is int:
        bad = [v for v in value if isinstance(v, bool) or not isinstance(v, numbers.Integral)]
    else:
        bad = [v for v in value if not isinstance(v, str)]
    if bad:
        what = "integers" if kind is int else "strings"
        raise ParamError(name, f"{name} entries must be {what}, got {bad[0]!r}")
    return [kind(v) for v in value]
