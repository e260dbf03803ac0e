"""DeepSeek-V3 (`deepseek_v3`) and DeepSeek-V3.1 (`deepseek_v31`) tool calls.

DeepSeek-V3 / R1 (the checkpoint's chat template in `tokenizer_config.json`, and vLLM's
`deepseekv3_tool_parser.py`), calls joined by a newline:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

DeepSeek-V3.1 (its chat template: "For multiple tool calls, chain them directly without
separators or spaces"; vLLM's `deepseekv31_tool_parser.py`):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>

(one line in the real output). DeepSeek-V3 calls written without the ```json fence (the JSON
right after the name's newline) are read too. Text before the section is content. The
section's markers are single special tokens in both vocabularies; the parsers also accept them
split across deltas. Whitespace is allowed around every marker and inside the code fence.
"""

from __future__ import annotations

from moe_engine.server.parsers.tool_text import Match, match_marker, skip_ws
from moe_engine.server.parsers.tools_sections import (
    Header,
    SectionToolParser,
    match_sequence,
    read_until,
    valid_name,
)

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE = "```json"


class DeepSeekV3ToolParser(SectionToolParser):
    """`TYPE<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>`; the fence is optional."""

    name = "deepseek_v3"
    start_markers = (CALLS_BEGIN,)
    section_ends = (CALLS_END,)
    call_begin = CALL_BEGIN

    def parse_header(self, text: str, pos: int, final: bool) -> Header | Match:
        found, sep = read_until(text, pos, SEP, final, forbidden="<>\n{`")
        if found != Match.YES:
            return found
        start = sep + len(SEP)
        found, newline = read_until(text, start, "\n", final, forbidden="<>{`")
        if found != Match.YES:
            return found
        name = text[start:newline].strip()
        if not valid_name(name):
            return Match.NO
        pos = skip_ws(text, newline)
        fence = match_marker(text, pos, FENCE, final)
        if fence == Match.PENDING:
            return fence
        return Header(name, None, pos + len(FENCE) if fence == Match.YES else pos)

    def parse_trailer(self, text: str, pos: int, final: bool) -> tuple[Match, int]:
        pos = skip_ws(text, pos)
        fence = match_marker(text, pos, "```", final)
        if fence == Match.PENDING and pos < len(text):
            return fence, pos
        if fence == Match.YES:
            pos = min(pos + 3, len(text))
        return match_sequence(text, pos, (CALL_END,), final)


class DeepSeekV31ToolParser(SectionToolParser):
    """`NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>` per call."""

    name = "deepseek_v31"
    start_markers = (CALLS_BEGIN,)
    section_ends = (CALLS_END,)
    call_begin = CALL_BEGIN

    def parse_header(self, text: str, pos: int, final: bool) -> Header | Match:
        found, sep = read_until(text, pos, SEP, final, forbidden="<>\n{`")
        if found != Match.YES:
            return found
        name = text[pos:sep].strip()
        if not valid_name(name):
            return Match.NO
        return Header(name, None, sep + len(SEP))

    def parse_trailer(self, text: str, pos: int, final: bool) -> tuple[Match, int]:
        return match_sequence(text, pos, (CALL_END,), final)
