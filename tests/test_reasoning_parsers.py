"""Reasoning parsers (think blocks, gpt-oss harmony), the harmony tool parser and the registry.

Every sample is parsed whole and streamed through `base.OutputStream` split at every character
boundary (so at every token boundary a detokenizer can produce: deltas are whole characters),
one character at a time, and at random points; all must give the same reasoning, content and
calls, also under 64 concurrent streams. Samples are written to each family's documented format
(sources in the parser modules' docstrings). No server, no model.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import random
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

from moe_engine.server.parsers.base import OutputStream, ParsedCalls, PartialCall, ToolParser
from moe_engine.server.parsers.harmony import HarmonyReasoningParser, HarmonyToolParser
from moe_engine.server.parsers.markers import held_suffix_len, without_held
from moe_engine.server.parsers.reasoning_think import (
    DeepSeekR1ReasoningParser,
    DeepSeekV31ReasoningParser,
    Glm45ReasoningParser,
    KimiK2ReasoningParser,
    Qwen3ReasoningParser,
)

TOOLS_MODULE = "moe_engine.server.parsers.tools"


class StandInHermesParser(ToolParser):
    """A minimal `<tool_call>{json}</tool_call>` reader, used only while `tools.py` (another
    part of issue 44) is not merged: a call is sent once its closing tag is seen."""

    name = "hermes"

    def parse(self, text: str, final: bool) -> ParsedCalls:
        content, calls, pos = [], [], 0
        while True:
            begin = text.find("<tool_call>", pos)
            if begin < 0:
                content.append(without_held(text[pos:], ("<tool_call>",), final))
                break
            content.append(text[pos:begin])
            end = text.find("</tool_call>", begin)
            if end < 0:
                if final:
                    content.append(text[begin:])
                break
            call = json.loads(text[begin + len("<tool_call>"):end])
            calls.append(PartialCall(call["name"], json.dumps(call["arguments"]), True))
            pos = end + len("</tool_call>")
        return ParsedCalls("".join(content), calls)


@pytest.fixture(scope="module")
def registry():
    """The registry module; with a stand-in `tools` module while the real one is absent (removed
    again afterwards, so no other test module sees it)."""
    stand_in = False
    try:
        importlib.import_module(TOOLS_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != TOOLS_MODULE:
            raise
        module = types.ModuleType(TOOLS_MODULE)
        module.TOOL_PARSERS = {"hermes": StandInHermesParser}
        sys.modules[TOOLS_MODULE] = module
        stand_in = True
    yield importlib.import_module("moe_engine.server.parsers.registry")
    if stand_in:
        sys.modules.pop(TOOLS_MODULE, None)
        sys.modules.pop("moe_engine.server.parsers.registry", None)


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

def test_think_then_hermes_tool_calls(registry):
    text = ("<think>\nThe user wants weather.\n</think>\n\nChecking.\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    parsers = (Qwen3ReasoningParser(), registry.tool_parser("hermes", []))
    whole = assert_stream_equals_whole(parsers, text)
    assert whole.reasoning == "\nThe user wants weather.\n"
    assert whole.content.strip() == "Checking."
    assert [(name, json.loads(args)) for name, args in whole.calls] == [
        ("get_weather", {"city": "Paris"})]


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
# Registry

PROMPTS = [  # (parser name, rendered prompt tail, output starts inside reasoning)
    ("deepseek_r1", "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>\n", True),
    ("deepseek_r1", "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>", True),  # old template
    ("deepseek_v31", "<｜User｜>hi<｜Assistant｜><think>", True),
    ("deepseek_v31", "<｜User｜>hi<｜Assistant｜></think>", False),
    ("deepseek_v31", "<｜User｜>a<｜Assistant｜></think>b<｜end▁of▁sentence｜><｜User｜>c"
     "<｜Assistant｜><think>", True),
    ("qwen3", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", False),
    ("qwen3", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
     False),
    ("qwen3", "<|im_start|>assistant\n<think>\nold\n</think>\n\nx<|im_end|>\n<|im_start|>user\n"
     "q<|im_end|>\n<|im_start|>assistant\n<think>\n", True),
    ("qwen3", "<|im_start|>assistant\n<think>\nA continued thought", True),
    ("qwen3", "Explain the <think> tag", False),  # no assistant turn: only the end counts
    ("glm45", "[gMASK]<sop><|user|>\nhi<|assistant|>", False),
    ("glm45", "[gMASK]<sop><|user|>\nhi/nothink<|assistant|>\n<think></think>", False),
    ("kimi_k2", "<|im_assistant|>assistant<|im_middle|><think></think>Hi<|im_end|><|im_user|>"
     "user<|im_middle|>q<|im_end|><|im_assistant|>assistant<|im_middle|>", True),
    ("openai_gptoss", "<|start|>user<|message|>hi<|end|><|start|>assistant", False),
    ("openai_gptoss", "<|start|>assistant<|channel|>analysis<|message|>Let me", True),
    ("openai_gptoss", "<|start|>assistant<|channel|>final<|message|>Sure", False),
]


@pytest.mark.parametrize("name,prompt,expected", PROMPTS)
def test_starts_in_reasoning_from_the_prompt_tail(registry, name, prompt, expected):
    assert registry.starts_in_reasoning(prompt, name) is expected
    assert registry.reasoning_parser(name, prompt).starts_in_reasoning is expected


QWEN3_TEMPLATE = """{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}...
For each function call, return a json object within <tool_call></tool_call> XML tags:
<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>
{%- endif %}{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content }}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"""
QWEN3_CODER_TEMPLATE = """{{- '<|im_start|>system\\n' }}<tool_call>
<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>
</function>\\n</tool_call>{{- '<|im_start|>assistant\\n' }}"""
GLM45_TEMPLATE = """[gMASK]<sop>{%- if tools -%}<|system|>\\n# Tools
<tool_call>{function-name}\\n<arg_key>{arg-key-1}</arg_key>\\n<arg_value>{v}</arg_value>
</tool_call>{%- endif -%}<|assistant|>{{ '\\n<think></think>' }}"""
DEEPSEEK_V3_TEMPLATE = """{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' +
tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' +
tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"""
DEEPSEEK_R1_TEMPLATE = DEEPSEEK_V3_TEMPLATE + """{% if '</think>' in content %}{% endif %}
{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"""
DEEPSEEK_V31_TEMPLATE = """{%- if not thinking is defined -%}{%- set thinking = false -%}
{%- endif -%}{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] +
'<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}
{%- if add_generation_prompt -%}{{'<｜Assistant｜>'}}{%- if not thinking -%}{{'</think>'}}
{%- else -%}{{'<think>'}}{%- endif -%}{%- endif %}"""
KIMI_K2_TEMPLATE = """<|im_assistant|>{{role_name}}<|im_middle|><|tool_calls_section_begin|>
<|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>{{ args }}<|tool_call_end|>
<|tool_calls_section_end|>"""
KIMI_K2_THINKING_TEMPLATE = KIMI_K2_TEMPLATE + "<think>{{rc}}</think>{{render_content(m)}}"
GPT_OSS_TEMPLATE = """{{- "<|start|>assistant<|channel|>commentary to=functions." + name +
" <|constrain|>json<|message|>" + args + "<|call|>" }}{%- if add_generation_prompt -%}
<|start|>assistant{%- endif -%}"""

TEMPLATES = [  # (architecture, template, (tool parser, reasoning parser))
    ("Qwen3MoeForCausalLM", QWEN3_TEMPLATE, ("hermes", "qwen3")),
    ("Qwen3MoeForCausalLM", QWEN3_CODER_TEMPLATE, ("qwen3_coder", "qwen3")),
    ("Glm4MoeForCausalLM", GLM45_TEMPLATE, ("glm45", "glm45")),
    ("DeepseekV3ForCausalLM", DEEPSEEK_V3_TEMPLATE, ("deepseek_v3", None)),
    ("DeepseekV3ForCausalLM", DEEPSEEK_R1_TEMPLATE, ("deepseek_v3", "deepseek_r1")),
    ("DeepseekV3ForCausalLM", DEEPSEEK_V31_TEMPLATE, ("deepseek_v31", "deepseek_v31")),
    ("DeepseekV3ForCausalLM", KIMI_K2_TEMPLATE, ("kimi_k2", None)),
    ("DeepseekV3ForCausalLM", KIMI_K2_THINKING_TEMPLATE, ("kimi_k2", "kimi_k2")),
    ("GptOssForCausalLM", GPT_OSS_TEMPLATE, ("openai", "openai_gptoss")),
    ("SomeNewForCausalLM", GPT_OSS_TEMPLATE, ("openai", "openai_gptoss")),  # template wins
    ("Glm4MoeForCausalLM", None, ("glm45", "glm45")),  # no template: the architecture
    ("GptOssForCausalLM", "{{ messages }}", ("openai", "openai_gptoss")),
    ("MixtralForCausalLM", "{{ messages }}", (None, None)),
]


@pytest.mark.parametrize("architecture,template,expected", TEMPLATES)
def test_default_parsers_from_the_checkpoint(registry, architecture, template, expected):
    assert registry.default_parsers(architecture, template) == expected


def test_every_default_names_a_registered_reasoning_parser(registry):
    for _, reasoning in registry.ARCHITECTURE_DEFAULTS.values():
        assert reasoning is None or reasoning in registry.REASONING_PARSERS
    assert set(registry.REASONING_PARSERS) == {
        "deepseek_r1", "deepseek_v31", "qwen3", "glm45", "kimi_k2", "openai_gptoss"}
    assert isinstance(registry.tool_parser("openai"), HarmonyToolParser)


def test_unknown_names_are_refused_with_the_valid_ones(registry):
    with pytest.raises(ValueError, match=r"--tool-call-parser: unknown name 'x'; choose from "
                                         r".*hermes.*openai"):
        registry.tool_parser("x", [])
    with pytest.raises(ValueError, match=r"--reasoning-parser: unknown name 'r2'; choose from "
                                         r"deepseek_r1, deepseek_v31, glm45, kimi_k2, "
                                         r"openai_gptoss, qwen3$"):
        registry.reasoning_parser("r2", "")
    with pytest.raises(ValueError, match="--reasoning-parser"):
        registry.starts_in_reasoning("", "nope")


def test_special_tokens_needed_only_by_harmony(registry):
    assert registry.needs_special_tokens("openai_gptoss", None)
    assert registry.needs_special_tokens(None, "openai")
    assert not registry.needs_special_tokens("qwen3", "hermes")
    assert not registry.needs_special_tokens(None, None)


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
