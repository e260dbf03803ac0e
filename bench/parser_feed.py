"""Cost of the output parsers per streamed delta: a 4 KB output fed 4 characters at a time.

Each case builds one `OutputStream` and feeds the whole output in 4-character deltas (1,024
feeds), then `finish()`; the figure is the median over `--repeats` runs of the mean wall time
per feed, in microseconds. `OutputStream` re-parses the whole text at each delta, so the cost
grows with the output's length (O(n) per feed); this measures that at 4 KB.

    PYTHONPATH=. python bench/parser_feed.py [--repeats 7] [--size 4096]
"""

from __future__ import annotations

import argparse
import statistics
import time

from moe_engine.server.parsers.base import OutputStream
from moe_engine.server.parsers.harmony import HarmonyReasoningParser, HarmonyToolParser
from moe_engine.server.parsers.reasoning_think import (
    DeepSeekR1ReasoningParser,
    KimiK2ReasoningParser,
    Qwen3ReasoningParser,
)

STEP = 4


def _filler(n: int) -> str:
    words = "the model considers each step of the problem carefully before it answers ".split()
    out, i = [], 0
    while sum(map(len, out)) + len(out) < n:
        out.append(words[i % len(words)])
        i += 1
    return " ".join(out)[:n]


def cases(size: int) -> dict[str, tuple[callable, str]]:
    """name -> (parsers factory, an output of about `size` characters, 3/4 of it reasoning)."""
    think = _filler(size * 3 // 4)
    answer = _filler(size - len(think) - len("<think></think>"))
    harmony_body = _filler(size - 400)
    call = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
            '<|message|>{"location": "San Francisco", "unit": "celsius"}<|call|>')
    return {
        "qwen3 (3/4 reasoning, 1/4 answer)": (
            lambda: (Qwen3ReasoningParser(), None), f"<think>{think}</think>{answer}"),
        "deepseek_r1 (opened by the prompt)": (
            lambda: (DeepSeekR1ReasoningParser(True), None), f"{think}</think>{answer}"),
        "kimi_k2 (implicit end marker)": (
            lambda: (KimiK2ReasoningParser(True), None), f"<think>{think}</think>{answer}"),
        "harmony reasoning + tools (analysis, final)": (
            lambda: (HarmonyReasoningParser(), HarmonyToolParser()),
            f"<|channel|>analysis<|message|>{harmony_body}<|end|><|start|>assistant"
            f"<|channel|>final<|message|>{_filler(300)}<|return|>"),
        "harmony reasoning + tools (analysis, call)": (
            lambda: (HarmonyReasoningParser(), HarmonyToolParser()),
            f"<|channel|>analysis<|message|>{harmony_body}<|end|>{call}"),
    }


def time_case(make, text: str, repeats: int) -> tuple[float, int]:
    """(median microseconds per feed, feeds per run)."""
    pieces = [text[i:i + STEP] for i in range(0, len(text), STEP)]
    runs = []
    for _ in range(repeats):
        stream = OutputStream(*make())
        start = time.perf_counter()
        for piece in pieces:
            stream.feed(piece)
        stream.finish()
        runs.append((time.perf_counter() - start) / len(pieces) * 1e6)
    return statistics.median(runs), len(pieces)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--size", type=int, default=4096, help="output length, characters")
    args = parser.parse_args()
    for name, (make, text) in cases(args.size).items():
        us, feeds = time_case(make, text, args.repeats)
        print(f"{name:48s} {len(text):5d} chars {feeds:5d} feeds {us:8.1f} us/feed")


if __name__ == "__main__":
    main()
