"""/v1/responses (OpenAI's Responses API) and /v1/messages (Anthropic's Messages API), driven
with the official `openai` and `anthropic` SDKs against one tiny server (Qwen3-MoE weights with
the Qwen3 test chat template and markers, so the hermes tool parser and the qwen3 reasoning
parser are the defaults; `--enable-auto-tool-choice`): text in and out, whole and streamed
(greedy: the streamed text equals the whole text), the events in each API's order as the SDKs
parse them, instructions / system rendered into the prompt (usage against /tokenize),
`previous_response_id`, forced tool choices whose arguments validate, `auto` calls and
reasoning read from a scripted output (`scripted_core`), errors in each API's own shape naming
the field, and `x-api-key`."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest
from chat_fixtures import family_checkpoint
from grpc_helpers import ServerThread
from http_helpers import API_KEY, MODEL, Grpc, wait_idle
from scripted_core import END, START, start_scripted_server

GREEDY = {"temperature": 0, "max_output_tokens": 8}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
        "required": ["zone"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(qwen3_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    handle = start_scripted_server(
        family_checkpoint(qwen3_ckpt, tmp_path_factory.mktemp("apis"), "qwen3"), 256)
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def base_url(server: ServerThread) -> str:
    return f"http://127.0.0.1:{server.server.http_port}"


@pytest.fixture(scope="module")
def oai(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def claude(base_url: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=base_url, api_key=API_KEY, max_retries=0) as c:
        yield c


def items(response) -> list[tuple]:
    """A response's output items without their ids: (type, status, text or name/arguments)."""
    out = []
    for o in response.output:
        if o.type == "function_call":
            out.append((o.type, o.status, o.name, o.arguments))
        else:
            out.append((o.type, o.status, [c.text for c in o.content]))
    return out


def prompt_tokens(base_url: str, messages: list[dict]) -> int:
    got = httpx.post(f"{base_url}/tokenize", json={"messages": messages},
                     headers={"Authorization": f"Bearer {API_KEY}"})
    return got.json()["count"]


# -- /v1/responses -----------------------------------------------------------------------------


def test_responses_text_whole_and_streamed(oai, base_url) -> None:
    whole = oai.responses.create(model=MODEL, input="def f(x):", instructions="be brief",
                                 **GREEDY)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status in ("completed", "incomplete")
    [message] = whole.output
    assert message.type == "message" and message.role == "assistant"
    assert whole.output_text == message.content[0].text and whole.output_text
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x):"}]
    assert whole.usage.input_tokens == prompt_tokens(base_url, messages)
    assert whole.usage.output_tokens <= 8
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    if whole.status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens"
    events = list(oai.responses.create(model=MODEL, input="def f(x):", instructions="be brief",
                                       stream=True, **GREEDY))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * deltas
                     + ["response.output_text.done", "response.content_part.done",
                        "response.output_item.done", f"response.{whole.status}"])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def test_responses_items_and_previous_response_id(oai, base_url) -> None:
    first = oai.responses.create(model=MODEL, input="hello", **GREEDY)
    second = oai.responses.create(model=MODEL, input="and then", previous_response_id=first.id,
                                  **GREEDY)
    history = [{"role": "user", "content": "hello"},
               {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "and then"}]
    assert second.usage.input_tokens == prompt_tokens(base_url, history)
    assert second.previous_response_id == first.id
    # The same conversation given as items (an output item fed back as input) is the same prompt.
    items = oai.responses.create(model=MODEL, **GREEDY, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
        first.output[0].model_dump(exclude_none=True),
        {"type": "message", "role": "user", "content": "and then"},
    ])
    assert items.usage.input_tokens == second.usage.input_tokens
    assert items.output_text == second.output_text
    assert oai.responses.retrieve(second.id).output_text == second.output_text
    with pytest.raises(openai.NotFoundError) as missing:
        oai.responses.retrieve("resp_nope")
    assert missing.value.body["param"] == "response_id"
    unstored = oai.responses.create(model=MODEL, input="x", store=False, **GREEDY)
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="y", previous_response_id=unstored.id)
    assert err.value.body["param"] == "previous_response_id"
    assert err.value.body["code"] == "previous_response_not_found"


