"""Accumulating one Generate call's streamed responses into its completions.

A GenerateRequest with `n` > 1 streams the responses of its n completions interleaved on one
call, each tagged with its `index`; this collects them per completion for `moe-client generate`
and `moe-client batch`.
"""

from __future__ import annotations

import base64
import struct
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
    #: Routing replay (the finished response's raw int32 bytes and [tokens, layers, top_k]).
    routed_experts: bytes = b""
    routed_experts_shape: list[int] = field(default_factory=list)
    #: Which weights computed it (the latest response's version; the finished response's spans).
    weight_version: str = ""
    weight_versions: list[dict[str, Any]] = field(default_factory=list)
    kv_from_other_weights: bool = False

    def add(self, response: pb.GenerateResponse) -> None:
        """Append one response's delta (token ids, text, logprobs) and its usage so far."""
        self.token_ids.extend(response.token_ids)
        self.text += response.text
        self.finish_reason = response.finish_reason
        self.usage = _as_dict(response.usage)
        self.logprobs.extend(_as_dict(lp) for lp in response.logprobs)
        if response.routed_experts_shape:
            self.routed_experts = response.routed_experts
            self.routed_experts_shape = list(response.routed_experts_shape)
        self.weight_version = response.weight_version
        if response.weight_versions:
            self.weight_versions = [{"weight_version": v.weight_version, "start": v.start}
                                    for v in response.weight_versions]
        self.kv_from_other_weights = self.kv_from_other_weights or response.kv_from_other_weights

    def as_dict(self) -> dict[str, Any]:
        """`token_ids`, `text`, `finish_reason`, `usage`, the weight labels (`weight_version`,
        `weight_versions`, `kv_from_other_weights`, as the HTTP API gives them) (and `logprobs`
        when there are any;
        `routed_experts`, base64 as the HTTP API gives it, and `routed_experts_shape` when
        the server returned them)."""
        data: dict[str, Any] = {
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            "weight_version": self.weight_version,
            "weight_versions": self.weight_versions,
            "kv_from_other_weights": self.kv_from_other_weights,
        }
        if self.logprobs:
            data["logprobs"] = self.logprobs
        if self.routed_experts_shape:
            data["routed_experts"] = base64.b64encode(self.routed_experts).decode("ascii")
            data["routed_experts_shape"] = self.routed_experts_shape
        return data

    def routed_rows(self, count: int) -> list[list[list[int]]]:
        """The first `count` tokens' routed experts, [token][moe layer][k] expert ids."""
        if len(self.routed_experts_shape) != 3:
            return []
        tokens, layers, top_k = self.routed_experts_shape
        row = layers * top_k
        n = min(count, tokens) * row
        values = struct.unpack(f"<{n}i", self.routed_experts[: 4 * n])  # little-endian int32
        return [[list(values[t * row + layer * top_k: t * row + (layer + 1) * top_k])
                 for layer in range(layers)] for t in range(n // row if row else 0)]


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

    def routed_lines(self, rows: int = 4) -> list[str]:
        """Each completion's routed-experts shape and its first `rows` tokens' expert ids, as
        `moe-client generate --return-routed-experts` prints them ("[i] " first with several
        completions); none when no completion has them."""
        several = len(self.by_index) > 1
        lines = []
        for index in sorted(self.by_index):
            c = self.by_index[index]
            if not c.routed_experts_shape:
                continue
            tag = f"[{index}] " if several else ""
            tokens, layers, top_k = c.routed_experts_shape
            lines.append(f"{tag}routed_experts: {tokens} tokens x {layers} MoE layers x "
                         f"top-{top_k}")
            lines += [f"{tag}  token {t}: {row}" for t, row in enumerate(c.routed_rows(rows))]
            if tokens > rows:
                lines.append(f"{tag}  ... {tokens - rows} more tokens (--json: all, base64)")
        return lines
