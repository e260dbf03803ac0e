"""Text helpers shared by the marker-based parsers: what a stream must hold back at its end.

A parser that is not reading the final text must not send a tail that may still become a marker
(`</thi` may grow into `</think>`); these helpers measure that tail. Plain string scanning, no
regular expressions: O(number of markers x longest marker) per call, independent of the text's
length.
"""

from __future__ import annotations

from collections.abc import Iterable


def held_suffix_len(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`.

    Args:
        text: the text read so far.
        markers: the markers that may still complete at the end of `text` (non-empty strings).

    Returns:
        The number of trailing characters (0 .. max(len(marker)) - 1) to hold back until more
        text arrives; 0 when no marker can start in the tail.
    """
    markers = tuple(markers)
    window = max((len(m) for m in markers), default=1) - 1
    firsts = {m[0] for m in markers}
    # The earliest start in the window that begins a marker's prefix gives the longest suffix.
    for start in range(max(0, len(text) - window), len(text)):
        if text[start] in firsts:
            tail = text[start:]
            if any(len(m) > len(tail) and m.startswith(tail) for m in markers):
                return len(text) - start
    return 0


def without_held(text: str, markers: Iterable[str], final: bool) -> str:
    """`text` less the tail that may still become one of `markers` (nothing held when `final`)."""
    if final:
        return text
    held = held_suffix_len(text, markers)
    return text[: len(text) - held] if held else text
