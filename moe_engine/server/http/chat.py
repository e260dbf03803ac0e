"""POST /v1/chat/completions (OpenAI's Chat Completions API), whole or streamed.

The messages (and `tools`) go through the chat template (`chat_render`: `--chat-template` or
the tokenizer's, rendered to text, then tokenized without added special tokens, as vLLM and
`LLM.chat` do). Without `max_tokens` / `max_completion_tokens` a reply may fill the rest of the
context (vLLM's default). `tool_choice` decides what is enforced and parsed (`chat_tools`); a
reasoning parser (`--reasoning-parser`) splits `reasoning_content` off the answer
(`chat_output`). Each choice's text goes through one `parsers.base.OutputStream`, fed on the
event loop once per engine output (linear parsers, no per-token work besides), so a stream
sends the same content, reasoning and calls as the whole response. A stream sends the role
first, then one chunk per engine output (each step's, or every `--stream-interval` tokens).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from moe_engine.sampling_params import MAX_LOGPROBS
from moe_engine.server.http.chat_output import ChoiceParse, delta_json
from moe_engine.server.http.chat_prepare import prepare_chat, submit_chat
from moe_engine.server.http.chat_render import render_text
from moe_engine.server.http.common import (
    SSE_DONE,
    Choice,
    routed_experts_json,
    sse,
    token_text,
    usage,
    version_fields,
    with_error_event,
)
from moe_engine.server.http.errors import OpenAIError
from moe_engine.server.http.protocol import ChatCompletionRequest, ChatMessage, ChatTool
from moe_engine.server.http.state import HttpState, PromptStreams


def render_chat(
    state: HttpState, messages: list[ChatMessage], add_generation_prompt: bool = True, *,
    tools: list[ChatTool] | None = None, continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The conversation through the chat template, as token ids (`chat_render.render_text`).

    Raises:
        OpenAIError: 400 ("messages") without a tokenizer or a chat template, when the
            template refuses the conversation, or a bad template field.
    """
    text = render_text(state.tokenizer, state.chat.chat_template, messages, tools,
                       add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message,
                       chat_template_kwargs=chat_template_kwargs)
    return list(state.tokenizer.encode(text, add_special_tokens=False))


#: The floor of a returned logprob: a token a grammar masks has -inf, which JSON cannot carry
#: (vLLM clamps to the same value).
MIN_LOGPROB = -9999.0


def chat_logprobs(state: HttpState, choice: Choice, start: int, top: int) -> dict[str, Any]:
    """OpenAI's chat logprobs of `choice.logprobs[start:]`, `top` alternatives per token
    (logprobs below MIN_LOGPROB, e.g. a structured output's masked tokens, are MIN_LOGPROB).

    `token` is the token decoded alone (vLLM's choice: U+FFFD for a token that holds part of a
    character); `bytes` are the token's own bytes from the vocabulary, so the `bytes` of the
    tokens concatenate to the UTF-8 of the text (OpenAI: "useful in instances where characters
    are represented by multiple tokens and their byte representations must be combined").
    """
    content = []
    for tok, lp, alternatives in choice.logprobs[start:]:
        best = sorted(alternatives.items(), key=lambda kv: -kv[1])[:top]
        content.append({
            **_token_entry(state, tok), "logprob": max(lp, MIN_LOGPROB),
            "top_logprobs": [{**_token_entry(state, i), "logprob": max(v, MIN_LOGPROB)}
                             for i, v in best],
        })
    return {"content": content}


def _token_entry(state: HttpState, token_id: int) -> dict[str, Any]:
    """`token` and `bytes` of one token (the text's UTF-8 without a tokenizer)."""
    text = token_text(state.tokenizer, token_id)
    own = state.token_bytes(token_id)
    return {"token": text, "bytes": list(own if own is not None else text.encode())}


async def create_chat_completion(state: HttpState, body: ChatCompletionRequest):
    """The route's work: a JSONResponse, or a StreamingResponse of SSE chunks.

    Raises:
        OpenAIError / RequestError: the HTTP error (400, 404, 429, 503) before any output.
    """
    state.check_ready()
    state.check_model(body.model)
    _check_logprobs(body)
    top = body.top_logprobs or 0
    prep = prepare_chat(state, body, top if body.logprobs else None)
    streams = await submit_chat(state, prep, "chatcmpl")
    meta = {"id": streams.request_id, "created": int(time.time()), "model": state.served_model_name}
    prompt = prep.prompt
    parses = [prep.new_parse(state) if prep.parses else None for _ in range(body.n)]
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        gen = _stream(state, streams, meta, body, len(prompt), include_usage, parses)
        return StreamingResponse(with_error_event(gen), media_type="text/event-stream")
    return await _whole(state, streams, meta, body, len(prompt), parses)


