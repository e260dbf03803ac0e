"""Microseconds per streamed delta for each tool-call parser (`python bench/tool_parsers.py`).

For each format: an output of about `--chars` characters (default 2,048: one sentence of
content, then two calls whose arguments hold a long string and a list of numbers) is fed
through `base.OutputStream` in pieces of `--piece` characters (default 4, about a token), as
the HTTP server does per engine delta. The figures are the mean, 99th percentile and worst
time of one `feed` (the whole re-parse of the text so far plus the diff), median of
`--repeats` runs; the second block is the same for `--long` outputs (default 16,384
characters), where a parse costs more because the text is longer (a parse is linear in it);
the third block is `--chars` of plain text without a call (what most chat answers are).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from moe_engine.server.parsers.base import OutputStream
from moe_engine.server.parsers.tools import TOOL_PARSERS

TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "text": {"type": "string"},
                                     "sizes": {"type": "array"}}}}}]


def _arguments(chars: int) -> dict:
    filler = "Lorem ipsum dolor sit amet, consectetur adipiscing elit. "
    text = (filler * (chars // len(filler) + 1))[:chars]
    return {"path": "/tmp/out.txt", "text": text, "sizes": list(range(chars // 40))}


def _xml(name: str, args: dict, key: str, value: str, end: str, key_end: str = "") -> str:
    del name
    parts = []
    for k, v in args.items():
        shown = v if isinstance(v, str) else json.dumps(v)
        parts.append(f"{key}{k}{key_end}{value}{shown}{end}")
    return "".join(parts)


def sample(fmt: str, chars: int) -> str:
    """About `chars` characters of output in format `fmt`: content, then two calls."""
    size, text = chars, _sample(fmt, chars)
    for _ in range(8):
        if abs(len(text) - chars) <= chars * 0.02:
            break
        size = max(1, int(size * chars / len(text)))
        text = _sample(fmt, size)
    return text


def _sample(fmt: str, chars: int) -> str:
    args = json.dumps(_arguments(chars // 3), ensure_ascii=False)
    small = json.dumps({"path": "/tmp/a"})
    content = "I will write the file and then list the folder.\n\n"
    if fmt == "hermes":
        body = "".join(f'<tool_call>\n{{"name": "write_file", "arguments": {a}}}\n</tool_call>\n'
                       for a in (args, small))
    elif fmt == "qwen3_coder":
        body = "".join(
            "<tool_call>\n<function=write_file>\n"
            + _xml("write_file", a, "<parameter=", ">\n", "\n</parameter>\n", "")
            + "</function>\n</tool_call>\n"
            for a in (_arguments(chars // 3), {"path": "/tmp/a"}))
    elif fmt == "glm45":
        body = "".join(
            "<tool_call>write_file\n"
            + _xml("write_file", a, "<arg_key>", "\n<arg_value>", "</arg_value>\n", "</arg_key>")
            + "</tool_call>"
            for a in (_arguments(chars // 3), {"path": "/tmp/a"}))
    elif fmt == "deepseek_v3":
        body = "<｜tool▁calls▁begin｜>" + "\n".join(
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>write_file\n```json\n{a}\n```"
            "<｜tool▁call▁end｜>" for a in (args, small)) + "<｜tool▁calls▁end｜>"
    elif fmt == "deepseek_v31":
        body = "<｜tool▁calls▁begin｜>" + "".join(
            f"<｜tool▁call▁begin｜>write_file<｜tool▁sep｜>{a}<｜tool▁call▁end｜>"
            for a in (args, small)) + "<｜tool▁calls▁end｜>"
    else:
        body = "<|tool_calls_section_begin|>" + "".join(
            f"<|tool_call_begin|>functions.write_file:{i}<|tool_call_argument_begin|>{a}"
            "<|tool_call_end|>" for i, a in enumerate((args, small))) + \
            "<|tool_calls_section_end|>"
    return content + body


PLAIN = ("The quick brown fox jumps over the lazy dog; naïve café 日本. " * 400)


def time_feeds(fmt: str, text: str, piece: int, calls: int = 2) -> list[float]:
    """Seconds of each feed (and the finish) of one stream of `text` in `piece`-char pieces."""
    stream = OutputStream(None, TOOL_PARSERS[fmt](TOOLS))
    times = []
    for pos in range(0, len(text), piece):
        start = time.perf_counter()
        stream.feed(text[pos:pos + piece])
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    stream.finish()
    times.append(time.perf_counter() - start)
    assert len(stream.tool_calls) == calls, (fmt, stream.tool_calls)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chars", type=int, default=2048)
    parser.add_argument("--long", type=int, default=16384)
    parser.add_argument("--piece", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{'parser':14} {'chars':>6} {'feeds':>6} {'mean us':>8} {'p99 us':>8} {'max us':>8} "
          f"{'total ms':>9}")
    for chars, calls in ((args.chars, 2), (args.long, 2), (args.chars, 0)):
        for fmt in TOOL_PARSERS:
            text = sample(fmt, chars) if calls else PLAIN[:chars]
            runs = [time_feeds(fmt, text, args.piece, calls) for _ in range(args.repeats)]
            mean = statistics.median(statistics.mean(r) for r in runs) * 1e6
            worst = statistics.median(max(r) for r in runs) * 1e6
            p99 = statistics.median(sorted(r)[int(len(r) * 0.99)] for r in runs) * 1e6
            total = statistics.median(sum(r) for r in runs) * 1e3
            print(f"{fmt:14} {len(text):6d} {len(runs[0]):6d} {mean:8.1f} {p99:8.1f} {worst:8.1f} "
                  f"{total:9.2f}")


if __name__ == "__main__":
    main()
