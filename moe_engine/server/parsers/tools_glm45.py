"""GLM-4.5 / GLM-4.6 / GLM-4.7 tool calls (`glm45`).

Format (the GLM-4.5 chat template renders a call as `'\\n<tool_call>' + tc.name`, then per
argument `<arg_key>{{ k }}</arg_key>\\n<arg_value>{{ v | tojson if v is not string else v }}
</arg_value>`, then `</tool_call>`; GLM-4.7's template writes the same without newlines;
vLLM's `glm4_moe_tool_parser.py`), one block per call:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

The name runs to the first newline or tag. Keys are stripped; a value whose parameter the
tool's schema types as string stays text as written, any other is stripped and decoded
(`tool_values.glm45_value`, vLLM's current rules). An `</arg_value>` ends the value only when
`<arg_key>` or `</tool_call>` follows it, so values may contain the markers. The arguments
stream one complete argument at a time (`{"city": "Paris"`, then `, "days": 3`, then `}`);
a string value streams as it is written (`, "code": "def f(` and on), as vLLM's parser does
since its issue 32829.
"""

from __future__ import annotations

import re

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
    glm45_is_text,
    glm45_value,
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
KEY = "<arg_key>"
KEY_END = "</arg_key>"
VALUE = "<arg_value>"
VALUE_END = "</arg_value>"
_NAME_END = re.compile(r"[\n<]")


class Glm45ToolParser(BlockToolParser):
    """`<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`."""

    name = "glm45"
    start_markers = (START,)

    def parse_block(self, text: str, start: int, marker: str, final: bool) -> Block:
        name_start = skip_ws(text, start + len(marker))
        found = _NAME_END.search(text, name_start)
        if found is None:
            region = text[name_start:].strip()
            if final or (region and not valid_name(region)):
                return malformed(start, marker)
            return pending()
        name_end = found.start()
        name = text[name_start:name_end].strip()
        if not valid_name(name):
            return malformed(start, marker)
        if text[name_end] == "<":
            tag, _ = match_any(text, name_end, (KEY, END), final)
            if tag == Match.PENDING:
                return pending()
            if tag == Match.NO:
                return malformed(start, marker)
        return self._arguments(text, name_end, PartialCall(name), final)

    def _arguments(self, text: str, pos: int, call: PartialCall, final: bool) -> Block:
        """Read `<arg_key>`/`<arg_value>` pairs from `pos` up to `</tool_call>`."""
        n = len(text)
        args = ArgumentsText()
        properties = find_properties(self.tools, call.name or "")
        while True:
            pos = skip_ws(text, pos)
            found, which = match_any(text, pos, (KEY, END), final)
            if found == Match.PENDING:
                call.arguments = args.text(closed=False)
                return Block([call], None)
            call.arguments = args.text(closed=True)
            if found == Match.NO:
                return broken_tail([call], text, pos, (END,), final)
            if which == END:
                call.done = True
                return Block([call], min(pos + len(END), n))
            key_start = min(pos + len(KEY), n)
            found, key_end = read_until(text, key_start, KEY_END, final, forbidden="<>")
            key = text[key_start:key_end].strip() if found == Match.YES else ""
            value_start = skip_ws(text, key_end + len(KEY_END)) if key else n
            tag = match_marker(text, value_start, VALUE, final) if key else Match.NO
            if found == Match.PENDING or tag == Match.PENDING:
                call.arguments = args.text(closed=False)
                return Block([call], None)
            if tag == Match.NO:
                return broken_tail([call], text, pos, (END,), final)
            value_start = min(value_start + len(VALUE), n)
            found, value_end, pos = structural_close(
                text, value_start, VALUE_END, (KEY, END), (KEY, END), final)
            schema, known = properties.get(key), key in properties
            if found == Match.PENDING:
                streamed = None
                if glm45_is_text(schema, known):  # a text value streams as it is written
                    streamed = key, open_value_prefix(text, value_start, VALUE_END, (KEY, END),
                                                      (KEY, END))
                call.arguments = args.text(False, streamed)
                return Block([call], None)
            args.add(key, glm45_value(text[value_start:value_end], schema, known))
