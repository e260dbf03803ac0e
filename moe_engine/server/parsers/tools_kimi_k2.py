"""Kimi-K2 tool calls (`kimi_k2`).

Format (Moonshot's `docs/tool_call_guidance.md` in the Kimi-K2-Instruct repository, and vLLM's
`kimi_k2_tool_parser.py`):

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>
    <|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>
    <|tool_calls_section_end|>

Whitespace may stand around every marker. The call id is the format's own
`functions.NAME:IDX`, which the chat template renders back into the history, so it is the
OpenAI `tool_calls[].id`. The singular section markers (`<|tool_call_section_begin|>`) that
some Kimi checkpoints emit are accepted too, as vLLM does.

The name is the id without its `:IDX` suffix and `functions.` prefix; a dotted name
(`mcp.search`) stays whole (vLLM keeps only the part after the last dot).
"""

from __future__ import annotations

import re

from moe_engine.server.parsers.tool_text import Match
from moe_engine.server.parsers.tools_sections import (
    Header,
    SectionToolParser,
    match_sequence,
    read_until,
    valid_name,
)

CALL_BEGIN = "<|tool_call_begin|>"
ARG_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
_CALL_ID = re.compile(r"(?:functions\.)?(?P<name>[^\s<>:]+(?::[^\s<>:]+)*):\d+")


class KimiK2ToolParser(SectionToolParser):
    """`functions.NAME:IDX<|tool_call_argument_begin|>ARGS<|tool_call_end|>` per call."""

    name = "kimi_k2"
    start_markers = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
    section_ends = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
    call_begin = CALL_BEGIN

    def parse_header(self, text: str, pos: int, final: bool) -> Header | Match:
        found, arg_begin = read_until(text, pos, ARG_BEGIN, final, forbidden="<>{")
        if found != Match.YES:
            return found
        call_id = text[pos:arg_begin].strip()
        match = _CALL_ID.fullmatch(call_id)
        if match is None or not valid_name(match["name"]):
            return Match.NO
        return Header(match["name"], call_id, arg_begin + len(ARG_BEGIN))

    def parse_trailer(self, text: str, pos: int, final: bool) -> tuple[Match, int]:
        return match_sequence(text, pos, (CALL_END,), final)
