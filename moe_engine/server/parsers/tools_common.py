"""The scan every tool parser shares: content, call blocks, content, call blocks, ...

A format is a start marker (or a few) and a block parser: `BlockToolParser.parse` finds each
start marker, asks `parse_block` what the block holds, and keeps the text between blocks as
content. A block parser answers with a `Block`:

- calls and the index after the block (complete);
- calls and `end=None`: the text ends inside the block (only when not final);
- `malformed(start, marker)`: the block can never hold a call, so its start marker is plain
  content and the scan goes on right after it (a later well-formed block is still found).

Rules every format shares (each keeps `parse` a pure function whose non-final answers are
prefixes of its final one, which `base.OutputStream` relies on):

- A call is named only when its name is complete; its arguments only grow.
- A call that is named is never taken back: if its markup breaks later, the call keeps the
  arguments read so far and the rest of its block is returned as content (never dropped).
- Whitespace between content and a call (the newlines templates put around markers) is not
  content: a content run is stripped on the sides that touch a call, and dropped if nothing
  else is left. A trailing run is held back while a call may still follow.
- A tail that may be the start of a marker (`<tool_`, half of `<｜tool▁calls▁begin｜>`) is
  held back until the text decides it, unless the text is final.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from moe_engine.server.parsers.base import ParsedCalls, PartialCall, ToolParser
from moe_engine.server.parsers.tool_text import partial_marker_len


@dataclass
class Block:
    """What one block of tool-call markup holds.

    Attributes:
        calls: the calls named so far, in order.
        end: index after the block; None while the text ends inside it (never when final).
        content: text of the block returned as content (the part after a call whose markup
            broke), placed after the calls.
        is_call: False for a start marker that turned out not to open a call.
    """

    calls: list[PartialCall] = field(default_factory=list)
    end: int | None = None
    content: str = ""
    is_call: bool = True


def malformed(start: int, marker: str) -> Block:
    """The block at `start` is no call: its start marker becomes content."""
    return Block([], start + len(marker), marker, is_call=False)


def pending() -> Block:
    """The text ends before the block shows whether (or what) it calls."""
    return Block([], None)


def broken_tail(calls: list[PartialCall], text: str, pos: int, stop_markers: tuple[str, ...],
                final: bool) -> Block:
    """The markup broke at `pos` after `calls` were named: the text from `pos` to the end of
    the block (the first of `stop_markers`, inclusive, or the end of the text when final) is
    content. While the end is not in sight the block stays open."""
    for call in calls:
        call.done = True
    found = [(i, m) for m in stop_markers if (i := text.find(m, pos)) >= 0]
    if found:
        index, marker = min(found)
        end = index + len(marker)
        return Block(calls, end, text[pos:end])
    if not final:
        return Block(calls, None)
    return Block(calls, len(text), text[pos:])


class BlockToolParser(ToolParser):
    """A format whose calls sit in blocks that open with one of `start_markers`."""

    start_markers: ClassVar[tuple[str, ...]]

    def parse_block(self, text: str, start: int, marker: str, final: bool) -> Block:
        """Read the block whose start marker `marker` stands at `text[start]`."""
        raise NotImplementedError

    def parse(self, text: str, final: bool) -> ParsedCalls:
        content: list[str] = []
        calls: list[PartialCall] = []
        segment_start = pos = 0
        after_call = False
        while True:
            start, marker = self._next_start(text, pos)
            if start < 0:
                break
            block = self.parse_block(text, start, marker, final)
            if not block.is_call:
                pos = block.end  # the marker is plain text of the current content run
                continue
            run = text[segment_start:start].rstrip()
            content.append(run.lstrip() if after_call else run)
            if block.end is None:
                calls.extend(block.calls)
                return ParsedCalls("".join(content), calls)
            calls.extend(block.calls)
            content.append(block.content)
            segment_start = pos = block.end
            after_call = True
        run = text[segment_start:]
        if not final:
            run = run[:len(run) - partial_marker_len(run, self.start_markers)].rstrip()
        content.append(run.lstrip() if after_call else run)
        return ParsedCalls("".join(content), calls)

    def _next_start(self, text: str, pos: int) -> tuple[int, str]:
        best, best_marker = -1, ""
        for marker in self.start_markers:
            index = text.find(marker, pos)
            if index >= 0 and (best < 0 or index < best):
                best, best_marker = index, marker
        return best, best_marker
