"""Chat responses through the official `openai` client, whole and streamed, in one shape, so
tests compare a stream with its whole response (tests/test_http_tools.py,
tests/test_http_tool_families.py)."""

from __future__ import annotations

from typing import Any

import openai


def streamed(client: openai.OpenAI, **kwargs: Any) -> dict[str, Any]:
    """A stream's chunks added up per choice: content, reasoning, calls (from their deltas),
    finish reason; also checks the deltas' shape (id, type and name only on a call's first)."""
    out: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            acc = out.setdefault(ch.index, {"content": "", "reasoning": "", "calls": [],
                                            "finish_reason": None})
            delta = ch.delta.model_dump()
            acc["content"] += delta.get("content") or ""
            acc["reasoning"] += delta.get("reasoning_content") or ""
            assert delta.get("reasoning_content") == delta.get("reasoning")
            for tc in delta.get("tool_calls") or []:
                if tc["index"] == len(acc["calls"]):
                    assert tc["id"] and tc["type"] == "function" and tc["function"]["name"]
                    assert tc["function"]["arguments"] == ""
                    acc["calls"].append({"id": tc["id"], "name": tc["function"]["name"],
                                         "arguments": ""})
                else:
                    assert tc["index"] == len(acc["calls"]) - 1 and tc.get("id") is None
                    acc["calls"][tc["index"]]["arguments"] += tc["function"]["arguments"]
            if ch.finish_reason is not None:
                acc["finish_reason"] = ch.finish_reason
    return {"choices": [out[i] for i in sorted(out)], "usage": usage}


def whole(client: openai.OpenAI, **kwargs: Any) -> dict[str, Any]:
    """A whole response in `streamed`'s shape (call ids kept)."""
    resp = client.chat.completions.create(**kwargs)
    choices = []
    for ch in resp.choices:
        m = ch.message.model_dump()
        choices.append({
            "content": m["content"] or "", "reasoning": m.get("reasoning_content") or "",
            "calls": [{"id": c["id"], "name": c["function"]["name"],
                       "arguments": c["function"]["arguments"]} for c in m["tool_calls"] or []],
            "finish_reason": ch.finish_reason})
    return {"choices": choices, "usage": resp.usage, "raw": resp}


def same_calls(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Equal but for the call ids (fresh per response)."""
    def strip(r):
        return [{**c, "calls": [{k: v for k, v in x.items() if k != "id"} for x in c["calls"]]}
                for c in r["choices"]]
    assert strip(a) == strip(b)
