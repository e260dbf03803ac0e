"""An agent loop sends a response's message back as the openai SDK dumps it
(`messages.append(choice.message.model_dump())`): every field OpenAI's response message has is
accepted at the value this server returns, and a refusal renders as the turn's text."""

from __future__ import annotations

import pytest
from openai.types.chat import ChatCompletionMessage
from pydantic import ValidationError

from moe_engine.server.http.chat_render import conversation
from moe_engine.server.http.protocol import ChatCompletionRequest


def _request(*assistant: dict) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}, *assistant,
                      {"role": "user", "content": "and?"}]})


def test_a_dumped_sdk_message_with_tool_calls_is_accepted_and_rendered():
    message = ChatCompletionMessage.model_validate({
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "f", "arguments": '{"a": 1}'}}],
    })
    dumped = message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= dumped.keys()
    body = _request(dumped)
    turn = conversation(body.messages)[1]
    assert turn["content"] is None
    assert turn["tool_calls"][0]["function"] == {"name": "f", "arguments": {"a": 1}}


def test_a_refusal_is_the_turns_text():
    body = _request({"role": "assistant", "content": None, "refusal": "I can't."})
    assert conversation(body.messages)[1]["content"] == "I can't."


@pytest.mark.parametrize(("message", "needle"), [
    ({"role": "assistant", "content": "x", "annotations": [{"type": "url_citation"}]},
     "annotations"),
    ({"role": "assistant", "content": "x", "audio": {"id": "a1"}}, "audio"),
    ({"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": "{}"}},
     "function_call"),
    ({"role": "user", "content": "x", "refusal": "no"}, "refusal"),
])
def test_fields_this_server_never_returns_are_refused_when_set(message, needle):
    with pytest.raises(ValidationError, match=needle):
        _request(message)
