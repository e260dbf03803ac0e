"""The Responses and Messages translations without a server: request conversion onto chat
messages, the response store's bounds, the forced-tool-choice readers, and both APIs' event
builders checked against the official SDKs' own event types and stream accumulators, with the
streamed result equal to the whole one at every split of a sample output."""

from __future__ import annotations

import json

import openai
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from moe_engine.server.http.chat_events import ChatTurn, TurnEnd
from moe_engine.server.http.chat_tools import RequiredCallsParser
from moe_engine.server.http.errors import OpenAIError
from moe_engine.server.http.messages import stop_reason
from moe_engine.server.http.messages import to_turn as messages_turn
from moe_engine.server.http.messages_protocol import MessagesRequest
from moe_engine.server.http.messages_stream import MessageBuilder
from moe_engine.server.http.responses import items_to_messages, parse_items
from moe_engine.server.http.responses import to_turn as responses_turn
from moe_engine.server.http.responses_protocol import ResponsesRequest
from moe_engine.server.http.responses_store import ResponseStore
from moe_engine.server.http.responses_stream import ResponseBuilder
from moe_engine.server.parsers import registry
from moe_engine.server.parsers.base import OutputStream

RESPONSE_EVENT = TypeAdapter(ResponseStreamEvent)
MESSAGE_EVENT = TypeAdapter(RawMessageStreamEvent)


CALLS = '[{"name":"get_time","parameters":{"zone":"c\\"et"}},{"name":"f","parameters":{}}]'
#: (tool parser factory, output text): reasoning then calls of `required`, and reasoning, text
#: and a Hermes call (`tool_choice` auto), each read by the real parsers.
SAMPLES = {
    "required": (lambda: RequiredCallsParser(), "<think>hmm, é?</think>" + CALLS),
    "auto": (lambda: registry.tool_parser("hermes", []),
             '<think>plan</think>Sure: <tool_call>{"name": "get_time", "arguments": '
             '{"zone": "utc"}}</tool_call>'),
}


def run_stream(sample: str, pieces: list[str]) -> tuple[list, TurnEnd]:
    """Deltas of a sample's text split into `pieces` through the qwen3 reasoning parser and
    the sample's tool parser."""
    stream = OutputStream(registry.reasoning_parser("qwen3"), SAMPLES[sample][0]())
    deltas = [d for p in pieces if (d := stream.feed(p))]
    if last := stream.finish():
        deltas.append(last)
    end = TurnEnd(0, "tool_calls", None, stream.content, stream.reasoning, stream.tool_calls,
                  17, 5)
    return deltas, end


def splits(sample: str) -> list[list[str]]:
    text = SAMPLES[sample][1]
    out = [[text]]
    out += [[text[:i], text[i:]] for i in range(1, len(text))]
    out.append(list(text))
    return out


def responses_events(deltas: list, end: TurnEnd) -> list[dict]:
    builder = ResponseBuilder({"id": "resp_1", "object": "response", "created_at": 1,
                               "model": "m", "parallel_tool_calls": True,
                               "tool_choice": "required", "tools": []})
    events = builder.start()
    for d in deltas:
        events += builder.add(d)
    usage = {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 0,
                                                         "cache_write_tokens": 0},
             "output_tokens": 17, "output_tokens_details": {"reasoning_tokens": 5},
             "total_tokens": 20}
    return events + builder.finish(end, usage)


@pytest.mark.parametrize("sample", SAMPLES)
def test_responses_events_parse_and_stream_equals_whole(sample: str) -> None:
    whole = None
    for pieces in splits(sample):
        events = responses_events(*run_stream(sample, pieces))
        state = ResponseStreamState(input_tools=[], text_format=openai.omit)
        for event in events:
            RESPONSE_EVENT.validate_python(event)
            state.handle_event(RESPONSE_EVENT.validate_python(event))
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        final = Response.model_validate(events[-1]["response"])
        assert events[-1]["type"] == "response.completed"
        got = [o.model_dump(exclude={"id", "call_id"}) for o in final.output]
        whole = whole or got
        assert got == whole
    kinds = [o["type"] for o in whole]
    if sample == "required":
        assert kinds == ["reasoning", "function_call", "function_call"]
        assert whole[0]["content"] == [{"type": "reasoning_text", "text": "hmm, é?"}]
        assert [(o["name"], json.loads(o["arguments"])) for o in whole[1:]] == [
            ("get_time", {"zone": 'c"et'}), ("f", {})]
    else:
        assert kinds == ["reasoning", "message", "function_call"]
        assert whole[1]["content"][0]["text"].strip() == "Sure:"
        assert json.loads(whole[2]["arguments"]) == {"zone": "utc"}
    assert final.usage.output_tokens_details.reasoning_tokens == 5


