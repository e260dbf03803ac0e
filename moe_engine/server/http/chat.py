"""POST /v1/chat/completions (OpenAI's Chat Completions API), whole or streamed.

The messages go through the tokenizer's chat template (`apply_chat_template`, rendered to text,
then tokenized without added special tokens, as vLLM and `LLM.chat` do). Without
`max_tokens` / `max_completion_tokens` a reply may fill the rest of the context (vLLM's
default). A stream sends the role first, then one chunk per engine output (each step's, or
every `--stream-interval` tokens).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from moe_engine.core.validation import truncate_prompt
from moe_engine.sampling_params import MAX_LOGPROBS
from moe_engine.server.http.common import (
    SSE_DONE,
    Choice,
    sampling_params,
    sse,
    structured_outputs_from,
    token_text,
    usage,
)
from moe_engine.server.http.errors import OpenAIError
from moe_engine.server.http.protocol import ChatCompletionRequest, ChatMessage
from moe_engine.server.http.state import HttpState, PromptStreams


def render_chat(
    state: HttpState, messages: list[ChatMessage], add_generation_prompt: bool = True
) -> list[int]:
    """The conversation through the chat template, as token ids.

    Raises:
        OpenAIError: 400 ("messages") without a tokenizer or a chat template, or when the
            template refuses the conversation.
    """
    tok = state.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        what = "no tokenizer" if tok is None else "a tokenizer without a chat template"
        raise OpenAIError(
            400, f"messages: the served model has {what}; use /v1/completions with a prompt",
            "messages", "unsupported_value",
        )
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        text = tok.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as exc:  # noqa: BLE001 - jinja's errors (TemplateError, raise_exception)
        raise OpenAIError(
            400, f"messages: the chat template refused them: {exc}", "messages", "invalid_value"
        ) from exc
    return list(tok.encode(text, add_special_tokens=False))


def chat_logprobs(state: HttpState, choice: Choice, start: int, top: int) -> dict[str, Any]:
    """OpenAI's chat logprobs of `choice.logprobs[start:]`, `top` alternatives per token.

    `token` is the token decoded alone (vLLM's choice: U+FFFD for a token that holds part of a
    character); `bytes` are the token's own bytes from the vocabulary, so the `bytes` of the
    tokens concatenate to the UTF-8 of the text (OpenAI: "useful in instances where characters
    are represented by multiple tokens and their byte representations must be combined").
    """
    content = []
    for tok, lp, alternatives in choice.logprobs[start:]:
        best = sorted(alternatives.items(), key=lambda kv: -kv[1])[:top]
        content.append({
            **_token_entry(state, tok), "logprob": lp,
            "top_logprobs": [{**_token_entry(state, i), "logprob": v} for i, v in best],
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
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError(400, "top_logprobs: needs logprobs true", "top_logprobs",
                          "invalid_value")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise OpenAIError(
            400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}",
            "top_logprobs", "invalid_value",
        )
    structured = structured_outputs_from(body)
    prompt = render_chat(state, body.messages, body.add_generation_prompt)
    prompt = truncate_prompt(prompt, body.truncate_prompt_tokens, state.max_model_len())
    max_tokens = body.max_completion_tokens or body.max_tokens
    field_name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    if max_tokens is None:
        max_tokens = max(1, state.max_model_len() - len(prompt))
    top = body.top_logprobs or 0
    params = sampling_params(body, max_tokens, top if body.logprobs else None, structured)
    try:
        state.check_request(prompt, params, "messages")
    except Exception as exc:
        if getattr(exc, "field", None) == "max_tokens":
            exc.field = field_name
        raise
    streams = await state.open_streams([prompt], params, "chatcmpl")
    meta = {"id": streams.request_id, "created": int(time.time()), "model": state.served_model_name}
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        gen = _stream(state, streams, meta, body, len(prompt), include_usage)
        return StreamingResponse(gen, media_type="text/event-stream")
    choices = [Choice(i) for i in range(body.n)]
    try:
        async for batch in streams.outputs():
            for _, out in batch:
                choices[out.index].add(out)
    finally:
        await streams.close()
    out = []
    for c in choices:
        entry = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                 "logprobs": None, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                 "weight_version": c.weight_version}
        if body.logprobs:
            entry["logprobs"] = chat_logprobs(state, c, 0, top)
        if body.return_token_ids:
            entry["token_ids"] = c.token_ids
        out.append(entry)
    completion_tokens = sum(c.num_output_tokens for c in choices)
    return JSONResponse({**meta, "object": "chat.completion", "choices": out,
                         "usage": usage(len(prompt), completion_tokens)})


async def _stream(
    state: HttpState, streams: PromptStreams, meta: dict[str, Any], body: ChatCompletionRequest,
    prompt_tokens: int, include_usage: bool,
) -> AsyncIterator[bytes]:
    """SSE chunks: the role of every choice first, then one chunk per engine output."""
    chunk = {**meta, "object": "chat.completion.chunk"}
    choices = [Choice(i) for i in range(body.n)]
    top = body.top_logprobs or 0
    try:
        yield sse({**chunk, "choices": [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None} for i in range(body.n)
        ]})
        async for batch in streams.outputs():
            entries = []
            for _, out in batch:
                c = choices[out.index]
                start = len(c.logprobs)
                c.add(out)
                entry = {"index": c.index, "delta": {"content": out.new_text},
                         "logprobs": chat_logprobs(state, c, start, top) if body.logprobs else None,
                         "finish_reason": c.finish_reason if out.finished else None,
                         "weight_version": c.weight_version}
                entries.append(entry)
            yield sse({**chunk, "choices": entries})
        if include_usage:
            completion_tokens = sum(c.num_output_tokens for c in choices)
            yield sse({**chunk, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
        yield SSE_DONE
    finally:
        await streams.close()
