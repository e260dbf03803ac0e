"""Accumulating one Generate call's streamed responses into its completions.

A GenerateRequest with `n` > 1 streams the responses of its n completions interleaved on one
call, each tagged with its `index`; this collects them per completion for `moe-client generate`
and `moe-client batch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from google.protobuf.json_format import MessageToDict

from moe_engine.server.pb import moe_engine_pb2 as pb


def _as_dict(message: Any) -> dict[str, Any]:
    return MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


@dataclass
class Completion:
    """One completion so far: its tokens, text, finish reason, usage and logprobs."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    usage: dict[str, Any] = field(default_factory=dict)
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    def add(self, response: pb.GenerateResponse) -> None:
        """Append one response's delta (token ids, text, logprobs) and its usage so far."""
        self.token_ids.extend(response.token_ids)
        self.text += response.text
        self.finish_reason = response.finish_reason
        self.usage = _as_dict(response.usage)
        self.logprobs.extend(_as_dict(lp) for lp in response.logprobs)

    def as_dict(self) -> dict[str, Any]:
        """`token_ids`, `text`, `finish_reason`, `usage` (and `logprobs` when there are any)."""
        data: dict[str, Any] = {
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
        }
        if self.logprobs:
            data["logprobs"] = self.logprobs
        return data


@dataclass
class Completions:
    """Every completion of one call, by index, and the call's request id."""

    request_id: str = ""
    by_index: dict[int, Completion] = field(default_factory=dict)

    def add(self, response: pb.GenerateResponse) -> Completion:
        """File one response under its completion; returns that completion."""
        self.request_id = response.request_id
        completion = self.by_index.setdefault(response.index, Completion(response.index))
        completion.add(response)
        return completion

    def as_dict(self) -> dict[str, Any]:
        """One completion: its fields at the top level, beside `request_id` (the shape of a
        request without `n`). Several: `request_id`, `completions` (a list in index order, each
        with its `index`) and `usage` summed over them (prompt tokens counted once)."""
        ordered = [self.by_index[i] for i in sorted(self.by_index)]
        if len(ordered) <= 1:
            first = ordered[0].as_dict() if ordered else Completion(0).as_dict()
            return {"request_id": self.request_id, **first}
        prompt = max(int(c.usage.get("prompt_tokens", 0)) for c in ordered)
        generated = sum(int(c.usage.get("completion_tokens", 0)) for c in ordered)
        return {
            "request_id": self.request_id,
            "completions": [{"index": c.index, **c.as_dict()} for c in ordered],
            "usage": {"prompt_tokens": prompt, "completion_tokens": generated},
        }
