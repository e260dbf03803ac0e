"""What completions and chat share: SamplingParams from a body, choices' bookkeeping, usage,
token strings, and Server-Sent Events.

Streams are SSE (https://html.spec.whatwg.org/multipage/server-sent-events.html) as OpenAI's:
`data: <json>\\n\\n` per chunk and `data: [DONE]\\n\\n` at the end.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from moe_engine.core.outputs import EngineCoreOutput
from moe_engine.core.validation import param_error
from moe_engine.errors import ParamError, RequestError
from moe_engine.sampling_params import (
    OUTPUT_DELTA,
    OUTPUT_FINAL_ONLY,
    SamplingParams,
    StructuredOutputsParams,
)
from moe_engine.server.http.errors import OpenAIError, error_body
from moe_engine.server.http.protocol import NEUTRAL, ChatCompletionRequest, CompletionRequest

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    """One SSE event carrying `payload` as JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def with_error_event(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`chunks`, and if the engine fails after the stream started (a rank died, the engine
    core went down: a `RequestError` from the request's outputs), one last event carrying the
    error in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`, as vLLM's
    server streams an error it meets mid-stream) and `[DONE]`, instead of a connection cut
    without a word (the status line, 200, is already sent)."""
    try:
        async for chunk in chunks:
            yield chunk
    except RequestError as exc:
        error = OpenAIError.from_request_error(exc)
        yield sse(error_body(error.status, error.message, error.param, error.code))
        yield SSE_DONE


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: int | None,
    structured_outputs: Any = None,
) -> SamplingParams:
    """SamplingParams from a body (OpenAI's defaults: temperature 1, top_p 1); a body that does
    not stream asks for final-only outputs.

    Raises:
        OpenAIError: 400 for a field of a feature not implemented here at a value other than
            its neutral one (`protocol.NEUTRAL`), or stream_options without stream.
        RequestError: INVALID_ARGUMENT naming the field SamplingParams refused.
    """
    for name, allowed in NEUTRAL.items():
        value = getattr(body, name, None)
        if value not in allowed:
            shown = ", ".join(json.dumps(a) for a in allowed if a is not None)
            raise OpenAIError(
                400, f"{name}: this server supports only {shown}, got {json.dumps(value)}",
                name, "unsupported_value",
            )
    if body.stream_options is not None and not body.stream:
        raise OpenAIError(
            400, "stream_options: only allowed when stream is true", "stream_options",
            "invalid_value",
        )
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens, "min_tokens": body.min_tokens, "n": body.n,
        "seed": body.seed, "stop": body.stop, "stop_token_ids": body.stop_token_ids,
        "ignore_eos": body.ignore_eos, "logprobs": logprobs,
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "skip_special_tokens": body.skip_special_tokens,
        "return_routed_experts": body.return_routed_experts,
        # A whole response needs one output per choice, not one per step (as vLLM's server).
        "output_kind": OUTPUT_DELTA if body.stream else OUTPUT_FINAL_ONLY,
    }
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name) is not None:
            kwargs[name] = getattr(body, name)
    kwargs.update(processor_kwargs(body))
    if structured_outputs is not None:
        kwargs["structured_outputs"] = structured_outputs
    try:
        return SamplingParams(**kwargs)
    except ParamError as exc:
        raise param_error(exc) from exc


def processor_kwargs(body: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """The logits-processor, truncation and priority fields of a body as SamplingParams
    keywords; `logit_bias` keys (token ids as strings, as OpenAI sends them) become ints.

    Raises:
        OpenAIError: 400 "logit_bias" for a key that is not an integer token id.
    """
    bias: dict[int, Any] | None = None
    if body.logit_bias:
        bias = {}
        for key, value in body.logit_bias.items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise OpenAIError(
                    400, f"logit_bias: key {key!r} is not a token id (an integer as a string)",
                    "logit_bias", "invalid_value",
                ) from None
    return {
        "repetition_penalty": body.repetition_penalty, "min_p": body.min_p,
        "frequency_penalty": body.frequency_penalty, "presence_penalty": body.presence_penalty,
        "logit_bias": bias, "truncate_prompt_tokens": body.truncate_prompt_tokens,
        "priority": body.priority,
    }


def structured_outputs_from(body: ChatCompletionRequest) -> Any:
    """`response_format` as `StructuredOutputsParams` (None for text or none).

    Raises:
        OpenAIError: 400 when json_schema comes without a schema.
        ParamError: a schema that is not a JSON object (`StructuredOutputsParams`; HTTP 400).
    """
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise OpenAIError(
            400, "response_format: type json_schema needs json_schema.schema (a JSON schema)",
            "response_format", "invalid_value",
        )
    return StructuredOutputsParams(json=json.dumps(fmt.json_schema.schema_))


def token_text(tokenizer: Any | None, token_id: int) -> str:
    """One token's text, or "token_id:<id>" without a tokenizer (vLLM's convention)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def finish_reason(out: EngineCoreOutput) -> str | None:
    """OpenAI's finish_reason ("stop", "length"; "abort" when the server aborted it)."""
    return str(out.finish_reason) if out.finished and out.finish_reason is not None else None


@dataclass
class Choice:
    """One choice being assembled: its text, ids, logprobs and end."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, float, dict[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: int = 0
    stop_reason: int | str | None = None
    #: The weights that computed the latest tokens (an extension field of each choice, as
    #: SGLang's meta_info carries it for RL rollouts).
    weight_version: str = ""
    #: Routing replay, from the finished output: raw int32 bytes and their shape
    #: [tokens, moe_layers, top_k] (`EngineCoreOutput.routed_experts`); None before.
    routed_experts: bytes | None = None
    routed_experts_shape: tuple[int, int, int] | None = None
    #: Once finished: every version that computed its tokens, with the token index each
    #: begins at, and whether K/V of other weights was read (`version_fields`).
    weight_versions: list[tuple[str, int]] = field(default_factory=list)
    kv_from_other_weights: bool = False

    def add(self, out: EngineCoreOutput) -> None:
        self.text += out.new_text
        self.weight_version = out.weight_version
        if out.weight_versions is not None:
            self.weight_versions = list(out.weight_versions)
        self.kv_from_other_weights = self.kv_from_other_weights or out.kv_from_other_weights
        self.token_ids += out.new_token_ids
        if out.logprobs:
            for tok, (lp, top) in zip(out.new_token_ids, out.logprobs, strict=False):
                self.logprobs.append((tok, lp, top))
        self.num_output_tokens = out.num_output_tokens
        if out.finished:
            self.finish_reason = finish_reason(out)
            self.stop_reason = out.stop_reason
            self.routed_experts = out.routed_experts
            self.routed_experts_shape = out.routed_experts_shape


def routed_experts_json(choice: Choice) -> dict[str, Any]:
    """A finished choice's routing replay, for a body with `return_routed_experts`:
    `routed_experts`, the base64 (RFC 4648, padded) of the raw little-endian int32 expert ids,
    and `routed_experts_shape` [tokens, moe_layers, top_k] (tokens = prompt + output - 1: the
    positions the model ran); both null when the engine returned none (a choice aborted
    before it ran). Decode: `np.frombuffer(base64.b64decode(s), "<i4").reshape(shape)`.

    The encoding is SGLang's: its detokenizer base64-encodes the int32 array's bytes
    (python/sglang/srt/managers/detokenizer_manager.py, `_extract_routed_experts`), and its
    OpenAI server returns that string as the response's `sglext.routed_experts`, one per
    request (the first choice's; entrypoints/openai/serving_completions.py). vLLM puts
    `routed_experts` on each choice instead (entrypoints/openai/protocol.py,
    `CompletionResponseChoice`; base64 of `.npy` bytes). Here each choice carries its own
    (vLLM's place, so that n > 1 keeps every completion's) in SGLang's encoding, with the
    shape beside it since raw bytes do not carry one.
    """
    data = choice.routed_experts
    shape = choice.routed_experts_shape
    return {"routed_experts": base64.b64encode(data).decode("ascii") if data is not None
            else None, "routed_experts_shape": list(shape) if shape is not None else None}


def version_fields(choice: Choice) -> dict[str, Any]:
    """A finished choice's weight labels (extension fields beside `weight_version`):
    `weight_versions` [{"weight_version": v, "start": output-token index}, ...] and
    `kv_from_other_weights` (`EngineCoreOutput`)."""
    return {"weight_versions": [{"weight_version": v, "start": i}
                                for v, i in choice.weight_versions],
            "kv_from_other_weights": choice.kv_from_other_weights}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
