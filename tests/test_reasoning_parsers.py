"""Reasoning parsers (think blocks, gpt-oss harmony) and the harmony tool parser, streamed.

Every sample is parsed whole and streamed through `base.OutputStream` split at every character
boundary (so at every token boundary a detokenizer can produce: deltas are whole characters),
one character at a time, and at random points; all must give the same reasoning, content and
calls, also under 64 concurrent streams. Samples are written to each family's documented format
(sources in the parser modules' docstrings). No server, no model.
"""

from __future__ import annotations

import asyncio
import json
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
from tool_parser_cases import CASES, TOOLS

from moe_engine.server.parsers import registry
from moe_engine.server.parsers.base import OutputStream
from moe_engine.server.parsers.harmony import (
    HarmonyReasoningParser,
    HarmonyToolParser,
    _parse_header,
)
from moe_engine.server.parsers.markers import held_suffix_len, without_held
from moe_engine.server.parsers.reasoning_think import (
    DeepSeekR1ReasoningParser,
    DeepSeekV31ReasoningParser,
    Glm45ReasoningParser,
    KimiK2ReasoningParser,
    Qwen3ReasoningParser,
)

# ---------------------------------------------------------------------------------------------
# Streaming through OutputStream


@dataclass
class Result:
    reasoning: str
    content: str
    calls: list[tuple[str, str]] = field(default_factory=list)


def run_stream(parsers: tuple, pieces: list[str]) -> Result:
    """Feed `pieces` through one OutputStream; check the deltas add up to its final fields."""
    stream = OutputStream(*parsers)
    reasoning, content, calls = "", "", {}
    for delta in [stream.feed(p) for p in pieces] + [stream.finish()]:
        reasoning += delta.reasoning_content
        content += delta.content
        for piece in delta.tool_calls:
            name, args = calls.get(piece.index, (piece.name, ""))
            calls[piece.index] = (name, args + piece.arguments)
    assert (reasoning, content) == (stream.reasoning, stream.content)
    assert [calls[i] for i in sorted(calls)] == [(c.name, c.arguments) for c in stream.tool_calls]
    return Result(stream.reasoning, stream.content, [(c.name, c.arguments)
                                                     for c in stream.tool_calls])


def splits(text: str, seed: int = 0, random_splits: int = 12) -> list[list[str]]:
    """Every two-piece split, one character at a time, and random multi-piece splits."""
    out = [[text[:i], text[i:]] for i in range(1, len(text))]
    out.append(list(text))
    rng = random.Random(seed)
    for _ in range(random_splits):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 9))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


def assert_stream_equals_whole(parsers: tuple, text: str, seed: int = 0) -> Result:
    whole = run_stream(parsers, [text])
    for pieces in splits(text, seed):
        assert run_stream(parsers, pieces) == whole, pieces
    return whole


# ---------------------------------------------------------------------------------------------
# Think-block families

R1, V31, QWEN3, GLM, KIMI = (DeepSeekR1ReasoningParser, DeepSeekV31ReasoningParser,
                             Qwen3ReasoningParser, Glm45ReasoningParser, KimiK2ReasoningParser)
KIMI_CALLS = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
              '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
              "<|tool_calls_section_end|>")

