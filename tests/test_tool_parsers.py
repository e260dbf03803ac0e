"""The tool-call parsers: whole-text parses, and the same result streamed through
`base.OutputStream` however the text is split (every character boundary, every two-piece
split, random splits, random UTF-8 byte boundaries, the token boundaries of a byte-level BPE
whose tokens split multi-byte characters), in OpenAI's delta order, under 64 concurrent streams
(asyncio tasks and threads) sharing one parser instance per format. Random marker soups check
that no text makes a parser raise or take back what it streamed.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import random
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from tool_parser_cases import CASES, TOOLS, Case

from moe_engine.server.parsers.base import DeltaMessage, OutputStream, ToolParser
from moe_engine.server.parsers.tools import TOOL_PARSERS

IDS = [f"{case.parser}-{case.id}" for case in CASES]


def parser_for(case: Case) -> ToolParser:
    return TOOL_PARSERS[case.parser](TOOLS)


def random_pieces(text: str, rng: random.Random, most: int = 8) -> list[str]:
    pieces, pos = [], 0
    while pos < len(text):
        size = rng.randint(1, most)
        pieces.append(text[pos:pos + size])
        pos += size
    return pieces


def byte_pieces(text: str, rng: random.Random) -> list[str]:
    """Split the UTF-8 bytes anywhere; decode incrementally as a detokenizer does (a piece
    that ends inside a character waits for the rest)."""
    data = text.encode()
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, len(data) // 3)))
    decoder = codecs.getincrementaldecoder("utf-8")()
    bounds = [0, *cuts, len(data)]
    return [decoder.decode(data[a:b], final=b == len(data))
            for a, b in zip(bounds, bounds[1:], strict=False)]


def run_stream(parser: ToolParser, pieces: list[str]) -> tuple[OutputStream, list[DeltaMessage]]:
    stream = OutputStream(None, parser)
    deltas = [stream.feed(piece) for piece in pieces]
    deltas.append(stream.finish())
    return stream, deltas


def check_stream(case: Case, stream: OutputStream, deltas: list[DeltaMessage]) -> None:
    """The deltas add up to the expected message, in OpenAI's order."""
    assert "".join(d.content for d in deltas) == case.content == stream.content
    streamed: list[str] = []
    ids: list[str] = []
    for delta in deltas:
        for piece in delta.tool_calls:
            wire = piece.to_openai()
            if piece.index == len(streamed):  # a call's first delta: id, type and name
                assert piece.id and piece.name, wire
                assert wire["type"] == "function" and wire["function"]["name"] == piece.name
                ids.append(piece.id)
                streamed.append(piece.arguments)
            else:  # later deltas: argument fragments of a call already opened
                assert piece.index < len(streamed), wire
                assert piece.id is None and piece.name is None and piece.arguments, wire
                assert set(wire) == {"index", "function"}
                streamed[piece.index] += piece.arguments
    calls = [(call.name, call.arguments) for call in stream.tool_calls]
    assert calls == case.calls
    assert streamed == [arguments for _, arguments in case.calls]
    assert ids == [call.id for call in stream.tool_calls]
    if case.ids is not None:
        assert ids == case.ids
    else:
        assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids)
    if case.complete:
        assert all(isinstance(json.loads(arguments), dict) for _, arguments in calls)


def test_registry_names() -> None:
    assert sorted(TOOL_PARSERS) == sorted(
        ["hermes", "qwen3_coder", "deepseek_v3", "deepseek_v31", "kimi_k2", "glm45"])
    assert all(cls.name == name for name, cls in TOOL_PARSERS.items())
    assert {case.parser for case in CASES} == set(TOOL_PARSERS)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_whole_text(case: Case) -> None:
    parsed = parser_for(case).parse(case.text, final=True)
    assert parsed.content == case.content
    assert [(c.name, c.arguments) for c in parsed.calls] == case.calls
    assert all(c.done for c in parsed.calls)
    if case.ids is not None:
        assert [c.id for c in parsed.calls] == case.ids


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_streamed_every_character(case: Case) -> None:
    check_stream(case, *run_stream(parser_for(case), list(case.text)))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_streamed_every_two_piece_split(case: Case) -> None:
    parser = parser_for(case)
    for cut in range(1, len(case.text)):
        check_stream(case, *run_stream(parser, [case.text[:cut], case.text[cut:]]))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_streamed_random_splits(case: Case) -> None:
    parser = parser_for(case)
    rng = random.Random(f"{case.parser}-{case.id}")
    for _ in range(20):
        check_stream(case, *run_stream(parser, random_pieces(case.text, rng)))
    for _ in range(20):
        pieces = byte_pieces(case.text, rng)
        assert "".join(pieces) == case.text
        check_stream(case, *run_stream(parser, pieces))


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE trained on the samples, the formats' markers as special tokens (as
    in the real vocabularies); with 400 tokens most CJK and emoji characters span tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    markers = sorted({m for case in CASES for m in _markers(case.text)})
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=markers, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([case.text for case in CASES] * 3, trainer=trainer)
    return tokenizer, set(markers)


