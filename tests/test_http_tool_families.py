"""Each served family's tool calls and reasoning through /v1/chat/completions, end to end.

One server (tiny random Qwen3-MoE weights; a tokenizer holding every family's markers, special
where any family's tokenizer makes them special; `scripted_core` forcing each output). Per
family, the server's chat settings are rebuilt from that family's test template
(`chat_setup.chat_settings`, no parser flags: the defaults the template picks), then a sample
output in the family's native format (`tool_parser_cases`, the harmony samples) is forced: the
calls and reasoning come back whole and streamed, equal, which needs the engine's detokenizer to
keep the special-token markers (DeepSeek's `<｜tool▁sep｜>`, Kimi-K2's sections, GLM's
`<arg_key>`, harmony's `<|channel|>`) for the parsers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import tool_parser_cases as cases
from chat_fixtures import chat_template, family_checkpoint
from chat_helpers import same_calls, streamed, whole
from grpc_helpers import ServerThread
from http_helpers import API_KEY, MODEL
from scripted_core import END, START, start_scripted_server

from moe_engine.server.http.chat_setup import chat_settings


def _case(parser: str) -> cases.Case:
    return next(c for c in cases.CASES if c.parser == parser and c.id == "parallel_with_content")


HARMONY_CALL = ("<|channel|>analysis<|message|>Weather first.<|end|><|start|>assistant"
                "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                '{"city":"Paris"}<|call|>')

#: family -> (expected (tool parser, reasoning parser), chat_template_kwargs, output, expected
#: reasoning, expected content (whitespace-stripped), expected calls)
FAMILIES = {
    "qwen3": (("hermes", "qwen3"), {}, "<think>\nWhy not.\n</think>\n\n" + _case("hermes").text,
              "\nWhy not.\n", _case("hermes").content, _case("hermes").calls),
    "qwen3_coder": (("qwen3_coder", "qwen3"), {}, _case("qwen3_coder").text, "",
                    _case("qwen3_coder").content, _case("qwen3_coder").calls),
    "deepseek_v3": (("deepseek_v3", "qwen3"), {}, _case("deepseek_v3").text, "",
                    _case("deepseek_v3").content, _case("deepseek_v3").calls),
    # `thinking`: the prompt ends in <think>, the output starts inside the reasoning.
    "deepseek_v31": (("deepseek_v31", "deepseek_v31"), {"thinking": True},
                     "Use the tool.</think>" + _case("deepseek_v31").text, "Use the tool.",
                     _case("deepseek_v31").content, _case("deepseek_v31").calls),
    "kimi_k2": (("kimi_k2", "kimi_k2"), {}, "<think>Two calls.</think>" + _case("kimi_k2").text,
                "Two calls.", _case("kimi_k2").content, _case("kimi_k2").calls),
    "glm45": (("glm45", "glm45"), {}, "<think>Check.</think>" + _case("glm45").text, "Check.",
              _case("glm45").content, _case("glm45").calls),
    "gpt_oss": (("openai", "openai_gptoss"), {}, HARMONY_CALL, "Weather first.", "",
                [("get_weather", '{"city":"Paris"}')]),
}


@pytest.fixture(scope="module")
def server(qwen3_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    handle = start_scripted_server(
        family_checkpoint(qwen3_ckpt, tmp_path_factory.mktemp("families"), "all"), 512)
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[openai.OpenAI]:
    url = f"http://127.0.0.1:{server.server.http_port}/v1"
    with openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_calls_and_reasoning(family, server, client) -> None:
    names, kwargs, output, reasoning, content, calls = FAMILIES[family]
    state = server.server.http_state
    state.chat = chat_settings(
        chat_template=chat_template(family), tool_call_parser=None, reasoning_parser=None,
        enable_auto_tool_choice=True, tokenizer=server.server.engine.tokenizer,
        model_dir=server.server.config.model.model)
    assert (state.chat.tool_parser, state.chat.reasoning_parser) == names
    messages = [{"role": "user", "content": f"{START}{output}{END}"}]
    request = dict(model=MODEL, messages=messages, tools=cases.TOOLS, max_tokens=300,
                   extra_body={"chat_template_kwargs": kwargs} if kwargs else None)
    got = whole(client, **request)
    (choice,) = got["choices"]
    assert choice["reasoning"] == reasoning
    assert choice["content"].strip() == content.strip()
    assert [(c["name"], json.loads(c["arguments"])) for c in choice["calls"]] == [
        (name, json.loads(args)) for name, args in calls]
    assert choice["finish_reason"] == "tool_calls"
    if family == "kimi_k2":  # the format carries the ids
        assert [c["id"] for c in choice["calls"]] == _case("kimi_k2").ids
    same_calls(got, streamed(client, **request))


def test_special_markers_reach_the_parser_only_when_kept(server) -> None:
    """Without the tool parser (tool_choice none) the text is the plain answer: the DeepSeek
    markers, special tokens, are skipped as vLLM skips them; with it they are in the text."""
    state = server.server.http_state
    state.chat = chat_settings(
        chat_template=chat_template("deepseek_v31"), tool_call_parser=None,
        reasoning_parser="none", enable_auto_tool_choice=True,
        tokenizer=server.server.engine.tokenizer, model_dir=server.server.config.model.model)
    output = _case("deepseek_v31").text
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"{START}{output}{END}"}],
            "tools": cases.TOOLS, "tool_choice": "none", "max_tokens": 300}
    url = f"http://127.0.0.1:{server.server.http_port}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {API_KEY}"}
    plain = httpx.post(url, json=body, headers=auth).json()["choices"][0]["message"]
    assert "<｜" not in plain["content"] and "get_weather" in plain["content"]
    parsed = httpx.post(url, json={**body, "tool_choice": "auto"}, headers=auth).json()
    assert [c["function"]["name"] for c in parsed["choices"][0]["message"]["tool_calls"]] == [
        "get_weather", "ping"]
