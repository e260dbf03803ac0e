"""Text scanning shared by the tool parsers: a JSON prefix scanner and marker matching.

Every function here is pure and linear in the text it reads; strings are skipped with one
compiled regex per string, so a scan costs a few microseconds per kilobyte.

The JSON grammar is RFC 8259's (strict: no control characters inside strings, no NaN, no
trailing commas): a scanner that says COMPLETE guarantees `json.loads` accepts the span.
"""

from __future__ import annotations

import re
from enum import IntEnum


class Scan(IntEnum):
    """How far a JSON value reaches in the text scanned so far."""

    COMPLETE = 0  #: the value ends inside the text; `end` is the index after it
    PARTIAL = 1  #: the text ends inside the value, and is a valid prefix of some JSON value
    INVALID = 2  #: no JSON value starts this way; `end` is the index of the offending char
    #: (so `text[start:end]` is the longest valid prefix, never shorter than a PARTIAL scan
    #: of a shorter text was)


_WS = re.compile(r"[ \t\n\r]*")
# The body of a JSON string: runs of plain characters or complete escapes.
_STRING_BODY = re.compile(r'(?:[^"\\\x00-\x1f]+|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')
_PARTIAL_ESCAPE = re.compile(r"\\(?:u[0-9a-fA-F]{0,3})?\Z")
_ESCAPE_START = re.compile(r"(?:\\(?:u[0-9a-fA-F]{0,3})?)?")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_PREFIX = re.compile(r"-?(?:0|[1-9][0-9]*)?(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?")
_LITERALS = ("true", "false", "null")

# Parser states inside containers.
_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _COLON, _COMMA_OR_CLOSE = range(6)


def skip_ws(text: str, pos: int) -> int:
    """The index of the first non-JSON-whitespace character at or after `pos`."""
    return _WS.match(text, pos).end()


def scan_string(text: str, pos: int) -> tuple[Scan, int]:
    """Scan the JSON string that starts at `text[pos] == '"'`; returns (state, end)."""
    end = _STRING_BODY.match(text, pos + 1).end()
    if end == len(text) or _PARTIAL_ESCAPE.match(text, end):
        return Scan.PARTIAL, len(text)
    if text[end] == '"':
        return Scan.COMPLETE, end + 1
    # A broken escape breaks after its valid start (`\u12` in `\u12x`), so that the text
    # before the offending character is still the longest valid prefix.
    return Scan.INVALID, _ESCAPE_START.match(text, end).end()


def _scan_scalar(text: str, pos: int) -> tuple[Scan, int]:
    """A number or literal starting at `pos` (a non-space character that is not `"{[`)."""
    char = text[pos]
    if char == "-" or "0" <= char <= "9":
        end = _NUMBER_PREFIX.match(text, pos).end()
        if end == len(text):
            return Scan.PARTIAL, end
        full = _NUMBER.match(text, pos)
        if full is not None and full.end() == end:
            return Scan.COMPLETE, end
        return Scan.INVALID, end
    for literal in _LITERALS:
        if literal[0] != char:
            continue
        size = 1
        while size < len(literal) and pos + size < len(text) and text[pos + size] == literal[size]:
            size += 1
        if size == len(literal):
            return Scan.COMPLETE, pos + size
        if pos + size == len(text):
            return Scan.PARTIAL, len(text)
        return Scan.INVALID, pos + size  # `tr` of `trX` is still a valid prefix
    return Scan.INVALID, pos


def scan_value(text: str, pos: int) -> tuple[Scan, int]:
    """Scan one JSON value starting at `pos` (leading whitespace skipped).

    Returns:
        (state, end): COMPLETE with the index after the value; PARTIAL with `len(text)` when
        the text ends inside the value; INVALID with the index of the first character that no
        JSON value could have there.
    """
    stack: list[str] = []
    state = _VALUE
    n = len(text)
    skip = _WS.match
    while True:
        if pos < n and text[pos] in " \t\n\r":
            pos = skip(text, pos).end()
        if pos >= n:
            return Scan.PARTIAL, n
        char = text[pos]
        if state in (_VALUE, _VALUE_OR_CLOSE):
            if state == _VALUE_OR_CLOSE and char == "]":
                stack.pop()
                pos += 1
            elif char == "{":
                stack.append("}")
                state = _KEY_OR_CLOSE
                pos += 1
                continue
            elif char == "[":
                stack.append("]")
                state = _VALUE_OR_CLOSE
                pos += 1
                continue
            else:
                found, pos = scan_string(text, pos) if char == '"' else _scan_scalar(text, pos)
                if found != Scan.COMPLETE:
                    return found, pos
        elif state in (_KEY, _KEY_OR_CLOSE):
            if state == _KEY_OR_CLOSE and char == "}":
                stack.pop()
                pos += 1
            elif char == '"':
                found, pos = scan_string(text, pos)
                if found != Scan.COMPLETE:
                    return found, pos
                state = _COLON
                continue
            else:
                return Scan.INVALID, pos
        elif state == _COLON:
            if char != ":":
                return Scan.INVALID, pos
            state = _VALUE
            pos += 1
            continue
        else:  # _COMMA_OR_CLOSE
            if char == ",":
                state = _KEY if stack[-1] == "}" else _VALUE
                pos += 1
                continue
            if char != stack[-1]:
                return Scan.INVALID, pos
            stack.pop()
            pos += 1
        # A value (scalar or container) just ended.
        if not stack:
            return Scan.COMPLETE, pos
        state = _COMMA_OR_CLOSE


