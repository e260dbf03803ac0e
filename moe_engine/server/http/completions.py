"""POST /v1/completions (OpenAI's legacy Completions API), whole or streamed.

Each prompt is one engine request with `n` completions; choice index = prompt index * n +
completion index. `logprobs` is OpenAI's legacy object (tokens, token_logprobs, top_logprobs,
text_offset). `echo` puts the prompt's text before each choice's text.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from moe_engine.core.detokenizer import TokenTexts
from moe_engine.core.validation import truncate_prompt
from moe_engine.server.http.common import (
    SSE_DONE,
    Choice,
    routed_experts_json,
    sampling_params,
    sse,
    token_text,
    usage,
    version_fields,
    with_error_event,
)
from moe_engine.server.http.errors import OpenAIError
from moe_engine.server.http.protocol import CompletionRequest
from moe_engine.server.http.state import HttpState, PromptStreams


def parse_prompts(state: HttpState, prompt: Any) -> tuple[list[list[int]], list[str | None]]:
    """The prompts as token ids, with their texts (None for an id prompt).

    Raises:
        OpenAIError: 400 for an empty list.
        RequestError: text without a tokenizer.
    """
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise OpenAIError(400, "prompt: must not be an empty list", "prompt", "invalid_value")
    if state.tokenizer is None and any(isinstance(p, str) for p in items):
        raise OpenAIError(
            400, "prompt: the served model has no tokenizer (its folder has no tokenizer "
            "files), so a text prompt cannot be tokenized; send token ids (a list of integers) "
            "or start the server with --tokenizer PATH", "prompt", "unsupported_value",
        )
    ids = [state.engine.encode(p) if isinstance(p, str) else list(p) for p in items]
    return ids, [p if isinstance(p, str) else None for p in items]


def _echo_text(state: HttpState, text: str | None, ids: list[int]) -> str:
    if text is not None:
        return text
    return state.tokenizer.decode(ids) if state.tokenizer is not None else ""


def legacy_logprobs(
    state: HttpState, choice: Choice, start: int, pieces: list[str], offset: int
) -> dict[str, Any]:
    """OpenAI's legacy logprobs of `choice.logprobs[start:]`.

    Args:
        pieces: those tokens' shares of the text (`TokenPieces`): `tokens`, so that the
            tokens concatenate to the text.
        offset: where the first of them starts in the choice's text (characters, the echoed
            prompt included); `text_offset` counts on from it.
    """
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for (_, lp, top), piece in zip(choice.logprobs[start:], pieces, strict=False):
        tokens.append(piece)
        token_logprobs.append(lp)
        best: dict[str, float] = {}
        for t, v in sorted(top.items(), key=lambda kv: -kv[1]):
            best.setdefault(token_text(state.tokenizer, t), v)  # texts may repeat: keep the top
        top_logprobs.append(best)
        text_offset.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs, "text_offset": text_offset}


class TokenPieces:
    """Each generated token's text for the legacy logprobs: its share of the decoded text
    (`core.detokenizer.TokenTexts`: a token that ends inside a character gets "", the one
    that completes it the whole character), or "token_id:<id>" without a tokenizer.

    The pieces concatenate to the text the engine decoded from the same ids, so `text_offset`
    (their running length) points into the returned text; after a stop string cut that text,
    the offsets of the tokens past the cut point past its end.
    """

    def __init__(self, state: HttpState, skip_special_tokens: bool) -> None:
        tok = state.tokenizer
        self._texts = TokenTexts(tok, skip_special_tokens) if tok is not None else None

    def add(self, token_ids: list[int], final: bool) -> list[str]:
        """The pieces of the next `token_ids`; `final`: they end the choice."""
        if self._texts is None:
            return [f"token_id:{t}" for t in token_ids]
        pieces = self._texts.add(token_ids)
        if final and pieces:
            pieces[-1] += self._texts.finish()
        return pieces


async def create_completion(state: HttpState, body: CompletionRequest):
    """The route's work: a JSONResponse, or a StreamingResponse of SSE chunks.

    Raises:
        OpenAIError / RequestError: the HTTP error (400, 404, 429, 503) before any output.
    """
    state.check_ready()
    state.check_model(body.model)
    if body.echo and body.logprobs is not None:
        raise OpenAIError(
            400, "echo with logprobs needs prompt logprobs, which this server does not "
            "compute; drop one of them", "echo", "unsupported_value",
        )
    prompts, texts = parse_prompts(state, body.prompt)
    prompts = [truncate_prompt(p, body.truncate_prompt_tokens, state.max_model_len())
               for p in prompts]  # fmt: skip
    shortest_room = state.max_model_len() - max(len(p) for p in prompts)
    max_tokens = body.max_tokens if body.max_tokens is not None else max(1, shortest_room)
    params = sampling_params(body, max_tokens, body.logprobs)
    for p in prompts:
        state.check_request(p, params, "prompt")
    echo = [_echo_text(state, t, p) if body.echo else "" for t, p in zip(texts, prompts,
                                                                          strict=True)]
    streams = await state.open_streams(prompts, params, "cmpl")
    meta = {"id": streams.request_id, "created": int(time.time()), "model": state.served_model_name}
    prompt_tokens = sum(len(p) for p in prompts)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        gen = _stream(state, streams, meta, body, echo, prompt_tokens, include_usage)
        return StreamingResponse(with_error_event(gen), media_type="text/event-stream")
    try:
        choices = await _collect(streams, body.n, len(prompts))
    finally:
        await streams.close()
    out = []
    for c in choices:
        prefix = echo[c.index // body.n]
        entry = {"index": c.index, "text": prefix + c.text, "logprobs": None,
                 "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                 "weight_version": c.weight_version}
        entry.update(version_fields(c))
        if body.logprobs is not None:
            pieces = TokenPieces(state, body.skip_special_tokens).add(c.token_ids, final=True)
            entry["logprobs"] = legacy_logprobs(state, c, 0, pieces, len(prefix))
        if body.return_token_ids:
            entry["token_ids"] = c.token_ids
        if body.return_routed_experts:
            entry.update(routed_experts_json(c))
        out.append(entry)
    completion_tokens = sum(c.num_output_tokens for c in choices)
    return JSONResponse({**meta, "object": "text_completion", "choices": out,
                         "usage": usage(prompt_tokens, completion_tokens)})


async def _collect(streams: PromptStreams, n: int, num_prompts: int) -> list[Choice]:
    choices = [Choice(i) for i in range(n * num_prompts)]
    async for batch in streams.outputs():
        for prompt_index, out in batch:
            choices[prompt_index * n + out.index].add(out)
    return choices


async def _stream(
    state: HttpState, streams: PromptStreams, meta: dict[str, Any], body: CompletionRequest,
    echo: list[str], prompt_tokens: int, include_usage: bool,
) -> AsyncIterator[bytes]:
    """SSE chunks, one per engine output (each step's, or every `--stream-interval` tokens; a
    chunk holds every choice that output advanced)."""
    n = body.n
    choices = [Choice(i) for i in range(n * len(echo))]
    pieces = [TokenPieces(state, body.skip_special_tokens) for _ in choices]
    #: Per choice: where its next token's text starts (characters, the echo included).
    offsets = [0] * len(choices)
    echoed = [False] * len(choices)
    try:
        async for batch in streams.outputs():
            entries = []
            for prompt_index, out in batch:
                c = choices[prompt_index * n + out.index]
                start = len(c.logprobs)
                prefix = "" if echoed[c.index] else echo[prompt_index]
                echoed[c.index] = True
                c.add(out)
                text = prefix + out.new_text
                entry = {"index": c.index, "text": text, "logprobs": None,
                         "finish_reason": c.finish_reason if out.finished else None,
                         "stop_reason": c.stop_reason if out.finished else None,
                         "weight_version": c.weight_version}
                if out.finished:
                    entry.update(version_fields(c))
                offsets[c.index] += len(prefix)
                if body.logprobs is not None:
                    new = pieces[c.index].add(out.new_token_ids, out.finished)
                    entry["logprobs"] = legacy_logprobs(state, c, start, new, offsets[c.index])
                    offsets[c.index] += sum(map(len, new))
                if body.return_routed_experts and out.finished:
                    entry.update(routed_experts_json(c))
                entries.append(entry)
            yield sse({**meta, "object": "text_completion", "choices": entries})
        if include_usage:
            completion_tokens = sum(c.num_output_tokens for c in choices)
            yield sse({**meta, "object": "text_completion", "choices": [],
                       "usage": usage(prompt_tokens, completion_tokens)})
        yield SSE_DONE
    finally:
        await streams.close()
