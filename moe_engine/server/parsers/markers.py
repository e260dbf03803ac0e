"""Text helpers shared by the marker-based parsers: what a stream must hold back at its end.

A parser that is not reading the final text must not send a tail that may still become a marker
(`</thi` may grow into `</think>`); these helpers measure that tail. Plain string scanning, no
regular expressions: O(number of markers x longest marker) per call, independent of the text's
length (`str.find` over each marker's last window).
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
    held, size = 0, len(text)
    for marker in markers:
        # Candidate starts: where the marker's first character stands in its last len-1 chars.
        at = text.find(marker[0], max(0, size - len(marker) + 1))
        while at >= 0 and size - at > held:
            if marker.startswith(text[at:]):
                held = size - at
                break
            at = text.find(marker[0], at + 1)
    return held


def without_held(text: str, markers: Iterable[str], final: bool) -> str:
    """`text` less the tail that may still become one of `markers` (nothing held when `final`)."""
    if final:
        return text
    held = held_suffix_len(text, markers)
    return text[: len(text) - held] if held else text