#: (parser class, starts_in_reasoning, output text, (reasoning, content, ended))
THINK_SAMPLES = [
    # DeepSeek-R1: the template opened the block.
    (R1, True, "Okay, 2+2 is 4.\n</think>\n\nThe answer is **4**.",
     ("Okay, 2+2 is 4.\n", "\n\nThe answer is **4**.", True)),
    (R1, True, "Let me think about </th", ("Let me think about </th", "", False)),  # cut
    (R1, True, "<think>\nHmm, 思考 🤔.</think>Four.", ("\nHmm, 思考 🤔.", "Four.", True)),
    (R1, True, "</think>Four.", ("", "Four.", True)),  # empty block
    (R1, False, "<think>a</think>b", ("a", "b", True)),  # old template: the model opens it
    (R1, False, "Four.", ("", "Four.", True)),
    # DeepSeek-V3.1: thinking only when the prompt ends with <think>.
    (V31, True, "Plan the reply.</think>Hello!", ("Plan the reply.", "Hello!", True)),
    (V31, False, "Hello! a </think> b", ("", "Hello! a </think> b", True)),
    # Qwen3: the model opens the block; enable_thinking=False pre-fills an empty one.
    (QWEN3, False, "<think>\nLet me see.\n</think>\n\nHello!",
     ("\nLet me see.\n", "\n\nHello!", True)),
    (QWEN3, False, "Hello!", ("", "Hello!", True)),
    (QWEN3, False, "<think>\n\n</think>\n\nHello!", ("\n\n", "\n\nHello!", True)),
    (QWEN3, False, "<think>\nStill thinking about <", ("\nStill thinking about <", "", False)),
    (QWEN3, False, "Use <think> tags like </think> this.",
     ("", "Use <think> tags like </think> this.", True)),
    (QWEN3, False, "  \n ", ("", "  \n ", True)),  # whitespace only
    (QWEN3, False, "<thinking>x", ("", "<thinking>x", True)),  # not the marker
    (QWEN3, True, "reason</think>\n\nanswer", ("reason", "\n\nanswer", True)),  # 2507 Thinking
    # GLM-4.5: the model writes "\n<think>" after <|assistant|>.
    (GLM, False, "\n<think>Plan.</think>\nAnswer.", ("Plan.", "\nAnswer.", True)),
    (GLM, False, "\nAnswer.", ("", "\nAnswer.", True)),
    # Kimi-K2-Thinking: always reasons; a tool-call section ends reasoning too.
    (KIMI, True, "<think>Need a tool.</think>Calling." + KIMI_CALLS,
     ("Need a tool.", "Calling." + KIMI_CALLS, True)),
    (KIMI, True, "<think>Need a tool." + KIMI_CALLS, ("Need a tool.", KIMI_CALLS, True)),
    (KIMI, True, "no start marker</think>ok", ("no start marker", "ok", True)),
    (KIMI, True, "<think>cut at <|tool_calls_sec", ("cut at <|tool_calls_sec", "", False)),
]


@pytest.mark.parametrize("cls,opened,text,expected", THINK_SAMPLES,
                         ids=[f"{s[0].name}-{i}" for i, s in enumerate(THINK_SAMPLES)])
def test_think_parsers_whole_and_streamed(cls, opened, text, expected):
    parser = cls(starts_in_reasoning=opened)
    parsed = parser.parse(text, final=True)
    assert (parsed.reasoning, parsed.content, parsed.ended) == expected
    whole = assert_stream_equals_whole((parser, None), text, seed=len(text))
    assert (whole.reasoning, whole.content) == expected[:2]


MARKERS = ("<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>",
           "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>",
           "<|return|>")


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE trained on the samples, the markers as special tokens (as the
    vocabularies have them); with 300 tokens, CJK characters and emoji span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [s[2] for s in THINK_SAMPLES] + [s[0] for s in HARMONY_SAMPLES]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(MARKERS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts * 3, trainer=trainer)
    return tokenizer


def token_deltas(tokenizer, text: str) -> list[str]:
    """The text deltas a detokenizer sends token by token (special tokens kept; a character
    split across tokens is held until it is whole, as the engine's detokenizer does)."""
    ids = tokenizer.encode(text).ids
    deltas, sent = [], ""
    for i in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:i], skip_special_tokens=False)
        if now.endswith("\ufffd"):
            continue
        assert now.startswith(sent)
        deltas.append(now[len(sent):])
        sent = now
    assert sent == text
    return deltas


@pytest.mark.parametrize("cls,opened,text,expected", THINK_SAMPLES,
                         ids=[f"{s[0].name}-{i}" for i, s in enumerate(THINK_SAMPLES)])
def test_think_parsers_at_token_boundaries(bpe, cls, opened, text, expected):
    got = run_stream((cls(starts_in_reasoning=opened), None), token_deltas(bpe, text))
    assert (got.reasoning, got.content) == expected[:2]


def test_harmony_at_token_boundaries_needs_special_tokens(bpe):
    for text, opened, expected in HARMONY_SAMPLES:
        parsers = (HarmonyReasoningParser(starts_in_reasoning=opened), HarmonyToolParser())
        got = run_stream(parsers, token_deltas(bpe, text))
        assert (got.reasoning, got.content, got.calls) == expected
    skipped = bpe.decode(bpe.encode(ANALYSIS + CALL).ids, skip_special_tokens=True)
    assert "<|channel|>" not in skipped  # why the chat API keeps special tokens for gpt-oss
    assert HarmonyToolParser().parse(skipped, final=True).calls == []


