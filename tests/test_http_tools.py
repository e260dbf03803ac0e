"""Tool calls and reasoning on /v1/chat/completions, end to end with the official `openai`
client against one server (tiny random Qwen3-MoE, the Qwen3 test chat template and markers):

- named and `required` tool choices are enforced by structured outputs: even the random model's
  calls validate against the tools' schemas, streamed and whole alike (greedy);
- `auto` parses the family parser's calls out of the text, and a reasoning parser splits
  `reasoning_content` off, with reasoning tokens counted; the text is forced through
  `scripted_core` (the real engine, whose sampled tokens follow a script in the prompt);
- tool calls and tool results in the history render through the template;
- bad bodies get a 400 naming the field, and the server serves on.

The parsers are the ones `registry.default_parsers` picks from the template (hermes, qwen3);
each family's format has its own parser tests (tests/test_tool_parsers.py,
tests/test_reasoning_parsers.py); these test the wiring.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from chat_fixtures import family_checkpoint
from chat_helpers import same_calls, streamed, whole
from grpc_helpers import ServerThread
from http_helpers import API_KEY, MODEL
from scripted_core import END, START, start_scripted_server

from moe_engine.server.http.state import ChatSettings

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                   "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False,
}
ALARM = {
    "type": "object",
    "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                   "on": {"type": "boolean"}},
    "required": ["hour", "on"], "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}},
]
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0, "max_tokens": 60}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(qwen3_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    # No parser flags: the checkpoint's defaults (hermes and qwen3, from the template).
    handle = start_scripted_server(
        family_checkpoint(qwen3_ckpt, tmp_path_factory.mktemp("tools"), "qwen3"), 512)
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def base_url(server: ServerThread) -> str:
    return f"http://127.0.0.1:{server.server.http_port}"


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


def test_named_tool_choice_validates_streamed_and_whole(client) -> None:
    for name in ("get_weather", "set_alarm"):
        kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, **GREEDY,
                      tool_choice={"type": "function", "function": {"name": name}})
        got = whole(client, **kwargs)
        (choice,) = got["choices"]
        assert choice["finish_reason"] == "tool_calls" and choice["content"] == ""
        (call,) = choice["calls"]
        assert call["name"] == name and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[name])
        assert got["raw"].choices[0].message.content is None
        stream = streamed(client, **kwargs)
        same_calls(got, stream)
        for result in (got, stream):  # no reasoning parser ran: 0, not null
            assert result["usage"].completion_tokens_details.reasoning_tokens == 0
    logged = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2)
    entries = logged.choices[0].logprobs.content
    assert len(entries) == logged.usage.completion_tokens
    assert "".join(e.token for e in entries).startswith(
        logged.choices[0].message.tool_calls[0].function.arguments)
    chunks = list(client.chat.completions.create(**kwargs, logprobs=True, stream=True))
    assert sum(len(c.choices[0].logprobs.content) for c in chunks
               if c.choices and c.choices[0].logprobs) == len(entries)


def test_required_tool_choice_validates_streamed_and_whole(client) -> None:
    for parallel in (True, False):
        kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", n=4,
                      parallel_tool_calls=parallel, temperature=1.0, seed=7, max_tokens=200)
        got = whole(client, **kwargs)
        for choice in got["choices"]:
            assert choice["finish_reason"] == "tool_calls", choice
            assert choice["calls"] and (parallel or len(choice["calls"]) == 1)
            for call in choice["calls"]:
                jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        same_calls(got, streamed(client, **kwargs))


def test_tool_choice_none_renders_tools_and_parses_nothing(client, base_url) -> None:
    said = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'
    messages = [{"role": "user", "content": f"{START}{said}{END}"}]
    got = whole(client, model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                max_tokens=60)
    assert got["choices"][0]["content"] == said and got["choices"][0]["calls"] == []
    assert got["choices"][0]["finish_reason"] == "stop"
    body = {"messages": messages, "tools": TOOLS}
    with_tools = httpx.post(f"{base_url}/tokenize", json=body, headers=AUTH).json()["tokens"]
    body.pop("tools")
    without = httpx.post(f"{base_url}/tokenize", json=body, headers=AUTH).json()["tokens"]
    assert len(with_tools) > len(without) + 20


def test_auto_parses_calls_and_reasoning(client) -> None:
    said = ('<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
            '\n<tool_call>\n{"name": "set_alarm", "arguments": {"hour": 7, "on": true}}\n'
            '</tool_call>')
    messages = [{"role": "user", "content": f"{START}{said}{END}"}]
    kwargs = dict(model=MODEL, messages=messages, tools=TOOLS, max_tokens=250, n=2)
    got = whole(client, **kwargs)
    for choice in got["choices"]:
        assert choice["reasoning"] == "\nThe user wants weather.\n"
        assert choice["content"] == "\n\nLet me check."
        assert [(c["name"], json.loads(c["arguments"])) for c in choice["calls"]] == [
            ("get_weather", {"city": "Paris", "unit": "c"}), ("set_alarm", {"hour": 7, "on": True})]
        assert choice["finish_reason"] == "tool_calls"
    stream = streamed(client, **kwargs)
    same_calls(got, stream)
    for result in (got, stream):
        details = result["usage"].completion_tokens_details
        assert 0 < details.reasoning_tokens < result["usage"].completion_tokens
    one = whole(client, **{**kwargs, "parallel_tool_calls": False})
    assert [[c["name"] for c in ch["calls"]] for ch in one["choices"]] == [["get_weather"]] * 2


def test_reasoning_tokens_are_the_tokens_through_the_end_marker(client, server) -> None:
    tok = server.server.engine.tokenizer
    reasoning, answer = "<think>\nabc def\n</think>", "\n\nThe answer is 4."
    messages = [{"role": "user", "content": f"{START}{reasoning}{answer}{END}"}]
    for result in (whole(client, model=MODEL, messages=messages, max_tokens=60),
                   streamed(client, model=MODEL, messages=messages, max_tokens=60)):
        (choice,) = result["choices"]
        assert (choice["reasoning"], choice["content"]) == ("\nabc def\n", "\n\nThe answer is 4.")
        assert choice["finish_reason"] == "stop"
        expected = len(tok.encode(reasoning, add_special_tokens=False))
        assert result["usage"].completion_tokens_details.reasoning_tokens == expected
        assert result["usage"].completion_tokens == expected + len(
            tok.encode(answer, add_special_tokens=False)) + 1  # + EOS


def test_history_with_tool_calls_renders(base_url, server) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "use the tool",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]
    body = {"messages": messages, "tools": TOOLS, "chat_template_kwargs": {
        "enable_thinking": False}}
    tokens = httpx.post(f"{base_url}/tokenize", json=body, headers=AUTH).json()["tokens"]
    text = server.server.engine.tokenizer.decode(tokens)
    assert ('<|im_start|>assistant\n<think>\nuse the tool\n</think>\n\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18 C and sunny\n'
            '</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n') in text
    assert '"name": "set_alarm"' in text  # the tools are in the system turn


def test_continue_final_message_and_add_generation_prompt(base_url, server) -> None:
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Hello th"}]
    body = {"messages": messages, "continue_final_message": True,
            "add_generation_prompt": False}
    tokens = httpx.post(f"{base_url}/tokenize", json=body, headers=AUTH).json()["tokens"]
    assert server.server.engine.tokenizer.decode(tokens).endswith(
        "<|im_start|>assistant\nHello th")
    r = httpx.post(f"{base_url}/v1/chat/completions", headers=AUTH,
                   json={"messages": messages, "continue_final_message": True})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "continue_final_message"


#: 450 tools without parameters: a ~21 kB body (under the test server's 64 KiB body limit)
#: whose `required` schema is over MAX_JSON_SCHEMA_CHARS (each becomes an anyOf branch).
MANY_TOOLS = [{"type": "function", "function": {"name": f"t{i}"}} for i in range(450)]
BAD_BODIES = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope' is not in tools"),
    ({"tools": [{"type": "function", "name": "f"}]}, "tools[0].function", "required"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", "function"),
    ({"tools": {"type": "function"}}, "tools", "list"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]", "tool_call_id"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice", "sometimes"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "cannot be combined"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize", "tokenize"),
    ({"tools": [*TOOLS, {"type": "function", "function": {
        "name": "s", "parameters": {"type": "string"}}}], "tool_choice": "required"},
     "tools[2].function.parameters", "object schema"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]},
     "tools[0].function.name", "'get weather' is not a valid function name"),
    ({"tools": [*TOOLS, TOOLS[0]]}, "tools[2].function.name", "also the name of tools[0]"),
    ({"tools": MANY_TOOLS, "tool_choice": "required"}, "tools",
     "at most 65536; send fewer tools"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "extreme"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "not valid JSON"),
]


@pytest.mark.parametrize(("extra", "param", "words"), BAD_BODIES)
def test_bad_bodies_name_the_field(base_url, extra, param, words) -> None:
    body = {"messages": USER, **extra}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_auto_needs_enable_auto_tool_choice(base_url, server, client) -> None:
    state = server.server.http_state
    settings = state.chat
    assert settings == ChatSettings(None, "hermes", "qwen3", True)  # the template's defaults
    state.chat = ChatSettings(tool_parser="hermes", enable_auto_tool_choice=False)
    try:
        for extra in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
            r = httpx.post(f"{base_url}/v1/chat/completions", json={"messages": USER, **extra},
                           headers=AUTH)
            assert r.status_code == 400
            assert r.json()["error"]["param"] == "tool_choice"
            assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
        state.chat = ChatSettings()  # no parsers at all: required needs none
        got = whole(client, model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                    temperature=0, max_tokens=200)
        assert got["choices"][0]["calls"] and got["choices"][0]["finish_reason"] == "tool_calls"
        for call in got["choices"][0]["calls"]:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    finally:
        state.chat = settings
    assert client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2).choices


ADDR = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}},
        "required": ["city"], "additionalProperties": False}
SHIP = {"$defs": {"Addr": ADDR}, "type": "object",
        "properties": {"to": {"$ref": "#/$defs/Addr"}, "n": {"type": "integer", "minimum": 1,
                                                             "maximum": 9}},
        "required": ["to", "n"], "additionalProperties": False}
DEF_TOOLS = [TOOLS[1], {"type": "function", "function": {"name": "ship", "parameters": SHIP}}]


def test_pydantic_defs_refs_work_named_and_required(client) -> None:
    """Pydantic-style `$defs`/`$ref` tool schemas: named and required (hoisted defs), whole and
    streamed, calls valid against the tool's own schema (refs resolved)."""
    schemas = {**SCHEMAS, "ship": SHIP}
    for choice in ({"type": "function", "function": {"name": "ship"}}, "required"):
        kwargs = dict(model=MODEL, messages=USER, tools=DEF_TOOLS, tool_choice=choice, n=2,
                      temperature=1.0, seed=3, max_tokens=100)
        got = whole(client, **kwargs)
        for ch in got["choices"]:
            assert ch["finish_reason"] == "tool_calls" and ch["calls"], ch
            for call in ch["calls"]:
                jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
        same_calls(got, streamed(client, **kwargs))


def test_reasoning_effort_is_accepted(client) -> None:
    got = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                         reasoning_effort="low")
    assert got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens_details.reasoning_tokens == 0