def test_responses_named_and_required_tool_choice(oai) -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER},
             {"type": "function", "name": "get_time", "parameters": TIME,
              "description": "the time"}]
    named = oai.responses.create(model=MODEL, input="weather?", tools=tools, temperature=0,
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=40)
    [call] = named.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and named.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with oai.responses.stream(model=MODEL, input="weather?", tools=tools, temperature=0,
                              tool_choice={"type": "function", "name": "get_weather"},
                              max_output_tokens=40) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_response()
    assert streamed.output[0].arguments == call.arguments
    deltas = kinds.count("response.function_call_arguments.delta")
    assert deltas >= 1 and kinds == (
        ["response.created", "response.in_progress", "response.output_item.added"]
        + ["response.function_call_arguments.delta"] * deltas
        + ["response.function_call_arguments.done", "response.output_item.done",
           "response.completed"])
    required = oai.responses.create(model=MODEL, input="anything", tools=tools, temperature=0,
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=60)
    [out] = required.output
    assert out.type == "function_call" and required.status == "completed"
    jsonschema.validate(json.loads(out.arguments), WEATHER if out.name == "get_weather" else TIME)
    # The call's result goes back as a function_call_output item.
    follow = oai.responses.create(model=MODEL, tools=tools, **GREEDY, input=[
        {"role": "user", "content": "weather?"}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow.output and follow.usage.input_tokens > named.usage.input_tokens


SAID = ('<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>')
TOOLS_FLAT = [{"type": "function", "name": "get_weather", "parameters": WEATHER},
              {"type": "function", "name": "get_time", "parameters": TIME}]


def test_responses_auto_calls_and_reasoning(oai) -> None:
    kwargs = {"model": MODEL, "input": f"{START}{SAID}{END}", "tools": TOOLS_FLAT,
              "max_output_tokens": 200}
    whole = oai.responses.create(**kwargs)
    assert [o.type for o in whole.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = whole.output
    assert reasoning.content[0].text == "\nThe user wants weather.\n"
    assert message.content[0].text == "\n\nLet me check."
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris", "days": 2})
    assert whole.status == "completed"
    details = whole.usage.output_tokens_details
    assert 0 < details.reasoning_tokens < whole.usage.output_tokens
    with oai.responses.stream(**kwargs) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_response()
    assert items(streamed) == items(whole)
    assert streamed.usage == whole.usage
    assert "response.reasoning_text.delta" in kinds and kinds[-1] == "response.completed"
    # tool_choice none: the same text comes back as text (reasoning still split off).
    plain = oai.responses.create(**kwargs, tool_choice="none")
    assert [o.type for o in plain.output] == ["reasoning", "message"]
    assert "<tool_call>" in plain.output_text


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "max_output_token": 5}, "max_output_token"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "max_output_tokens": 10_000}, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "tools": [{"type": "function", "name": "f",
                               "parameters": {"type": "string"}}]}, "tools[0].parameters"),
    ({"input": "x", "tools": [{"type": "function", "name": "f g"}]}, "tools[0].name"),
])
def test_responses_errors_name_the_field(base_url, body, param) -> None:
    got = httpx.post(f"{base_url}/v1/responses", json={"model": MODEL, **body},
                     headers={"Authorization": f"Bearer {API_KEY}"})
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split("[")[0].split(".")[0] in error["message"]


# -- /v1/messages ------------------------------------------------------------------------------

SYSTEM = [{"type": "text", "text": "you write"}, {"type": "text", "text": "python"}]