def test_partial_markers_are_held_until_they_resolve():
    parser = Qwen3ReasoningParser()
    assert parser.parse("\n<thi", final=False).reasoning == ""
    assert parser.parse("\n<thi", final=False).content == ""  # may still open a block
    assert parser.parse("<think>abc</thi", final=False).reasoning == "abc"
    assert parser.parse("<think>abc</thi", final=False).ended is False
    assert parser.parse("<think>abc</thi", final=True).reasoning == "abc</thi"
    kimi = KimiK2ReasoningParser(starts_in_reasoning=True)
    assert kimi.parse("x<|tool_calls", final=False).reasoning == "x"
    assert held_suffix_len("abc</th", ["</think>"]) == 4
    assert held_suffix_len("abc", ["</think>"]) == 0


# ---------------------------------------------------------------------------------------------
# gpt-oss harmony

ANALYSIS = '<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple.<|end|>'
FINAL = "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"location":"San Francisco"}<|call|>')
CALL_TO_FIRST = ("<|start|>assistant to=functions.get_time<|channel|>commentary json"
                 '<|message|>{"tz": "UTC"}<|call|>')
PREAMBLE = ("<|start|>assistant<|channel|>commentary<|message|>**Action plan**: 1. weather "
            "2. time<|end|>")
THOUGHT = '"What is 2 + 2?" Simple.'

#: (output text, starts_in_reasoning, (reasoning, content, calls)) through both harmony parsers
HARMONY_SAMPLES = [
    (ANALYSIS + FINAL, False, ('User asks: ' + THOUGHT, "2 + 2 = 4.", [])),
    (ANALYSIS + FINAL[:-len("<|return|>")], False,  # the stop token is not in the text
     ('User asks: ' + THOUGHT, "2 + 2 = 4.", [])),
    (ANALYSIS + CALL, False,
     ('User asks: ' + THOUGHT, "", [("get_weather", '{"location":"San Francisco"}')])),
    (ANALYSIS + CALL_TO_FIRST, False,  # `to=` before `<|channel|>`
     ('User asks: ' + THOUGHT, "", [("get_time", '{"tz": "UTC"}')])),
    (ANALYSIS + PREAMBLE + CALL + CALL_TO_FIRST, False,  # a preamble, then parallel calls
     ('User asks: ' + THOUGHT, "**Action plan**: 1. weather 2. time",
      [("get_weather", '{"location":"San Francisco"}'), ("get_time", '{"tz": "UTC"}')])),
    (ANALYSIS + "<|start|>assistant<|channel|>analysis<|message|>Second 思考.<|end|>" + FINAL,
     False, ('User asks: ' + THOUGHT + "\nSecond 思考.", "2 + 2 = 4.", [])),
    (PREAMBLE + FINAL, False, ("", "**Action plan**: 1. weather 2. time\n2 + 2 = 4.", [])),
    (FINAL[len("<|start|>assistant"):], False, ("", "2 + 2 = 4.", [])),  # no analysis at all
    # Cut by the length limit inside the analysis, inside a call's arguments.
    ("<|channel|>analysis<|message|>Thinking about <|e", False,
     ("Thinking about <|e", "", [])),
    (ANALYSIS + CALL[:-len('ancisco"}<|call|>')], False,
     ('User asks: ' + THOUGHT, "", [("get_weather", '{"location":"San Fr')])),
    # The prompt ended inside an analysis message.
    ("still thinking.<|end|>" + FINAL, True, ("still thinking.", "2 + 2 = 4.", [])),
    # Built-in tool in the analysis channel: reasoning, not a function call.
    ('<|channel|>analysis to=python<|message|>print(1)<|call|>', False, ("print(1)", "", [])),
    # Malformed: no header at all, a header broken by a terminator, bad JSON, other recipient.
    ("Hello there", False, ("", "Hello there", [])),
    ("<|channel|>final<|end|>oops", False, ("", "<|channel|>final<|end|>oops", [])),
    (ANALYSIS + '<|start|>assistant<|channel|>commentary to=functions.f<|message|>{"a": x}'
     "<|call|>", False, ('User asks: ' + THOUGHT, "", [("f", '{"a": x}')])),
    ("<|channel|>commentary to=browser.search<|message|>{}<|call|>", False,
     ("", "<|channel|>commentary to=browser.search<|message|>{}<|call|>", [])),
    ("<|channel|>final<|message|>a<|start|>assistant<|channel|>final<|message|>b", False,
     ("", "a\nb", [])),  # a message ended by the next header
]


