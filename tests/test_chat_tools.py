"""The chat pipeline's pieces without a server: tool_choice plans and their schemas, the
JSON-form parsers of `required` and named choices (streamed at every split == whole), the
message rendering's checks, the chat flags (unknown parser names refused before anything
loads, --chat-template as a path or inline) and the parser defaults per test template."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from chat_fixtures import chat_template, family_checkpoint

from moe_engine.cli.serve import main as serve_main
from moe_engine.server.http.chat_output import ChoiceParse, delta_json, merge
from moe_engine.server.http.chat_render import load_chat_template, template_kwargs
from moe_engine.server.http.chat_setup import chat_settings
from moe_engine.server.http.chat_tools import (
    NamedCallParser,
    RequiredCallsParser,
    plan_tools,
    required_schema,
)
from moe_engine.server.http.errors import OpenAIError
from moe_engine.server.http.protocol import ChatCompletionRequest, ChatMessage
from moe_engine.server.options import ServerOptions
from moe_engine.server.parsers.base import DeltaMessage, OutputStream, ToolCallDelta

TOOLS = [
    {"type": "function", "function": {"name": "a", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
    {"type": "function", "function": {"name": "b"}},
]
REQUIRED_TEXTS = [
    '[{"name":"a","parameters":{"x":12}},{"name":"b","parameters":{"s":"}]\\"{,"}}]',
    '[ {"name": "b", "parameters": {"k": [1, {"z": null}]}} ]',
    '[{"parameters":{"x":1},"name":"a"}]',  # parameters first: named once the name is read
]


@pytest.fixture(scope="module")
def all_ckpt(qwen3_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with every family's markers in its tokenizer."""
    return family_checkpoint(qwen3_ckpt, tmp_path_factory.mktemp("chat-all"), "all")


def _body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


@pytest.mark.parametrize("text", REQUIRED_TEXTS)
def test_required_parser_streams_at_every_split_as_whole(text) -> None:
    whole = OutputStream(None, RequiredCallsParser())
    whole.feed(text)
    whole.finish()
    expected = [(c.name, json.loads(c.arguments)) for c in whole.tool_calls]
    assert expected == [(c["name"], c["parameters"]) for c in json.loads(text)]
    for cut in range(len(text) + 1):
        s = OutputStream(None, RequiredCallsParser())
        s.feed(text[:cut])
        s.feed(text[cut:])
        s.finish()
        assert [(c.name, c.arguments) for c in s.tool_calls] == [
            (c.name, c.arguments) for c in whole.tool_calls]
    chars = OutputStream(None, RequiredCallsParser())
    for ch in text:
        chars.feed(ch)
    chars.finish()
    assert [(c.name, c.arguments) for c in chars.tool_calls] == [
        (c.name, c.arguments) for c in whole.tool_calls]


def test_required_parser_cut_output_is_content_and_named_is_the_arguments() -> None:
    cut = OutputStream(None, RequiredCallsParser())
    cut.feed('[{"name":')
    cut.finish()
    assert (cut.content, cut.tool_calls) == ('[{"name":', [])
    named = OutputStream(None, NamedCallParser("a"))
    first = named.feed('{"x"')
    assert [(d.index, d.name, d.arguments) for d in first.tool_calls] == [(0, "a", '{"x"')]
    named.feed(":3}")
    named.finish()
    assert [(c.name, c.arguments) for c in named.tool_calls] == [("a", '{"x":3}')]