class Match(IntEnum):
    """Whether a marker stands at a position."""

    NO = 0  #: something else stands there
    PENDING = 1  #: the text ends inside (a prefix of) the marker; more text decides
    YES = 2


def match_marker(text: str, pos: int, marker: str, final: bool) -> Match:
    """Does `marker` start at `pos`?

    Not `final`: a text that ends with a prefix of the marker (the empty one included) is
    PENDING. `final`: a non-empty prefix at the very end counts as the marker (the model's
    output was cut inside it), an empty one as NO.
    """
    if text.startswith(marker, pos):
        return Match.YES
    rest = text[pos:]
    if marker.startswith(rest):
        if not final:
            return Match.PENDING
        return Match.YES if rest else Match.NO
    return Match.NO


def match_any(text: str, pos: int, markers: tuple[str, ...],
              final: bool) -> tuple[Match, str]:
    """The first of `markers` that stands at `pos` (YES), else PENDING if any may, else NO.

    Returns (match, marker); `marker` is "" unless the match is YES.
    """
    pending = False
    for marker in markers:
        found = match_marker(text, pos, marker, final)
        if found == Match.YES:
            return Match.YES, marker
        pending = pending or found == Match.PENDING
    return (Match.PENDING if pending else Match.NO), ""


def partial_marker_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    longest = 0
    n = len(text)
    for marker in markers:
        window = max(0, n - len(marker) + 1)
        index = text.rfind(marker[0], window)
        while index >= 0:  # the earliest start in the window that begins the marker wins
            if marker.startswith(text[index:]):
                longest = max(longest, n - index)
            index = text.rfind(marker[0], window, index)
    return longest


def structural_close(text: str, start: int, close: str, followers: tuple[str, ...],
                     fallback_ends: tuple[str, ...], final: bool) -> tuple[Match, int, int]:
    """Find where a free-text value that starts at `start` ends (XML-style formats).

    The value ends at the first `close` followed (after whitespace) by one of `followers`, so
    a value may itself contain `close` (code that writes `</parameter>`). A `close` at the end
    of the text waits for what follows unless the text is final. A final text without such a
    close ends the value at the first of `fallback_ends` (or the end of the text): the model
    forgot the close tag or was cut off.

    Returns:
        (YES, end of the value, index to read on from) or (PENDING, -1, -1).
    """
    n = len(text)
    search = start
    while (index := text.find(close, search)) >= 0:
        after = skip_ws(text, index + len(close))
        if after == n:
            return (Match.YES, index, n) if final else (Match.PENDING, -1, -1)
        found, _ = match_any(text, after, followers, final)
        if found == Match.YES:
            return Match.YES, index, index + len(close)
        if found == Match.PENDING:
            return Match.PENDING, -1, -1
        search = index + 1
    if not final:
        return Match.PENDING, -1, -1
    ends = [i for marker in fallback_ends if (i := text.find(marker, start)) >= 0]
    end = min(ends, default=n)
    return Match.YES, end, end


def open_value_prefix(text: str, start: int, close: str, followers: tuple[str, ...],
                      fallback_ends: tuple[str, ...]) -> str:
    """The part of a value still being written (see `structural_close`, which returned
    PENDING) that no later text can cut off: it stops before a `close` whose meaning is not
    decided yet, before any of `fallback_ends` (where a final text without a close would end
    the value) and before a tail that may begin one of those markers."""
    n = len(text)
    limit = n
    search = start
    while (index := text.find(close, search)) >= 0:
        after = skip_ws(text, index + len(close))
        if after == n or match_any(text, after, followers, False)[0] != Match.NO:
            limit = index
            break
        search = index + 1
    for marker in fallback_ends:
        index = text.find(marker, start)
        if 0 <= index < limit:
            limit = index
    value = text[start:limit]
    if limit == n:
        value = value[:len(value) - partial_marker_len(value, (close, *fallback_ends))]
    return value