def test_messages_text_whole_and_streamed(claude, base_url) -> None:
    kwargs = {"model": MODEL, "max_tokens": 8, "extra_body": {"temperature": 0}, "system": SYSTEM,
              "messages": [{"role": "user", "content": [{"type": "text", "text": "def f(x):"}]}]}
    whole = claude.messages.create(**kwargs)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    [block] = whole.content
    assert block.type == "text" and block.text
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.stop_sequence is None
    assert whole.usage.input_tokens == prompt_tokens(base_url, [
        {"role": "system", "content": "you write\npython"},
        {"role": "user", "content": "def f(x):"}])
    assert whole.usage.output_tokens <= 8
    count = claude.messages.count_tokens(model=MODEL, system=SYSTEM,
                                         messages=kwargs["messages"])
    assert count.input_tokens == whole.usage.input_tokens
    events = list(claude.messages.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("content_block_delta")
    assert kinds == (["message_start", "content_block_start"] + ["content_block_delta"] * deltas
                     + ["content_block_stop", "message_delta", "message_stop"])
    assert all(e.delta.type == "text_delta" for e in events if e.type == "content_block_delta")
    assert "".join(e.delta.text for e in events[2:-3]) == block.text
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    # The raw stream names each event and has the ping after the first block starts.
    raw_body = {**{k: v for k, v in kwargs.items() if k != "extra_body"}, "temperature": 0}
    raw = httpx.post(f"{base_url}/v1/messages", json={**raw_body, "stream": True},
                     headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"})
    names = [line[7:] for line in raw.text.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    with claude.messages.stream(**kwargs) as stream:
        assert "".join(stream.text_stream) == block.text
        final = stream.get_final_message()
    assert final.content[0].text == block.text and final.stop_reason == whole.stop_reason


def test_messages_stop_sequence_and_prefill(claude, base_url) -> None:
    kwargs = {"model": MODEL, "max_tokens": 8, "extra_body": {"temperature": 0, "top_k": 1},
              "messages": [{"role": "user", "content": "import os"}]}
    text = claude.messages.create(**kwargs).content[0].text
    # A stop string that first occurs at an index >= 1 (so something comes before it).
    stop = next(text[i:i + 2] for i in range(1, len(text) - 1)
                if text[i:i + 2].strip() == text[i:i + 2] and text.index(text[i:i + 2]) == i)
    cut = claude.messages.create(**kwargs, stop_sequences=["never", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]
    # A last assistant message is continued: the prompt ends inside its turn.
    messages = [*kwargs["messages"], {"role": "assistant", "content": text[:3]}]
    prefill = claude.messages.create(**{**kwargs, "messages": messages})
    got = httpx.post(f"{base_url}/tokenize", headers={"Authorization": f"Bearer {API_KEY}"},
                     json={"messages": messages, "continue_final_message": True,
                           "add_generation_prompt": False}).json()["count"]
    assert prefill.usage.input_tokens == got


def test_messages_tool_choice(claude) -> None:
    tools = [{"name": "get_weather", "description": "weather", "input_schema": WEATHER},
             {"name": "get_time", "input_schema": TIME}]
    kwargs = {"model": MODEL, "max_tokens": 40, "extra_body": {"temperature": 0}, "tools": tools,
              "messages": [{"role": "user", "content": "weather?"}]}
    named = claude.messages.create(**kwargs, tool_choice={"type": "tool", "name": "get_weather"})
    [use] = named.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    assert named.stop_reason == "tool_use"
    jsonschema.validate(use.input, WEATHER)
    with claude.messages.stream(**kwargs,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_message()
    assert streamed.content[0].input == use.input and streamed.stop_reason == "tool_use"
    assert "input_json" in kinds
    anyone = claude.messages.create(**{**kwargs, "max_tokens": 100}, tool_choice={
        "type": "any", "disable_parallel_tool_use": True})
    [use2] = anyone.content
    assert use2.type == "tool_use" and anyone.stop_reason == "tool_use"
    jsonschema.validate(use2.input, WEATHER if use2.name == "get_weather" else TIME)
    # The result goes back as a tool_result block; the call as a tool_use block.
    follow = claude.messages.create(**{**kwargs, "max_tokens": 4, "messages": [
        *kwargs["messages"], {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "sunny"}]}]})
    assert follow.usage.input_tokens > named.usage.input_tokens


def test_messages_auto_tool_use_and_thinking(claude) -> None:
    tools = [{"name": "get_weather", "input_schema": WEATHER},
             {"name": "get_time", "input_schema": TIME}]
    kwargs = {"model": MODEL, "max_tokens": 200, "tools": tools,
              "messages": [{"role": "user", "content": f"{START}{SAID}{END}"}]}
    whole = claude.messages.create(**kwargs)
    assert [b.type for b in whole.content] == ["thinking", "text", "tool_use"]
    thinking, text, use = whole.content
    assert thinking.thinking == "\nThe user wants weather.\n"
    assert text.text == "\n\nLet me check."
    assert (use.name, use.input) == ("get_weather", {"city": "Paris", "days": 2})
    assert whole.stop_reason == "tool_use"
    with claude.messages.stream(**kwargs) as stream:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream]
        streamed = stream.get_final_message()
    strip = [{k: v for k, v in b.model_dump().items() if k != "id"} for b in whole.content]
    assert [{k: v for k, v in b.model_dump().items() if k != "id"}
            for b in streamed.content] == strip
    assert streamed.stop_reason == "tool_use" and streamed.usage == whole.usage
    assert ("content_block_delta", "thinking_delta") in kinds
    assert ("content_block_delta", "input_json_delta") in kinds


@pytest.mark.parametrize(("body", "field"), [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "top_j": 1}, "top_j"),
    ({"max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"max_tokens": 10_000, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "thinking": {"type": "enabled", "budget_tokens": 9}}, "thinking.budget_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": [
        {"name": "f", "input_schema": {"type": "array"}}]}, "tools[0].input_schema"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": [
        {"name": "f", "input_schema": {"type": "object"}},
        {"name": "f", "input_schema": {"type": "object"}}]}, "tools[1].name"),
])
def test_messages_errors_in_anthropic_shape(claude, base_url, body, field) -> None:
    got = httpx.post(f"{base_url}/v1/messages", json={"model": MODEL, **body},
                     headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"})
    assert got.status_code == 400, got.text
    assert got.json()["type"] == "error"
    error = got.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith(field)
    # The SDK (whose create() refuses such bodies itself) reads the error as Anthropic's.
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.post("/v1/messages", body={"model": MODEL, **body}, cast_to=anthropic.types.Message)
    assert err.value.body["error"]["message"] == error["message"]
    assert field in str(err.value)


def test_api_key_headers(base_url) -> None:
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    bad = httpx.post(f"{base_url}/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert bad.status_code == 401
    assert bad.json()["type"] == "error"
    assert bad.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=base_url, api_key="wrong", max_retries=0).messages.create(
            **body)
    ok = httpx.post(f"{base_url}/v1/messages", json=body, headers={"x-api-key": API_KEY})
    assert ok.status_code == 200
    # x-api-key works on the OpenAI endpoints too; a missing key is OpenAI-shaped there.
    models = httpx.get(f"{base_url}/v1/models", headers={"x-api-key": API_KEY})
    assert models.status_code == 200
    none = httpx.post(f"{base_url}/v1/responses", json={"input": "x"})
    assert none.status_code == 401 and none.json()["error"]["code"] == "invalid_api_key"


def test_concurrent_streams_equal_the_whole(base_url, oai, claude) -> None:
    """16 Responses and 16 Messages streams at once, each read by its SDK: every one gets the
    same reasoning, text and call as a whole response (the parsers keep no shared state)."""
    tools = [{"name": "get_weather", "input_schema": WEATHER}]
    content = f"{START}{SAID}{END}"
    resp_kwargs = {"model": MODEL, "input": content, "tools": TOOLS_FLAT, "max_output_tokens": 200}
    msg_kwargs = {"model": MODEL, "max_tokens": 200, "tools": tools,
                  "messages": [{"role": "user", "content": content}]}
    expected_resp = items(oai.responses.create(**resp_kwargs))
    whole = claude.messages.create(**msg_kwargs)
    expected_msg = [b.model_dump(exclude={"id"}) for b in whole.content]

    async def main() -> tuple[list, list]:
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=API_KEY,
                                      max_retries=0) as a_oai, \
                anthropic.AsyncAnthropic(base_url=base_url, api_key=API_KEY,
                                         max_retries=0) as a_claude:
            async def one_response():
                async with a_oai.responses.stream(**resp_kwargs) as stream:
                    return items(await stream.get_final_response())

            async def one_message():
                async with a_claude.messages.stream(**msg_kwargs) as stream:
                    final = await stream.get_final_message()
                    return [b.model_dump(exclude={"id"}) for b in final.content]

            got = await asyncio.gather(*[one_response() for _ in range(16)],
                                       *[one_message() for _ in range(16)])
            return got[:16], got[16:]

    responses, messages = asyncio.run(main())
    assert all(r == expected_resp for r in responses)
    assert all(m == expected_msg for m in messages)