def test_responses_event_order() -> None:
    deltas, end = run_stream("required", list(SAMPLES["required"][1]))
    kinds = [e["type"] for e in responses_events(deltas, end)]
    dedup = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert dedup == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]


def message_events(deltas: list, end: TurnEnd) -> tuple[list[dict], dict]:
    builder = MessageBuilder({"id": "msg_1", "model": "m"}, 3)
    events = builder.start()
    for d in deltas:
        events += builder.add(d)
    reason, seq = stop_reason(end, None)
    events += builder.finish(reason, seq, end.output_tokens)
    return events, builder.snapshot(reason, seq, end.output_tokens)


@pytest.mark.parametrize("sample", SAMPLES)
def test_messages_events_parse_and_stream_equals_whole(sample: str) -> None:
    whole = None
    for pieces in splits(sample):
        events, final = message_events(*run_stream(sample, pieces))
        snapshot, bufs = None, {}
        for event in events:
            if event["type"] == "ping":
                continue
            parsed = MESSAGE_EVENT.validate_python(event)
            snapshot = accumulate_event(event=parsed, current_snapshot=snapshot, json_bufs=bufs)
        message = Message.model_validate(final)
        assert snapshot.model_dump() == message.model_dump()
        got = message.model_dump(exclude={"id"})
        ids = [b.pop("id") for b in got["content"] if b["type"] == "tool_use"]
        whole = whole or got
        assert got == whole
    if sample == "auto":
        assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use"]
        assert whole["content"][2]["input"] == {"zone": "utc"}
        return
    assert [b["type"] for b in whole["content"]] == ["thinking", "tool_use", "tool_use"]
    assert whole["content"][1]["input"] == {"zone": 'c"et'}
    assert all(i.startswith("toolu_call_") is False and i.startswith("toolu_") for i in ids)
    assert whole["stop_reason"] == "tool_use"
    kinds = [e["type"] for e in message_events(*run_stream(sample, [SAMPLES[sample][1]]))[0]]
    assert kinds == ["message_start", "content_block_start", "ping", "content_block_delta",
                     "content_block_stop", "content_block_start", "content_block_delta",
                     "content_block_stop", "content_block_start", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]


def test_stop_reasons() -> None:
    def end(reason, stop=None, calls=()):
        return TurnEnd(0, reason, stop, "", "", list(calls), 1, 0)
    assert stop_reason(end("length"), None) == ("max_tokens", None)
    assert stop_reason(end("stop"), ["x"]) == ("end_turn", None)
    assert stop_reason(end("stop", "x"), ["x"]) == ("stop_sequence", "x")
    assert stop_reason(end("stop", 7), None) == ("end_turn", None)
    assert stop_reason(end("tool_calls", calls=[object()]), None) == ("tool_use", None)
    assert stop_reason(end("abort"), None) == (None, None)