def _markers(text: str) -> list[str]:
    known = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
             "</arg_value>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
             "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
             "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
             "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
    return [m for m in known if m in text]


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: token character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_streamed_token_boundaries(case: Case, bpe) -> None:
    tokenizer, specials = bpe
    to_byte = _byte_decoder()
    decoder = codecs.getincrementaldecoder("utf-8")()
    pieces = []
    for token in tokenizer.encode(case.text).tokens:
        data = token.encode() if token in specials else bytes(to_byte[c] for c in token)
        pieces.append(decoder.decode(data))
    pieces.append(decoder.decode(b"", final=True))
    assert "".join(pieces) == case.text
    check_stream(case, *run_stream(parser_for(case), pieces))


def _three_cases(i: int) -> list[Case]:
    return [CASES[(i * 3 + k) % len(CASES)] for k in range(3)]


def test_64_concurrent_asyncio_streams() -> None:
    shared = {name: cls(TOOLS) for name, cls in TOOL_PARSERS.items()}

    async def one(i: int) -> list[tuple[Case, OutputStream, list[DeltaMessage]]]:
        rng, done = random.Random(i), []
        for case in _three_cases(i):
            stream = OutputStream(None, shared[case.parser])
            deltas = []
            for piece in random_pieces(case.text, rng, most=4):
                deltas.append(stream.feed(piece))
                await asyncio.sleep(0)  # let the other 63 streams run between deltas
            deltas.append(stream.finish())
            done.append((case, stream, deltas))
        return done

    async def main() -> list[list[tuple[Case, OutputStream, list[DeltaMessage]]]]:
        return await asyncio.gather(*(one(i) for i in range(64)))

    results = asyncio.run(main())
    assert len(results) == 64
    for streams in results:
        for case, stream, deltas in streams:
            check_stream(case, stream, deltas)


def test_64_concurrent_thread_streams() -> None:
    shared = {name: cls(TOOLS) for name, cls in TOOL_PARSERS.items()}

    def one(i: int) -> list[tuple[Case, OutputStream, list[DeltaMessage]]]:
        rng, done = random.Random(1000 + i), []
        for case in _three_cases(i):
            done.append((case, *run_stream(shared[case.parser],
                                           random_pieces(case.text, rng, most=4))))
        return done

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    try:
        with ThreadPoolExecutor(max_workers=64) as pool:
            results = list(pool.map(one, range(64)))
    finally:
        sys.setswitchinterval(interval)
    for streams in results:
        for case, stream, deltas in streams:
            check_stream(case, stream, deltas)


FRAGMENTS = {
    "hermes": ["<tool_call>", "</tool_call>", '{"name": "ping"', '"arguments": ', "{", "}",
               '"a"', ": ", "1", ", ", '"x\\"<tool_call>"', "[", "]", "\n", " ", "text", "<",
               "tool_"],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=get_weather>", "<function=",
                    "</function>", "<parameter=days>", "<parameter=city>", "</parameter>",
                    "<parameter=note>", "\n<parameter=",
                    "3", "x<y", "\n", " ", "text", "<", "null"],
    "deepseek_v3": ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                    "<｜tool▁call▁end｜>", "function<｜tool▁sep｜>ping", "\n```json\n", "\n```",
                    "`",
                    "{", "}", '"a": 1', "\n", "text", "<｜", "```"],
    "deepseek_v31": ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                     "<｜tool▁call▁end｜>", "ping<｜tool▁sep｜>", "<｜tool▁sep｜>", "{", "}",
                     '"a": [1', "]", "\n", "text", "<｜"],
    "kimi_k2": ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                "<|tool_call_begin|>", "<|tool_call_end|>", "functions.ping:0",
                "<|tool_call_argument_begin|>", "{", "}", '"a": "b"', " ", "\n", "text", "<|"],
    "glm45": ["<tool_call>", "</tool_call>", "ping", "get_weather", "<arg_key>", "</arg_key>",
              "<arg_value>", "</arg_value>", "days", "city", "3", "\n", " ", "text", "<", "{"],
}


# Pieces that once broke a parser in a longer run (a literal's start such as "f" of
# "function" read as JSON, escapes cut short, empty names).
FRAGMENTS["hermes"] += ['"name"', '"arguments"', '"', ":", ",", "\\", "u00e9", "}}",
                       '{"name": ""', "tr", "nul"]