def test_structured_output_formats(oai, claude) -> None:
    """`text.format` (Responses) and `output_config.format` (Messages) constrain the text to
    the schema, through chat's response_format."""
    got = oai.responses.create(model=MODEL, input="weather as JSON", max_output_tokens=60,
                               text={"format": {"type": "json_schema", "name": "w",
                                                "schema": WEATHER}})
    assert got.status == "completed" and got.text.format.type == "json_schema"
    jsonschema.validate(json.loads(got.output_text), WEATHER)
    msg = claude.messages.create(model=MODEL, max_tokens=60,
                                 messages=[{"role": "user", "content": "weather as JSON"}],
                                 output_config={"format": {"type": "json_schema",
                                                           "schema": WEATHER}})
    assert msg.stop_reason == "end_turn"
    jsonschema.validate(json.loads(msg.content[0].text), WEATHER)
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="x", tools=TOOLS_FLAT, tool_choice="required",
                             text={"format": {"type": "json_object"}})
    assert err.value.body["param"] == "text.format"


def test_disconnect_mid_stream_aborts_the_request(server, base_url) -> None:
    """A client that leaves a stream early aborts its request in the engine (num_aborted):
    nothing runs or waits after, and every KV block is free again."""
    long = f"{START}{'word ' * 150}{END}"
    rpc = Grpc(server.address)
    try:
        before = rpc.stats().num_aborted
        with httpx.stream("POST", f"{base_url}/v1/responses", headers={"x-api-key": API_KEY},
                          json={"input": long, "stream": True, "max_output_tokens": 300}) as r:
            lines = list(itertools.islice(r.iter_lines(), 12))
        assert lines[0] == "event: response.created"
        with httpx.stream("POST", f"{base_url}/v1/messages", headers={"x-api-key": API_KEY},
                          json={"model": MODEL, "max_tokens": 300, "stream": True,
                                "messages": [{"role": "user", "content": long}]}) as r:
            lines = list(itertools.islice(r.iter_lines(), 12))
        assert lines[0] == "event: message_start"
        stats = wait_idle(rpc)
        assert stats.num_aborted == before + 2
    finally:
        rpc.close()