def test_turn_as_chat_request_names_the_apis_fields() -> None:
    turn = ChatTurn(messages=[{"role": "user", "content": "q"},
                              {"role": "assistant", "content": "A"}],
                    tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="f",
                    parallel_tool_calls=False, max_tokens=5, temperature=0.5, top_k=3,
                    continue_final_message=True, chat_template_kwargs={"enable_thinking": True},
                    fields={"messages": "input", "tool_choice": "tool_choice"})
    body = turn.chat_request()
    assert body.tool_choice.function.name == "f" and body.parallel_tool_calls is False
    assert body.continue_final_message and not body.add_generation_prompt
    assert (body.max_tokens, body.temperature, body.top_k) == (5, 0.5, 3)
    assert body.chat_template_kwargs == {"enable_thinking": True}
    assert ChatTurn(messages=[{"role": "user", "content": "q"}]).chat_request().tool_choice is None
    bad = ChatTurn(messages=[{"role": "robot", "content": "q"}], fields={"messages": "input"})
    with pytest.raises(OpenAIError) as err:
        bad.chat_request()
    assert err.value.param == "input[0].role" and err.value.message.startswith("input[0].role")


def test_responses_items_to_chat_messages() -> None:
    items = parse_items([
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                     {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x":1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": "two"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "done", "annotations": []}]},
    ])
    assert items_to_messages(items) == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": None, "reasoning_content": "think", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"x":1}'}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "one", "name": "f"},
        {"role": "tool", "tool_call_id": "c2", "content": "two", "name": "g"},
        {"role": "assistant", "content": "done"},
    ]
    body = ResponsesRequest(input="hi", instructions="sys", max_output_tokens=5,
                            tools=[{"type": "function", "name": "f"}],
                            tool_choice={"type": "function", "name": "f"},
                            reasoning={"effort": "low"})
    turn, stored = responses_turn(body, [{"role": "user", "content": "before"}])
    assert turn.messages[0] == {"role": "system", "content": "sys"}
    assert stored == turn.messages[1:] and stored[-1] == {"role": "user", "content": "hi"}
    assert turn.tool_choice == "f" and turn.max_tokens == 5
    assert turn.tools[0]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert turn.chat_template_kwargs == {"reasoning_effort": "low"}
    with pytest.raises(OpenAIError) as err:
        parse_items([{"role": "user", "content": "x"}, {"role": "user", "content": 5}])
    assert err.value.param == "input[1].content"


def test_messages_request_to_chat() -> None:
    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 50, "system": [{"type": "text", "text": "s1"},
                                                   {"type": "text", "text": "s2"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 10}, "stop_sequences": ["\n\n"],
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "t", "signature": ""},
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "r"},
                {"type": "text", "text": "and"}, {"type": "text", "text": "more"}]},
        ]})
    turn = messages_turn(body)
    assert turn.messages == [
        {"role": "system", "content": "s1\ns2"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "calling", "reasoning_content": "t", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "r"},
        {"role": "user", "content": "and\nmore"},
    ]
    assert turn.tool_choice == "required" and not turn.parallel_tool_calls
    assert turn.stop == ["\n\n"] and not turn.continue_final_message
    assert turn.chat_template_kwargs == {"enable_thinking": True, "thinking": True}
    prefill = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 5, "tool_choice": {"type": "tool", "name": "f"},
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A"}]})
    turn = messages_turn(prefill)
    assert turn.continue_final_message and turn.tool_choice == "f"


def test_response_store_is_bounded_lru() -> None:
    store = ResponseStore(max_responses=3, max_chars=10_000)
    for i in range(3):
        store.put(f"r{i}", [{"role": "user", "content": str(i)}], {"id": f"r{i}"})
    store.get("r0")  # now the most recently used
    store.put("r3", [], {"id": "r3"})
    assert len(store) == 3
    with pytest.raises(OpenAIError) as err:
        store.get("r1")
    assert (err.value.status, err.value.param) == (400, "previous_response_id")
    assert err.value.code == "previous_response_not_found"
    with pytest.raises(OpenAIError) as err:
        store.get("r1", "response_id")
    assert err.value.status == 404
    assert store.get("r0").conversation == [{"role": "user", "content": "0"}]
    big = "x" * 6000
    store.put("big1", [{"role": "user", "content": big}], {})
    store.put("big2", [{"role": "user", "content": big}], {})
    assert store.chars <= 10_000 and len(store) <= 3
    with pytest.raises(OpenAIError):
        store.get("big1")
    store.put("huge", [{"role": "user", "content": "x" * 20_000}], {})
    with pytest.raises(OpenAIError):
        store.get("huge")