FRAGMENTS["qwen3_coder"] += ["<parameter=code>", "</parameter>\n", ">", "</tool_call>"]
FRAGMENTS["deepseek_v3"] += ["```json", "function", "<｜tool▁sep｜>", "get_weather\n", "f", "tru"]
FRAGMENTS["deepseek_v31"] += ["get_weather", '"', ":", ",", "\\u0", "nu"]
FRAGMENTS["kimi_k2"] += ["functions.", "get_weather", ":1", "<|tool_call_section_begin|>",
                        "<|tool_call_section_end|>", '"', "fa"]
FRAGMENTS["glm45"] += ["<arg_key>code</arg_key>", "null", '"x"']


@pytest.mark.parametrize("name", sorted(FRAGMENTS))
def test_random_marker_soup_streams_like_whole(name: str) -> None:
    """Random mixes of markers and fragments: the final parse never raises, keeps every
    character of text outside calls, and streaming (per character and random pieces) adds up
    to it without taking anything back (OutputStream raises if a parser does)."""
    parser = TOOL_PARSERS[name](TOOLS)
    rng = random.Random(name)
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS[name]) for _ in range(rng.randint(1, 24)))
        whole = parser.parse(text, final=True)
        expected = Case(name, "soup", text, whole.content,
                        [(c.name or "", c.arguments) for c in whole.calls], complete=False,
                        ids=[c.id for c in whole.calls] if name == "kimi_k2" else None)
        if not whole.calls:
            assert whole.content == text
        for pieces in (list(text), random_pieces(text, rng)):
            check_stream(expected, *run_stream(parser, pieces))


@pytest.mark.parametrize("name, head, tail", [
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=code>\n",
     "\n</parameter>\n</function>\n</tool_call>"),
    ("glm45", "<tool_call>get_weather\n<arg_key>code</arg_key>\n<arg_value>",
     "</arg_value>\n</tool_call>"),
])
def test_text_values_stream_while_written(name: str, head: str, tail: str) -> None:
    """A long string parameter (a file the model writes) streams as it is written, not when
    it closes (vLLM issue 32829); the fragments still add up to the final JSON."""
    code = 'def f(x):\n    return "</parameter> </arg_value>"  # ☕\n' * 20
    stream = OutputStream(None, TOOL_PARSERS[name](TOOLS))
    sent = ""
    for piece in random_pieces(head + code[:len(code) // 2], random.Random(0), most=4):
        sent += "".join(d.arguments for d in stream.feed(piece).tool_calls)
    half = json.dumps(code[:len(code) // 2], ensure_ascii=False)[1:-1]
    assert sent.startswith('{"code": "') and len(sent) > len(half) // 2, sent
    for piece in random_pieces(code[len(code) // 2:] + tail, random.Random(1), most=4):
        sent += "".join(d.arguments for d in stream.feed(piece).tool_calls)
    sent += "".join(d.arguments for d in stream.finish().tool_calls)
    assert json.loads(sent) == {"code": code} and stream.tool_calls[0].arguments == sent


JSON_TOKENS = ['{', '}', '[', ']', ':', ',', ' ', '\n', '"a"', '"', 'b', '\\', '\\"', '\\u00e9',
               'u12', '\\n', '\x01', 'é', '0', '12', '-', '.', '5', 'e', '+', 'true', 'tr', 'fals',
               'null', 'nu', 'x']


def test_json_prefix_scanner_against_json_loads() -> None:
    """`scan_value` agrees with `json.loads` on whole texts, its COMPLETE spans load, and its
    valid-prefix end never moves back as the text grows (what keeps streamed arguments from
    being taken back)."""
    from moe_engine.server.parsers.tool_text import Scan, scan_value

    rng = random.Random(7)
    samples = [json.dumps(v, ensure_ascii=rng.random() < 0.5) for v in
               ({"a": [1, -2.5e-3, True, None, {"b": "é\n\"x\""}]}, [], {}, "s", 0, [[[]]])]
    samples += ["".join(rng.choice(JSON_TOKENS) for _ in range(rng.randint(1, 14)))
                for _ in range(3000)]
    for text in samples:
        state, end = scan_value(text + " ", 0)  # a number at the very end may still grow
        try:
            json.loads(text)
            loads = True
        except ValueError:
            loads = False
        whole = state == Scan.COMPLETE and not text[end:].strip(" \t\n\r")
        assert whole == loads, (text, state, end)
        if state == Scan.COMPLETE:
            json.loads(text[:end])
        reach = 0
        for k in range(len(text) + 1):
            state_k, end_k = scan_value(text[:k], 0)
            valid_end = len(text[:k]) if state_k == Scan.PARTIAL else end_k
            assert valid_end >= reach, (text, k)
            reach = valid_end