def test_required_schema_accepts_calls_and_refuses_others() -> None:
    body = _body(tools=TOOLS, tool_choice="required")
    for parallel, ok_many in ((True, True), (False, False)):
        schema = required_schema(body.tools, parallel)
        jsonschema.validate([{"name": "a", "parameters": {"x": 1}}], schema)
        many = [{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]
        if ok_many:
            jsonschema.validate(many, schema)
        else:
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(many, schema)
        for bad in ([], [{"name": "c", "parameters": {}}], [{"name": "a", "parameters": {}}]):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(bad, schema)


def test_plans() -> None:
    assert plan_tools(_body(), "hermes", True).mode == "none"
    assert plan_tools(_body(tools=TOOLS, tool_choice="none"), None, False).mode == "none"
    auto = plan_tools(_body(tools=TOOLS), "hermes", True)
    assert auto.mode == "auto" and auto.structured is None and auto.keep_special_tokens
    assert auto.make_parser().name == "hermes"
    named = plan_tools(_body(tools=TOOLS, tool_choice={"type": "function",
                                                       "function": {"name": "b"}}), None, False)
    assert json.loads(named.structured.json) == {  # no parameters: any object
        "type": "object", "properties": {}}
    with pytest.raises(OpenAIError, match="requires --enable-auto-tool-choice, which") as err:
        plan_tools(_body(tools=TOOLS), "hermes", False)
    assert "--tool-call-parser" not in err.value.message  # the parser is there: only the flag
    with pytest.raises(OpenAIError, match="requires a tool parser") as err:
        plan_tools(_body(tools=TOOLS, tool_choice="auto"), None, True)
    assert "--enable-auto-tool-choice" not in err.value.message  # the flag is there
    with pytest.raises(OpenAIError, match="--enable-auto-tool-choice and --tool-call-parser"):
        plan_tools(_body(tools=TOOLS, tool_choice="auto"), None, False)


def test_template_kwargs_checks() -> None:
    user = [ChatMessage(role="user", content="x")]
    assistant = [*user, ChatMessage(role="assistant", content="y")]
    assert template_kwargs(False, True, {"enable_thinking": False}, assistant) == {
        "enable_thinking": False, "add_generation_prompt": False,
        "continue_final_message": True}
    with pytest.raises(OpenAIError, match="add_generation_prompt"):
        template_kwargs(True, True, None, assistant)
    with pytest.raises(OpenAIError, match="the assistant's"):
        template_kwargs(False, True, None, user)
    with pytest.raises(OpenAIError) as err:
        template_kwargs(True, False, {"tools": []}, user)
    assert err.value.param == "chat_template_kwargs.tools"


def test_deltas_split_a_first_call_piece_and_merge() -> None:
    delta = DeltaMessage("", "", [ToolCallDelta(0, "call_1", "a", '{"x"'),
                                  ToolCallDelta(1, "call_2", "b", "")])
    assert delta_json(delta)["tool_calls"] == [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "a",
                                                                      "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"x"'}},
        {"index": 1, "id": "call_2", "type": "function", "function": {"name": "b",
                                                                      "arguments": ""}}]
    joined = merge(DeltaMessage("a", "r", [ToolCallDelta(0, "c", "n", "{")]),
                   DeltaMessage("b", "s", [ToolCallDelta(0, None, None, "}")]))
    assert (joined.content, joined.reasoning_content) == ("ab", "rs")
    assert [(d.id, d.arguments) for d in joined.tool_calls] == [("c", "{}")]
    assert ChoiceParse(None, None).finish_reason("length") == "length"


def test_unknown_parser_names_and_template_files(tmp_path: Path, capsys) -> None:
    with pytest.raises(ValueError, match="--tool-call-parser: unknown parser 'nope'.*hermes"):
        ServerOptions(tool_call_parser="nope")
    with pytest.raises(ValueError, match="--reasoning-parser: unknown parser 'x'.*qwen3"):
        ServerOptions(reasoning_parser="x")
    assert serve_main(["--reasoning-parser", "bogus", "--port", "0"]) == 1
    assert "--reasoning-parser: unknown parser 'bogus'" in capsys.readouterr().err
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert load_chat_template(str(path)) == "{{ messages[0].content }}"
    assert load_chat_template("{{ 1 }}") == "{{ 1 }}"
    with pytest.raises(ValueError, match="--chat-template: cannot read"):
        ServerOptions(chat_template=str(tmp_path / "missing.jinja"))


def test_settings_defaults_none_and_special_markers(all_ckpt) -> None:
    from transformers import AutoTokenizer

    ckpt = all_ckpt
    tok = AutoTokenizer.from_pretrained(ckpt)
    kwargs = dict(chat_template=None, tool_call_parser=None, reasoning_parser=None,
                  enable_auto_tool_choice=False, tokenizer=tok, model_dir=str(ckpt))
    s = chat_settings(**kwargs)  # the tokenizer's (Qwen3) template
    assert (s.chat_template, s.tool_parser, s.reasoning_parser) == (None, "hermes", "qwen3")
    assert s.reasoning_keeps_special_tokens  # <think> is special in this tokenizer
    off = chat_settings(**{**kwargs, "tool_call_parser": "none", "reasoning_parser": "none"})
    assert (off.tool_parser, off.reasoning_parser) == (None, None)
    glm = chat_settings(**{**kwargs, "chat_template": chat_template("glm45")})
    assert (glm.tool_parser, glm.reasoning_parser) == ("glm45", "glm45")
    assert glm.chat_template == chat_template("glm45")


#: family -> what its template writes for the history's call and its result
HISTORY_MARKS = {
    "qwen3": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
              "</tool_call>", "<tool_response>\nsunny\n</tool_response>"],
    "qwen3_coder": ["<function=get_weather>\n<parameter=city>\nParis\n</parameter>",
                    "<tool_response>\nsunny\n</tool_response>"],
    "deepseek_v3": ['<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                    '{"city": "Paris"}\n```<｜tool▁call▁end｜>',
                    "<｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>"],
    "deepseek_v31": ['<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
                     "<｜tool▁call▁end｜>", "<｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>"],
    "kimi_k2": ['<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                '{"city": "Paris"}<|tool_call_end|>',
                "## Return of functions.get_weather:0\nsunny"],
    "glm45": ["<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>",
              "<|observation|>\n<tool_response>\nsunny\n</tool_response>"],
    "gpt_oss": ['<|start|>assistant to=functions.get_weather<|channel|>commentary json'
                '<|message|>{"city": "Paris"}<|call|>',
                "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
                "sunny<|end|>"],
}


@pytest.mark.parametrize("family", sorted(HISTORY_MARKS))
def test_family_templates_render_calls_results_and_tools(family, all_ckpt) -> None:
    from transformers import AutoTokenizer

    from moe_engine.server.http.chat_render import render_text

    tok = AutoTokenizer.from_pretrained(all_ckpt)
    body = _body(tools=[{"type": "function", "function": {
        "name": "get_weather", "description": "Weather now.", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}])
    messages = [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Weather in Paris?"),
        ChatMessage(role="assistant", content=None, tool_calls=[{
            "id": "functions.get_weather:0", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]),
        ChatMessage(role="tool", tool_call_id="functions.get_weather:0", content="sunny"),
    ]
    text = render_text(tok, chat_template(family), messages, body.tools)
    for mark in HISTORY_MARKS[family]:
        assert mark in text, (family, mark, text)
    assert "Be brief." in text and "Weather in Paris?" in text and "Weather now." in text
    assert "Weather now." not in render_text(tok, chat_template(family), messages)


def test_reasoning_token_count_is_exact(all_ckpt) -> None:
    from transformers import AutoTokenizer

    from moe_engine.server.http.chat_output import count_reasoning_tokens
    from moe_engine.server.parsers import registry

    tok = AutoTokenizer.from_pretrained(all_ckpt)

    def count(text: str, prompt: str = "", name: str = "qwen3") -> int:
        ids = tok.encode(text, add_special_tokens=False)
        return count_reasoning_tokens(
            ids, lambda i: tok.decode(i, skip_special_tokens=False),
            lambda: registry.reasoning_parser(name, prompt))

    def n(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    thought = "<think>\nLet me see: 2 + 2 is four, naïvely ☕.\n</think>"
    assert count(thought + "\n\nIt is 4.") == n(thought)
    assert count(thought) == n(thought)
    assert count("<think>\nnever ends") == n("<think>\nnever ends")
    # DeepSeek-R1's prompt opened the block: the output starts inside it
    assert count("ab cd</think>answer", "<｜Assistant｜><think>\n", "deepseek_r1") == n(
        "ab cd</think>")


def _tool(name: str, parameters: dict | None = None) -> dict:
    function: dict = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def _refusal(param: str, *words: str, **fields) -> None:
    with pytest.raises(OpenAIError) as err:
        plan_tools(_body(**fields), "hermes", True)
    assert err.value.status == 400 and err.value.param == param, err.value.message
    for word in words:
        assert word in err.value.message, err.value.message


BIG_TOOLS = [_tool(f"tool_{i:03d}", {"type": "object", "properties": {
    f"field_{j}": {"type": "string", "description": "d" * 20} for j in range(8)}})
    for i in range(200)]


@pytest.mark.parametrize("choice", ["required", "auto", "none"])
def test_too_large_tool_choice_schemas_name_tools(choice) -> None:
    """200 tools: `required`'s combined schema is over the limit -> 400 naming `tools` (size,
    limit, what to do), not a 500 naming response_format; `auto`/`none` constrain nothing."""
    body = {"tools": BIG_TOOLS, "tool_choice": choice}
    if choice != "required":
        assert plan_tools(_body(**body), "hermes", True).structured is None
        return
    _refusal("tools", "characters, at most 65536", "fewer tools (this request has 200)",
             "name the one to call", **body)
    huge = _tool("big", {"type": "object", "properties": {
        f"p{i}": {"type": "string", "description": "x" * 100} for i in range(700)}})
    _refusal("tools[1].function.parameters", "at most 65536", tools=[TOOLS[0], huge],
             tool_choice={"type": "function", "function": {"name": "big"}})


DEFS_A = {"$defs": {"Addr": {"type": "object", "properties": {"city": {"type": "string"}},
                             "required": ["city"]}},
          "type": "object", "properties": {"addr": {"$ref": "#/$defs/Addr"}},
          "required": ["addr"]}
DEFS_B = {"definitions": {"Hour": {"type": "integer", "minimum": 0, "maximum": 23}},
          "type": "object", "properties": {"h": {"$ref": "#/definitions/Hour"}},
          "required": ["h"]}


def test_required_hoists_defs_so_refs_resolve() -> None:
    tools = [_tool("ship", DEFS_A), _tool("alarm", DEFS_B), _tool("ship2", DEFS_A)]
    plan = plan_tools(_body(tools=tools, tool_choice="required"), None, False)
    schema = json.loads(plan.structured.json)
    assert set(schema["$defs"]) == {"Addr"} and set(schema["definitions"]) == {"Hour"}
    calls = [{"name": "ship", "parameters": {"addr": {"city": "Lima"}}},
             {"name": "alarm", "parameters": {"h": 7}}]
    jsonschema.validate(calls, schema)
    for bad in ([{"name": "ship", "parameters": {"addr": {"city": 3}}}],
                [{"name": "alarm", "parameters": {"h": 24}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    xgrammar = pytest.importorskip("xgrammar")
    for text in (plan.structured.json, json.dumps(DEFS_A)):  # required and named
        xgrammar.Grammar.from_json_schema(text)
    clash = {**DEFS_A, "$defs": {"Addr": {"type": "string"}}}
    _refusal("tools", "'Addr'", "'ship'", "'other'", tools=[_tool("ship", DEFS_A),
             _tool("other", clash)], tool_choice="required")


@pytest.mark.parametrize(("parameters", "ok"), [
    ({"type": "string"}, False), ({"type": "array", "items": {}}, False),
    ({"type": ["string", "null"]}, False), ({"type": "object"}, True),
    ({"properties": {"x": {}}}, True), ({}, True), (None, True)])
def test_parameters_must_be_an_object_schema(parameters, ok) -> None:
    tools = [TOOLS[0], _tool("f", parameters)]
    for choice in ("none", "required", {"type": "function", "function": {"name": "f"}}):
        if ok:
            plan_tools(_body(tools=tools, tool_choice=choice), "hermes", True)
        else:
            _refusal("tools[1].function.parameters", "object schema", tools=tools,
                     tool_choice=choice)


@pytest.mark.parametrize(("name", "words"), [
    ("get weather", "not a valid function name"), ("x" * 65, "not a valid function name"),
    ("dot.name", "not a valid function name"), ("a", "also the name of tools[0]")])
def test_tool_names_follow_openai_and_are_unique(name, words) -> None:
    _refusal("tools[1].function.name", repr(name), words, tools=[TOOLS[0], _tool(name)])
    plan_tools(_body(tools=[TOOLS[0], _tool("ok-Name_64" + "x" * 54)]), "hermes", True)


def test_auto_tool_choice_with_parser_none_is_refused_at_startup() -> None:
    with pytest.raises(ValueError, match="--enable-auto-tool-choice.*--tool-call-parser"):
        ServerOptions(enable_auto_tool_choice=True, tool_call_parser="none")
    ServerOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    ServerOptions(enable_auto_tool_choice=False, tool_call_parser="none")


def test_reasoning_effort_reaches_the_template(all_ckpt) -> None:
    """`reasoning_effort` is the template's `reasoning_effort` variable (the gpt-oss test
    template writes `Reasoning: <effort>`); `chat_template_kwargs` wins over it."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from moe_engine.server.http.chat_prepare import render_body
    from moe_engine.server.http.state import ChatSettings

    state = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(all_ckpt),
                            chat=ChatSettings(chat_template=chat_template("gpt_oss")))
    for body, want in ((_body(reasoning_effort="low"), "low"),
                       (_body(reasoning_effort="high",
                              chat_template_kwargs={"reasoning_effort": "minimal"}), "minimal")):
        assert f"Reasoning: {want}" in render_body(state, body)
    with pytest.raises(ValueError, match="reasoning_effort"):
        _body(reasoning_effort="extreme")
