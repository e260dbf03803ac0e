"""bench/serve.py's HTTP side: the same requests as streamed OpenAI `POST /v1/completions`.

Each request is sent as token ids (`prompt`: the ids), greedy, `max_tokens = min_tokens` = its
output length, `ignore_eos`, `stream: true` with `stream_options.include_usage`, and read as
Server-Sent Events (`data: {...}` lines up to `data: [DONE]`, the OpenAI streaming format).
A chunk with a choice counts as one arrival carrying tokens (the server sends at most one per
engine step); the final usage chunk gives the exact output token count. A non-200 answer or a
broken stream is a failure named `HTTP <status>` (or the transport error's class), with the
OpenAI error message.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from serve import Chunk, ServeRequest, StreamFn, TargetError


def http_stream(client: Any, model: str) -> StreamFn:
    """Stream requests to `client` (an `httpx.AsyncClient` on the server's HTTP port) as
    `model`'s completions."""

    async def stream(req: ServeRequest) -> AsyncIterator[Chunk]:
        body = {
            "model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len,
            "min_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
        }
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    raise TargetError(f"HTTP {response.status_code}", _message(text))
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise TargetError("STREAM_ERROR", _message(data))
                    usage = event.get("usage")
                    if event.get("choices"):
                        yield Chunk(1)
                    if usage:
                        yield Chunk(0, usage["completion_tokens"])
        except TargetError:
            raise
        except Exception as err:  # transport errors (httpx.HTTPError), a cut stream
            raise TargetError(type(err).__name__, str(err)) from None

    return stream


def _message(text: str) -> str:
    """The OpenAI error body's message, else the text itself (shortened)."""
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:200]


async def wait_for_http(client: Any, wait_s: float) -> str:
    """The served model's name from `GET /v1/models`, retried for `wait_s` seconds while the
    HTTP port does not answer 200 yet.

    Raises:
        TimeoutError: no 200 within `wait_s` seconds (the last status or error in the text).
    """
    deadline = time.monotonic() + wait_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            response = await client.get("/v1/models")
            if response.status_code == 200:
                return response.json()["data"][0]["id"]
            last = f"HTTP {response.status_code}: {_message(response.text)}"
        except Exception as err:  # not listening yet
            last = f"{type(err).__name__}: {err}"
        await asyncio.sleep(0.5)
    raise TimeoutError(f"GET /v1/models: {last} after {wait_s:g} s")
