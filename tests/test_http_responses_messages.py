"""/v1/responses (OpenAI's Responses API) and /v1/messages (Anthropic's Messages API), driven
with the official `openai` and `anthropic` SDKs against one tiny server: text in and out,
whole and streamed (greedy: the streamed text equals the whole text), the events in each API's
order as the SDKs parse them, instructions / system rendered into the prompt (usage against
/tokenize), `previous_response_id`, forced tool choices whose arguments validate, errors in
each API's own shape naming the field, and `x-api-key`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest
from grpc_helpers import ServerThread
from http_helpers import API_KEY, MODEL, start_server, tokenizer_checkpoint

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
    handle = start_server(tokenizer_checkpoint(qwen3_ckpt, tmp_path_factory.mktemp("apis")))
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
                                    tool_choice="required", max_output_tokens=60)
    if required.status == "completed":
        assert required.output and all(o.type == "function_call" for o in required.output)
        for out in required.output:
            jsonschema.validate(json.loads(out.arguments), WEATHER if out.name == "get_weather"
                                else TIME)
    # The call's result goes back as a function_call_output item.
    follow = oai.responses.create(model=MODEL, tools=tools, **GREEDY, input=[
        {"role": "user", "content": "weather?"}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow.output and follow.usage.input_tokens > named.usage.input_tokens


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "max_output_token": 5}, "max_output_token"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "max_output_tokens": 10_000}, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature"),
])
def test_responses_errors_name_the_field(base_url, body, param) -> None:
    got = httpx.post(f"{base_url}/v1/responses", json={"model": MODEL, **body},
                     headers={"Authorization": f"Bearer {API_KEY}"})
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split("[")[0].split(".")[0] in error["message"]
