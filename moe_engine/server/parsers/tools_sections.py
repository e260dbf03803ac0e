"""Formats whose calls sit in one section of special tokens, each call with JSON arguments:

    SECTION_BEGIN (CALL_BEGIN header JSON trailer)+ SECTION_END

DeepSeek-V3, DeepSeek-V3.1 and Kimi-K2 (`tools_deepseek.py`, `tools_kimi_k2.py`) differ only
in the header (what names the call) and the trailer (what closes it). The arguments are
streamed as the model writes them: the raw JSON text up to where the text ends, checked as a
valid JSON prefix by `tool_text.scan_value`, so every fragment is a prefix of the final text
(vLLM's parsers for these formats re-derive arguments from partial parses instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moe_engine.server.parsers.base import PartialCall
from moe_engine.server.parsers.tool_text import (
    Match,
    Scan,
    match_any,
    match_marker,
    partial_marker_len,
    scan_value,
    skip_ws,
)
from moe_engine.server.parsers.tools_common import (
    Block,
    BlockToolParser,
    broken_tail,
    malformed,
    pending,
)


@dataclass
class Header:
    """A call's header as read: its name, the id the format gives it, where arguments start."""

    name: str
    call_id: str | None
    args_pos: int


def match_sequence(text: str, pos: int, parts: tuple[str, ...],
                   final: bool) -> tuple[Match, int]:
    """Match `parts` in order, JSON whitespace allowed before each; returns (match, end).

    `final` and the text ends: the sequence counts as matched (the output was cut in it).
    """
    for part in parts:
        pos = skip_ws(text, pos)
        if final and pos == len(text):
            return Match.YES, pos
        found = match_marker(text, pos, part, final)
        if found != Match.YES:
            return found, pos
        pos = min(pos + len(part), len(text))
    return Match.YES, pos


def read_until(text: str, pos: int, marker: str, final: bool,
               forbidden: str) -> tuple[Match, int]:
    """Find `marker` after `pos`, with no character of `forbidden` before it.

    Returns (YES, index of the marker), (PENDING, -1) while it may still come, (NO, -1).
    """
    index = text.find(marker, pos)
    region = text[pos:] if index < 0 else text[pos:index]
    if index < 0 and not final:
        region = region[:len(region) - partial_marker_len(region, (marker,))]
    if any(char in region for char in forbidden):
        return Match.NO, -1
    if index >= 0:
        return Match.YES, index
    return (Match.NO if final else Match.PENDING), -1


def valid_name(name: str) -> bool:
    """A function name as the formats write them: non-empty, no space, quote, brace or tag."""
    return bool(name) and not any(char in name for char in " \t\r\n<>{}\"'`")


class SectionToolParser(BlockToolParser):
    """One section of calls, each with JSON arguments (see the module docstring)."""

    #: the markers that open / close the section (first is the canonical one)
    start_markers: ClassVar[tuple[str, ...]]
    section_ends: ClassVar[tuple[str, ...]]
    call_begin: ClassVar[str]

    def parse_header(self, text: str, pos: int, final: bool) -> Header | Match:
        """Read a call's header from `pos` (just after CALL_BEGIN): a Header, PENDING or NO."""
        raise NotImplementedError

    def parse_trailer(self, text: str, pos: int, final: bool) -> tuple[Match, int]:
        """Read what closes a call from `pos` (after its arguments), CALL_END included."""
        raise NotImplementedError

    def parse_block(self, text: str, start: int, marker: str, final: bool) -> Block:
        calls: list[PartialCall] = []
        pos = start + len(marker)
        while True:
            pos = skip_ws(text, pos)
            found, which = match_any(text, pos, (self.call_begin, *self.section_ends), final)
            if found == Match.PENDING:
                return Block(calls, None) if calls else pending()
            if found == Match.NO or pos + len(which) > len(text):
                # No section end (or one cut off at the end of a final text): the section
                # stops here and what follows is content.
                return Block(calls, pos) if calls else malformed(start, marker)
            if which != self.call_begin:
                return Block(calls, pos + len(which)) if calls else malformed(start, marker)
            header = self.parse_header(text, pos + len(which), final)
            if header == Match.PENDING:
                return Block(calls, None) if calls else pending()
            if header == Match.NO:
                if not calls:
                    return malformed(start, marker)
                return broken_tail(calls, text, pos, self.section_ends, final)
            assert isinstance(header, Header)
            call = PartialCall(header.name, "", False, header.call_id)
            calls.append(call)
            state, pos = self._read_arguments(text, header.args_pos, call, final)
            if state == Scan.PARTIAL:
                call.done = final
                return Block(calls, len(text) if final else None)
            if state == Scan.INVALID:
                return broken_tail(calls, text, pos, self.section_ends, final)
            call.done = True

    def _read_arguments(self, text: str, pos: int, call: PartialCall,
                        final: bool) -> tuple[Scan, int]:
        """Fill `call.arguments` from `pos`; returns (COMPLETE, index after the trailer),
        (PARTIAL, -1) while the text ends inside the call, or (INVALID, where it broke)."""
        pos = skip_ws(text, pos)
        if pos == len(text) or text[pos] == "<":
            # No JSON (a JSON value never starts with "<"): a call without arguments.
            found, end = self.parse_trailer(text, pos, final)
            if found == Match.YES:
                call.arguments = "{}"
                return Scan.COMPLETE, end
            return (Scan.PARTIAL, -1) if found == Match.PENDING else (Scan.INVALID, pos)
        state, end = scan_value(text, pos)
        if state == Scan.PARTIAL:
            call.arguments = text[pos:]
            return Scan.PARTIAL, -1
        call.arguments = text[pos:end]
        if state == Scan.INVALID:
            return Scan.INVALID, end
        found, after = self.parse_trailer(text, end, final)
        if found == Match.YES:
            return Scan.COMPLETE, after
        return (Scan.PARTIAL, -1) if found == Match.PENDING else (Scan.INVALID, end)