@pytest.mark.parametrize("text,opened,expected", HARMONY_SAMPLES,
                         ids=[f"harmony-{i}" for i in range(len(HARMONY_SAMPLES))])
def test_harmony_whole_and_streamed(text, opened, expected):
    parsers = (HarmonyReasoningParser(starts_in_reasoning=opened), HarmonyToolParser())
    whole = assert_stream_equals_whole(parsers, text, seed=len(text))
    assert (whole.reasoning, whole.content, whole.calls) == expected


def test_harmony_reasoning_alone_keeps_call_markup_in_content():
    parsed = HarmonyReasoningParser().parse(ANALYSIS + CALL, final=True)
    assert parsed.reasoning == 'User asks: ' + THOUGHT and parsed.ended
    assert parsed.content == CALL  # for the tool parser, as other families leave <tool_call>
    calls = HarmonyToolParser().parse(parsed.content, final=True)
    assert calls.content == "" and calls.calls[0].name == "get_weather" and calls.calls[0].done


def test_harmony_tool_parser_alone_reads_raw_output():
    parsed = HarmonyToolParser().parse(ANALYSIS + PREAMBLE + CALL, final=True)
    assert parsed.content == "**Action plan**: 1. weather 2. time"  # analysis not shown
    assert [(c.name, c.arguments, c.done) for c in parsed.calls] == [
        ("get_weather", '{"location":"San Francisco"}', True)]
    streamed = assert_stream_equals_whole((None, HarmonyToolParser()), ANALYSIS + CALL + FINAL)
    assert streamed.content == "2 + 2 = 4."


def test_harmony_headers():
    assert _parse_header("<|channel|>commentary to=functions.f <|constrain|>json") == (
        "commentary", "functions.f")
    assert _parse_header("<|start|>assistant to=functions.f<|channel|>commentary json") == (
        "commentary", "functions.f")
    assert _parse_header("<|channel|>commentary <|constrain|>json to=functions.f") == (
        "commentary", "functions.f")
    assert _parse_header("<|start|>assistant") == (None, None)
    assert _parse_header("<|channel|>final") == ("final", None)


def test_harmony_holds_back_unfinished_headers_and_calls():
    parser = HarmonyReasoningParser()
    partial = ANALYSIS + "<|start|>assistant<|channel|>comm"
    assert parser.parse(partial, final=False).content == ""
    assert parser.parse(partial, final=False).ended is False  # may be another analysis
    assert parser.parse(partial + "entary<|message|>", final=False).ended is True
    assert parser.parse("<|channel|>analysis<|message|>hm", final=False).ended is False
    tools = HarmonyToolParser()
    running = tools.parse(CALL[:-len("<|call|>")], final=False).calls[0]
    assert (running.name, running.done) == ("get_weather", False)
    assert json.loads(running.arguments) == {"location": "San Francisco"}


# ---------------------------------------------------------------------------------------------
# A reasoning parser in front of a tool parser

