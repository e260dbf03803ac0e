"""Sample model outputs for the tool-call parsers, each with the message it must parse into.

Every sample is written in its family's native format as the chat templates and vLLM's
parsers document it (see each parser module's docstring); the expected `content` and `calls`
are what one parse of the whole text returns, and what any streamed split must add up to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: The request's tools: types for the XML formats (Qwen3-Coder, GLM-4.5).
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "detailed": {"type": "boolean"},
            "ratio": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "filter": {"type": "object"},
            "note": {"type": ["string", "null"]},
            "code": {"type": "string"},
        }}}},
    {"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "properties": {}}}},
]


@dataclass(frozen=True)
class Case:
    """One sample output and the message it parses into.

    Attributes:
        parser: the parser's name.
        id: a short name for the test id.
        text: the model's output (after reasoning).
        content: the expected content.
        calls: the expected calls, (name, arguments text) in order.
        ids: the expected call ids where the format carries them (Kimi-K2).
        complete: every call is complete, so its arguments are a JSON object.
    """

    parser: str
    id: str
    text: str
    content: str
    calls: list[tuple[str, str]] = field(default_factory=list)
    ids: list[str] | None = None
    complete: bool = True


UNICODE_ARGS = ('{"q": "naïve café ☕ 日本語 😀",'
                ' "esc": "\\"quoted\\" \\\\ \\n \\u00e9 \\ud83d\\ude00",'
                ' "deep": {"list": [1, -2.5e-3, true, false, null, {"k": []}]}}')

HERMES = [
    Case("hermes", "single",
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
         '</tool_call>',
         "", [("get_weather", '{"city": "Paris", "days": 3}')]),
    Case("hermes", "parallel_with_content",
         'I will check both.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
         '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>',
         "I will check both.",
         [("get_weather", '{"city": "Paris"}'), ("ping", "{}")]),
    Case("hermes", "no_call",
         "The answer is 42. Models write <tool_call> tags as text too; 1 < 2 and <tool_.",
         "The answer is 42. Models write <tool_call> tags as text too; 1 < 2 and <tool_."),
    Case("hermes", "nested_unicode",
         '<tool_call>\n{"name": "get_weather", "arguments": ' + UNICODE_ARGS + '}\n</tool_call>',
         "", [("get_weather", UNICODE_ARGS)]),
    Case("hermes", "markers_in_strings",
         '<tool_call>\n{"name": "get_weather", "arguments": {"code": "print(\'</tool_call>'
         '<tool_call>\')"}}\n</tool_call>',
         "", [("get_weather", '{"code": "print(\'</tool_call><tool_call>\')"}')]),
    Case("hermes", "arguments_first",
         '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>',
         "", [("get_weather", '{"city": "Oslo"}')]),
    Case("hermes", "compact_and_spaced",
         '<tool_call>{"name":"ping","arguments":{"a":[ ]}}</tool_call>\n'
         '<tool_call>  \n {\n "name" : "ping" ,\n "arguments" : {\n  "b" : 1\n }\n}\n\n'
         '</tool_call>',
         "", [("ping", '{"a":[ ]}'), ("ping", '{\n  "b" : 1\n }')]),
    Case("hermes", "two_objects_one_block",
         '<tool_call>\n{"name": "ping", "arguments": {"n": 1}}\n{"name": "ping", "arguments": '
         '{"n": 2}}\n</tool_call>', "", [("ping", '{"n": 1}'), ("ping", '{"n": 2}')]),
    Case("hermes", "no_arguments_key",
         '<tool_call>\n{"name": "ping"}\n</tool_call>', "", [("ping", "{}")]),
    Case("hermes", "string_arguments",
         '<tool_call>\n{"name": "ping", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
         "", [("ping", '{"a": 1}')]),
    Case("hermes", "content_after",
         '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n\nLet me know.',
         "Let me know.", [("ping", "{}")]),
    Case("hermes", "missing_close_tag",
         '<tool_call>\n{"name": "ping", "arguments": {}}\nDone.', "Done.", [("ping", "{}")]),
    Case("hermes", "malformed_json",
         'Try: <tool_call>\n{"name": get_weather}\n</tool_call>',
         'Try: <tool_call>\n{"name": get_weather}\n</tool_call>'),
    Case("hermes", "extra_brace",
         '<tool_call>\n{"name": "ping", "arguments": {"a": {}}}}\n</tool_call>', "",
         [("ping", '{"a": {}}')]),
    Case("hermes", "empty_name",
         '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>',
         '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>'),
    Case("hermes", "malformed_not_json",
         "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
         "<tool_call>\nget_weather(city='Paris')\n</tool_call>"),
    Case("hermes", "broken_after_name",
         '<tool_call>\n{"name": "ping", "arguments": {"a": 1}, oops}\n</tool_call> after',
         "oops}\n</tool_call>after", [("ping", '{"a": 1}')]),
    Case("hermes", "truncated",
         'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
         "Sure.", [("get_weather", '{"city": "Par')], complete=False),
]

QWEN3_CODER = [
    Case("qwen3_coder", "single",
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
         "", [("get_weather", '{"city": "Paris", "days": 3}')]),
    Case("qwen3_coder", "parallel_with_content",
         "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
         "</function>\n</tool_call>\n<tool_call>\n<function=ping>\n</function>\n</tool_call>",
         "Checking.", [("get_weather", '{"city": "Rome"}'), ("ping", "{}")]),
    Case("qwen3_coder", "no_call",
         "Use <function=name> inside <tool_call tags; a < b.",
         "Use <function=name> inside <tool_call tags; a < b."),
    Case("qwen3_coder", "typed_values",
         "<tool_call>\n<function=get_weather>\n<parameter=days>\n7\n</parameter>\n"
         "<parameter=ratio>\n0.25\n</parameter>\n<parameter=detailed>\nTrue\n</parameter>\n"
         '<parameter=tags>\n["a", "b"]\n</parameter>\n<parameter=filter>\n{"k": {"n": 1}}\n'
         "</parameter>\n<parameter=note>\nnull\n</parameter>\n<parameter=extra>\n12\n"
         "</parameter>\n</function>\n</tool_call>",
         "", [("get_weather", '{"days": 7, "ratio": 0.25, "detailed": true, "tags": ["a", "b"], '
               '"filter": {"k": {"n": 1}}, "note": null, "extra": "12"}')]),
    Case("qwen3_coder", "markers_and_unicode_in_values",
         '<tool_call>\n<function=get_weather>\n<parameter=code>\nx = "</parameter>" '
         "# not the end\nprint('<tool_call>') ☕ 日本\n\n</parameter>\n<parameter=city>\n"
         'São "Paulo"\n</parameter>\n</function>\n</tool_call>',
         "", [("get_weather", '{"code": "x = \\"</parameter>\\" # not the end\\nprint('
               "'<tool_call>') ☕ 日本\\n\", \"city\": \"São \\\"Paulo\\\"\"}")]),
    Case("qwen3_coder", "compact",
         "<tool_call><function=get_weather><parameter=city>Oslo</parameter><parameter=days>2"
         "</parameter></function></tool_call>",
         "", [("get_weather", '{"city": "Oslo", "days": 2}')]),
    Case("qwen3_coder", "content_after",
         "<tool_call>\n<function=ping>\n</function>\n</tool_call>\nDone.",
         "Done.", [("ping", "{}")]),
    Case("qwen3_coder", "malformed",
         "<tool_call>\n<function get_weather>\n</tool_call>",
         "<tool_call>\n<function get_weather>\n</tool_call>"),
    Case("qwen3_coder", "broken_after_name",
         "<tool_call>\n<function=get_weather>\njunk\n<parameter=city>\nLima\n</parameter>\n"
         "</function>\n</tool_call>",
         "junk\n<parameter=city>\nLima\n</parameter>\n</function>\n</tool_call>",
         [("get_weather", "{}")]),
    Case("qwen3_coder", "junk_after_parameter",  # not a structural </parameter>: in the value
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\njunk\n"
         "</function>\n</tool_call>",
         "", [("get_weather", '{"city": "Lima\\n</parameter>\\njunk"}')]),
    Case("qwen3_coder", "truncated",
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
         "", [("get_weather", '{"city": "Par"}')]),
]

DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _v3(name: str, args: str) -> str:
    return f"{DS_CALL}function{DS_SEP}{name}\n```json\n{args}\n```{DS_CALL_END}"


DEEPSEEK_V3 = [
    Case("deepseek_v3", "single", DS_BEGIN + _v3("get_weather", '{"city": "Paris"}') + DS_END,
         "", [("get_weather", '{"city": "Paris"}')]),
    Case("deepseek_v3", "parallel_with_content",
         "Let me look.\n" + DS_BEGIN + _v3("get_weather", '{"city": "Paris"}') + "\n"
         + _v3("ping", "{}") + DS_END,
         "Let me look.", [("get_weather", '{"city": "Paris"}'), ("ping", "{}")]),
    Case("deepseek_v3", "no_call", "Plain answer with ``` fences and <｜ but no call.",
         "Plain answer with ``` fences and <｜ but no call."),
    Case("deepseek_v3", "nested_unicode_markers",
         DS_BEGIN + _v3("get_weather", UNICODE_ARGS[:-1] + ', "m": "```' + DS_CALL_END + '"}')
         + DS_END,
         "", [("get_weather", UNICODE_ARGS[:-1] + ', "m": "```' + DS_CALL_END + '"}')]),
    Case("deepseek_v3", "content_after", DS_BEGIN + _v3("ping", "{}") + DS_END + "\nDone.",
         "Done.", [("ping", "{}")]),
    Case("deepseek_v3", "no_fence_spaced",
         DS_BEGIN + DS_CALL + "function" + DS_SEP + "ping\n\n{ \"a\": [] }\n" + DS_CALL_END
         + "\n" + DS_END, "", [("ping", '{ "a": [] }')]),
    Case("deepseek_v3", "malformed", DS_BEGIN + "garbage" + DS_END,
         DS_BEGIN + "garbage" + DS_END),
    Case("deepseek_v3", "broken_json",
         DS_BEGIN + _v3("get_weather", '{"city": }') + DS_END,
         '}\n```' + DS_CALL_END + DS_END, [("get_weather", '{"city": ')], complete=False),
]


def _v31(name: str, args: str) -> str:
    return f"{DS_CALL}{name}{DS_SEP}{args}{DS_CALL_END}"


DEEPSEEK_V31 = [
    Case("deepseek_v31", "single", DS_BEGIN + _v31("get_weather", '{"city": "Paris"}') + DS_END,
         "", [("get_weather", '{"city": "Paris"}')]),
    Case("deepseek_v31", "parallel_with_content",
         "Both:" + DS_BEGIN + _v31("get_weather", '{"city": "Kyiv"}') + _v31("ping", "{}")
         + DS_END,
         "Both:", [("get_weather", '{"city": "Kyiv"}'), ("ping", "{}")]),
    Case("deepseek_v31", "no_call", "No tools needed: the sum is 4.",
         "No tools needed: the sum is 4."),
    Case("deepseek_v31", "nested_unicode",
         DS_BEGIN + _v31("get_weather", UNICODE_ARGS) + DS_END, "",
         [("get_weather", UNICODE_ARGS)]),
    Case("deepseek_v31", "empty_arguments", DS_BEGIN + DS_CALL + "ping" + DS_SEP + DS_CALL_END
         + DS_END, "", [("ping", "{}")]),
    Case("deepseek_v31", "spaced",
         DS_BEGIN + "\n" + DS_CALL + " ping " + DS_SEP + " \n{ }\n" + DS_CALL_END + "\n" + DS_END,
         "", [("ping", "{ }")]),
    Case("deepseek_v31", "malformed_name", DS_BEGIN + DS_CALL + "bad name{" + DS_SEP + "{}"
         + DS_CALL_END + DS_END,
         DS_BEGIN + DS_CALL + "bad name{" + DS_SEP + "{}" + DS_CALL_END + DS_END),
    Case("deepseek_v31", "truncated", "Ok" + DS_BEGIN + _v31("ping", "{}")
         + DS_CALL + "get_weather" + DS_SEP + '{"city": "Pa',
         "Ok", [("ping", "{}"), ("get_weather", '{"city": "Pa')], complete=False),
]

K_BEGIN, K_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
K_CALL, K_ARG = "<|tool_call_begin|>", "<|tool_call_argument_begin|>"
K_CALL_END = "<|tool_call_end|>"


def _kimi(call_id: str, args: str) -> str:
    return f"{K_CALL}{call_id}{K_ARG}{args}{K_CALL_END}"


KIMI_K2 = [
    Case("kimi_k2", "single", K_BEGIN + _kimi("functions.get_weather:0", '{"city": "Paris"}')
         + K_END, "", [("get_weather", '{"city": "Paris"}')], ids=["functions.get_weather:0"]),
    Case("kimi_k2", "parallel_with_content",
         "Checking both." + K_BEGIN + _kimi("functions.get_weather:0", '{"city": "Paris"}')
         + _kimi("functions.ping:1", "{}") + K_END,
         "Checking both.", [("get_weather", '{"city": "Paris"}'), ("ping", "{}")],
         ids=["functions.get_weather:0", "functions.ping:1"]),
    Case("kimi_k2", "no_call", "Just text with <|im_end|>-like bits and a | pipe.",
         "Just text with <|im_end|>-like bits and a | pipe."),
    Case("kimi_k2", "nested_unicode_spaced",
         K_BEGIN + "\n" + K_CALL + " functions.get_weather:3 \n" + K_ARG + "\n" + UNICODE_ARGS
         + "\n" + K_CALL_END + "\n" + K_END,
         "", [("get_weather", UNICODE_ARGS)], ids=["functions.get_weather:3"]),
    Case("kimi_k2", "singular_section_dotted_name",
         "<|tool_call_section_begin|>" + _kimi("functions.mcp.search:0", '{"q": "x"}')
         + "<|tool_call_section_end|>",
         "", [("mcp.search", '{"q": "x"}')], ids=["functions.mcp.search:0"]),
    Case("kimi_k2", "malformed_id", K_BEGIN + _kimi("get weather", "{}") + K_END,
         K_BEGIN + _kimi("get weather", "{}") + K_END),
    Case("kimi_k2", "content_after", K_BEGIN + _kimi("functions.ping:0", "{}") + K_END + " ok",
         "ok", [("ping", "{}")], ids=["functions.ping:0"]),
]

GLM45 = [
    Case("glm45", "single",
         "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
         "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
         "", [("get_weather", '{"city": "Paris", "days": 3}')]),
    Case("glm45", "parallel_with_content",
         "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Bern"
         "</arg_value>\n</tool_call>\n<tool_call>ping\n</tool_call>",
         "Let me check.", [("get_weather", '{"city": "Bern"}'), ("ping", "{}")]),
    Case("glm45", "no_call", "Answer: 7 <tool_call> is a tag name, and so is <arg_key>.",
         "Answer: 7 <tool_call> is a tag name, and so is <arg_key>."),
    Case("glm45", "typed_and_unicode",
         "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>12</arg_value>\n"
         '<arg_key>filter</arg_key>\n<arg_value>{"k": ["ü", 1.5]}</arg_value>\n'
         "<arg_key>detailed</arg_key>\n<arg_value>true</arg_value>\n"
         "<arg_key>other</arg_key>\n<arg_value>日本 😀</arg_value>\n</tool_call>",
         "", [("get_weather", '{"city": "12", "filter": {"k": ["ü", 1.5]}, "detailed": true, '
               '"other": "日本 😀"}')]),
    Case("glm45", "markers_in_value",
         "<tool_call>get_weather\n<arg_key>code</arg_key>\n<arg_value>a = '</arg_value>' # "
         "x\nb = \"<tool_call>\"</arg_value>\n</tool_call>",
         "", [("get_weather", '{"code": "a = \'</arg_value>\' # x\\nb = \\"<tool_call>\\""}')]),
    Case("glm45", "compact_glm47",
         "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
         "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call><tool_call>ping</tool_call>",
         "", [("get_weather", '{"city": "Oslo", "days": 2}'), ("ping", "{}")]),
    Case("glm45", "string_whitespace_kept",
         "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value> New York\n</arg_value>\n"
         "<arg_key>days</arg_key>\n<arg_value>\n 3 \n</arg_value>\n</tool_call>",
         "", [("get_weather", '{"city": " New York\\n", "days": 3}')]),
    Case("glm45", "malformed", "<tool_call>{\"name\": \"x\"}</tool_call>",
         "<tool_call>{\"name\": \"x\"}</tool_call>"),
    Case("glm45", "content_after",
         "<tool_call>ping\n</tool_call>\nAll done.", "All done.", [("ping", "{}")]),
]

CASES: list[Case] = HERMES + QWEN3_CODER + DEEPSEEK_V3 + DEEPSEEK_V31 + KIMI_K2 + GLM45
