"""Qwen3-Coder XML tool calls (`qwen3_coder`): Qwen3-Coder-480B-A35B / 30B-A3B, Qwen3-Next.

Format (the Qwen3-Coder chat template: "<tool_call>\\n<function=example_function_name>\\n
<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n...</function>\\n</tool_call>";
vLLM's `qwen3coder_tool_parser.py`), one block per call:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value loses one leading and one trailing newline and is converted by the tool's parameter
schema (`tool_values.qwen3_coder_value`, vLLM's rules). A `</parameter>` ends the value only
when `<parameter=`, `</function>` or `</tool_call>` follows it (vLLM's structural rule), so
code values may contain the markers. The arguments stream one complete parameter at a time
(`{"city": "Paris"`, then `, "days": 3`, then `}`), except that a value that stays text
whatever it holds (a string in the schema, or a parameter the tool does not declare) streams
as it is written (`, "code": "def f(` and on), so a long file does not wait for its close
(vLLM issue 32829); a `</parameter>` whose meaning is undecided, and a trailing newline, are
held back until the text decides them.
"""

from __future__ import annotations

from moe_engine.server.parsers.base import PartialCall
from moe_engine.server.parsers.tool_text import (
    Match,
    match_any,
    match_marker,
    open_value_prefix,
    skip_ws,
    structural_close,
)
from moe_engine.server.parsers.tool_values import (
    ArgumentsText,
    find_properties,
    qwen3_coder_is_text,
    qwen3_coder_value,
)
from moe_engine.server.parsers.tools_common import (
    Block,
    BlockToolParser,
    broken_tail,
    malformed,
    pending,
)
from moe_engine.server.parsers.tools_sections import read_until, valid_name

START = "<tool_call>"
END = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"


_FOLLOWERS = (PARAMETER, FUNCTION_END, END)
_FALLBACK_ENDS = ("\n" + PARAMETER, FUNCTION_END, END)


def _strip_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value


def _streamed(text: str, start: int, key: str) -> tuple[str, str]:
    """(key, the certain start of a text value still being written): one leading newline
    dropped, and a trailing one held back (the value loses one when it closes)."""
    value = open_value_prefix(text, start, PARAMETER_END, _FOLLOWERS, _FALLBACK_ENDS)
    if value.startswith("\n"):
        value = value[1:]
    return key, value[:-1] if value.endswith("\n") else value


class Qwen3CoderToolParser(BlockToolParser):
    """`<tool_call><function=NAME><parameter=P>VALUE</parameter>...</function></tool_call>`."""

    name = "qwen3_coder"
    start_markers = (START,)

    def parse_block(self, text: str, start: int, marker: str, final: bool) -> Block:
        pos = skip_ws(text, start + len(marker))
        found = match_marker(text, pos, FUNCTION, final)
        if found == Match.PENDING:
            return pending()
        if found == Match.NO or pos + len(FUNCTION) > len(text):
            return malformed(start, marker)
        found, name_end = read_until(text, pos + len(FUNCTION), ">", final, forbidden="<\n")
        if found == Match.PENDING:
            return pending()
        name = text[pos + len(FUNCTION):name_end].strip() if found == Match.YES else ""
        if not valid_name(name):
            return malformed(start, marker)
        call = PartialCall(name)
        return self._parameters(text, name_end + 1, call, final)

    def _parameters(self, text: str, pos: int, call: PartialCall, final: bool) -> Block:
        """Read `<parameter=...>` blocks from `pos` up to `</function></tool_call>`."""
        n = len(text)
        args = ArgumentsText()
        properties = find_properties(self.tools, call.name or "")
        while True:
            pos = skip_ws(text, pos)
            found, which = match_any(text, pos, (PARAMETER, FUNCTION_END), final)
            if found == Match.PENDING:
                call.arguments = args.text(closed=False)
                return Block([call], None)
            call.arguments = args.text(closed=True)
            if found == Match.NO:
                return broken_tail([call], text, pos, (END,), final)
            if which == FUNCTION_END:
                return self._close(text, min(pos + len(FUNCTION_END), n), call, final)
            key_start = min(pos + len(PARAMETER), n)
            found, key_end = read_until(text, key_start, ">", final, forbidden="<\n")
            key = text[key_start:key_end].strip() if found == Match.YES else ""
            if found == Match.PENDING:
                call.arguments = args.text(closed=False)
                return Block([call], None)
            if not key:
                return broken_tail([call], text, pos, (END,), final)
            value_start = key_end + 1
            found, value_end, pos = structural_close(
                text, value_start, PARAMETER_END, _FOLLOWERS, _FALLBACK_ENDS, final)
            schema, known = properties.get(key), key in properties
            if found == Match.PENDING:
                call.arguments = args.text(False, _streamed(text, value_start, key)
                                           if qwen3_coder_is_text(schema, known) else None)
                return Block([call], None)
            value = _strip_newline(text[value_start:value_end])
            args.add(key, qwen3_coder_value(value, schema, known))

    @staticmethod
    def _close(text: str, pos: int, call: PartialCall, final: bool) -> Block:
        """After `</function>`: the call is complete; `</tool_call>` ends the block."""
        after = skip_ws(text, pos)
        found = match_marker(text, after, END, final)
        if found == Match.PENDING:
            return Block([call], None)
        call.done = True
        if found == Match.YES:
            return Block([call], min(after + len(END), len(text)))
        return Block([call], pos)  # no </tool_call>: what follows is content