def _check_logprobs(body: ChatCompletionRequest) -> None:
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError(400, "top_logprobs: needs logprobs true", "top_logprobs",
                          "invalid_value")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise OpenAIError(
            400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}",
            "top_logprobs", "invalid_value",
        )


def chat_usage(prompt_tokens: int, choices: list[Choice],
               parses: list[ChoiceParse | None]) -> dict[str, Any]:
    """`usage`, always with `completion_tokens_details.reasoning_tokens` (0 where no reasoning
    parser ran: `--reasoning-parser none`, or a required/named tool choice's JSON output), so
    every chat response has one shape: OpenAI's Chat Completions `usage` always carries
    `completion_tokens_details` (the openai SDK's `CompletionUsage`)."""
    out: dict[str, Any] = usage(prompt_tokens, sum(c.num_output_tokens for c in choices))
    out["completion_tokens_details"] = {"reasoning_tokens": sum(
        p.reasoning_tokens(c.token_ids) for c, p in zip(choices, parses, strict=True)
        if p is not None and p.has_reasoning)}
    return out


async def _whole(
    state: HttpState, streams: PromptStreams, meta: dict[str, Any], body: ChatCompletionRequest,
    prompt_tokens: int, parses: list[ChoiceParse | None],
) -> JSONResponse:
    choices = [Choice(i) for i in range(body.n)]
    try:
        async for batch in streams.outputs():
            for _, out in batch:
                choices[out.index].add(out)
                if (parse := parses[out.index]) is not None:
                    parse.feed(out)
    finally:
        await streams.close()
    out = []
    for c, parse in zip(choices, parses, strict=True):
        message = {"role": "assistant", "content": c.text} if parse is None else parse.message()
        reason = c.finish_reason if parse is None else parse.finish_reason(c.finish_reason)
        entry = {"index": c.index, "message": message, "logprobs": None, "finish_reason": reason,
                 "stop_reason": c.stop_reason, "weight_version": c.weight_version}
        entry.update(version_fields(c))
        if body.logprobs:
            entry["logprobs"] = chat_logprobs(state, c, 0, body.top_logprobs or 0)
        if body.return_token_ids:
            entry["token_ids"] = c.token_ids
        if body.return_routed_experts:
            entry.update(routed_experts_json(c))
        out.append(entry)
    return JSONResponse({**meta, "object": "chat.completion", "choices": out,
                         "usage": chat_usage(prompt_tokens, choices, parses)})


async def _stream(
    state: HttpState, streams: PromptStreams, meta: dict[str, Any], body: ChatCompletionRequest,
    prompt_tokens: int, include_usage: bool, parses: list[ChoiceParse | None],
) -> AsyncIterator[bytes]:
    """SSE chunks: the role of every choice first, then one chunk per engine output (a step
    whose text the parsers still hold back sends nothing unless it has logprobs or ends)."""
    chunk = {**meta, "object": "chat.completion.chunk"}
    choices = [Choice(i) for i in range(body.n)]
    top = body.top_logprobs or 0
    try:
        yield sse({**chunk, "choices": [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None, "stop_reason": None} for i in range(body.n)
        ]})
        async for batch in streams.outputs():
            entries = []
            for _, out in batch:
                c, parse = choices[out.index], parses[out.index]
                start = len(c.logprobs)
                c.add(out)
                if parse is None:
                    delta, reason = {"content": out.new_text}, c.finish_reason
                else:
                    delta, reason = delta_json(parse.feed(out)), parse.finish_reason(
                        c.finish_reason)
                    if not (delta or out.finished or (body.logprobs and out.new_token_ids)):
                        continue
                entry = {
                    "index": c.index, "delta": delta,
                    "logprobs": chat_logprobs(state, c, start, top) if body.logprobs else None,
                    "finish_reason": reason if out.finished else None,
                    "stop_reason": c.stop_reason if out.finished else None,
                    "weight_version": c.weight_version,
                    **(version_fields(c) if out.finished else {})}
                if body.return_routed_experts and out.finished:
                    entry.update(routed_experts_json(c))
                entries.append(entry)
            if entries:
                yield sse({**chunk, "choices": entries})
        if include_usage:
            yield sse({**chunk, "choices": [],
                       "usage": chat_usage(prompt_tokens, choices, parses)})
        yield SSE_DONE
    finally:
        await streams.close()