def test_think_then_hermes_tool_calls():
    text = ("<think>\nThe user wants weather.\n</think>\n\nChecking.\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    parsers = (Qwen3ReasoningParser(), registry.tool_parser("hermes", []))
    whole = assert_stream_equals_whole(parsers, text)
    assert whole.reasoning == "\nThe user wants weather.\n"
    assert whole.content.strip() == "Checking."
    assert [(name, json.loads(args)) for name, args in whole.calls] == [
        ("get_weather", {"city": "Paris"})]


#: tool parser -> (reasoning parser, starts_in_reasoning, reasoning text before the calls)
FAMILY_PAIRS = {
    "hermes": ("qwen3", False, "<think>\nThe user wants it.\n</think>"),
    "qwen3_coder": ("qwen3", True, "Plan: call it.\n</think>"),
    "deepseek_v3": ("deepseek_r1", True, "Okay, 思考.\n</think>"),
    "deepseek_v31": ("deepseek_v31", True, "Need the tool.</think>"),
    "kimi_k2": ("kimi_k2", True, "<think>Need the tool.</think>"),
    "glm45": ("glm45", False, "\n<think>Need the tool.</think>"),
}
PAIRED = [case for case in CASES if case.complete]


@pytest.mark.parametrize("case", PAIRED, ids=[f"{c.parser}-{c.id}" for c in PAIRED])
def test_reasoning_then_each_familys_tool_parser(case):
    name, opened, before = FAMILY_PAIRS[case.parser]
    reasoning_parser = registry.REASONING_PARSERS[name](starts_in_reasoning=opened)
    parsers = (reasoning_parser, registry.tool_parser(case.parser, TOOLS))
    whole = run_stream(parsers, [before + case.text])
    for pieces in splits(before + case.text, random_splits=4):
        assert run_stream(parsers, pieces) == whole, pieces
    expected = before.removeprefix("\n").removeprefix("<think>").removesuffix("</think>")
    assert (whole.reasoning, whole.content, whole.calls) == (expected, case.content, case.calls)


@pytest.mark.parametrize("case", [c for c in PAIRED if c.text.startswith(
    "<|tool_calls_section_begin|>")], ids=lambda c: c.id)
def test_kimi_tool_section_ends_reasoning_without_think_end(case):
    parsers = (KimiK2ReasoningParser(starts_in_reasoning=True), registry.tool_parser("kimi_k2"))
    whole = assert_stream_equals_whole(parsers, "<think>Need it." + case.text)
    assert (whole.reasoning, whole.content, whole.calls) == ("Need it.", case.content, case.calls)


# ---------------------------------------------------------------------------------------------
# Concurrency: parsers keep no state, so streams sharing parser objects agree with the whole.

def _all_samples() -> list[tuple[tuple, str]]:
    think = [((cls(starts_in_reasoning=opened), None), text)
             for cls, opened, text, _ in THINK_SAMPLES]
    harmony = [((HarmonyReasoningParser(starts_in_reasoning=opened), HarmonyToolParser()), text)
               for text, opened, _ in HARMONY_SAMPLES]
    return think + harmony


def _random_pieces(text: str, rng: random.Random) -> list[str]:
    pieces, pos = [], 0
    while pos < len(text):
        step = rng.randint(1, 7)
        pieces.append(text[pos:pos + step])
        pos += step
    return pieces


def test_64_concurrent_asyncio_streams_match_whole():
    samples = _all_samples()

    async def one(i: int) -> tuple[Result, Result]:
        parsers, text = samples[i % len(samples)]
        stream = OutputStream(*parsers)
        for piece in _random_pieces(text, random.Random(i)):
            stream.feed(piece)
            await asyncio.sleep(0)  # let the other 63 streams interleave
        stream.finish()
        got = Result(stream.reasoning, stream.content,
                     [(c.name, c.arguments) for c in stream.tool_calls])
        return got, run_stream(parsers, [text])

    async def main() -> list[tuple[Result, Result]]:
        return await asyncio.gather(*(one(i) for i in range(64)))

    for got, whole in asyncio.run(main()):
        assert got == whole


def test_64_concurrent_threads_share_parsers():
    samples = _all_samples()

    def one(i: int) -> bool:
        parsers, text = samples[i % len(samples)]
        rng = random.Random(1000 + i)
        return all(run_stream(parsers, _random_pieces(text, rng)) == run_stream(parsers, [text])
                   for _ in range(5))

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert all(pool.map(one, range(64)))


# ---------------------------------------------------------------------------------------------
# Held-back tails

def _held_reference(text: str, markers: list[str]) -> int:
    """Brute force: the longest k with text ending in a proper prefix of length k of a marker."""
    return max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)


def test_held_suffix_len_matches_brute_force():
    rng = random.Random(7)
    markers = ["</think>", "<think>", "<|end|>", "<|call|>", "<|tool_calls_section_begin|>"]
    assert held_suffix_len("</think>", ["</think>"]) == 0  # a whole marker is not held
    assert held_suffix_len("", markers) == 0
    for _ in range(3000):
        text = "".join(rng.choice("<|/>thinkedcal x") for _ in range(rng.randint(0, 14)))
        chosen = rng.sample(markers, rng.randint(1, len(markers)))
        assert held_suffix_len(text, chosen) == _held_reference(text, chosen), (text, chosen)


def test_without_held_releases_everything_when_final():
    assert without_held("ab<|en", ("<|end|>",), final=False) == "ab"
    assert without_held("ab<|en", ("<|end|>",), final=True) == "ab<|en"
