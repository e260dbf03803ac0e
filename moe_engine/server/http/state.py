"""What the HTTP routes share: the engine, the served model's name, readiness and live requests.

One `HttpState` per server, built by `MoeServer` beside the gRPC servicer over the same
`EngineClient`, so both front ends feed one scheduler, one set of metrics and stats.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from moe_engine.core.outputs import EngineCoreOutput
from moe_engine.core.token_bytes import TokenBytes
from moe_engine.core.validation import truncate_prompt, validate_request
from moe_engine.engine.client import EngineClient
from moe_engine.errors import ErrorCode, RequestError
from moe_engine.sampling_params import SamplingParams
from moe_engine.server.http.errors import OpenAIError
from moe_engine.server.http.request_context import current_request_id
from moe_engine.server.metrics import RequestTimer, ServerMetrics


@dataclass(frozen=True)
class ChatSettings:
    """The server's chat settings (vLLM's flags of the same names; `chat_setup` builds them).

    Attributes:
        chat_template: `--chat-template`'s text (None: the tokenizer's own).
        tool_parser: the tool-call parser's name (`parsers.registry.TOOL_PARSERS`;
            `--tool-call-parser`, or the checkpoint's default), None for none.
        reasoning_parser: the reasoning parser's name (`parsers.registry.REASONING_PARSERS`;
            `--reasoning-parser`, or the checkpoint's default), None for none.
        enable_auto_tool_choice: `--enable-auto-tool-choice`: `tool_choice: "auto"` (and
            `tools` without a `tool_choice`) parse calls with `tool_parser`.
        reasoning_keeps_special_tokens: the reasoning parser's markers are special tokens of
            this tokenizer (gpt-oss's harmony markers; `<think>` where a tokenizer makes it
            special), so outputs it reads keep special tokens in their text.
    """

    chat_template: str | None = None
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_keeps_special_tokens: bool = False


@dataclass
class HttpState:
    """The HTTP front end's view of the server.

    Attributes:
        engine: the EngineClient both front ends share.
        served_model_name: the one model name requests may name (`--served-model-name`).
        status: `(ready, detail)`: whether new requests are taken, and why not ("serving",
            what the starting engine does, "the server is shutting down", the engine's death).
        metrics: the server's metrics (per-request latencies), or None.
        max_prompt_tokens: the longest prompt accepted (tokens, `--max-prompt-tokens`), or None.
        created: when the server started (Unix seconds; /v1/models' `created`).
    """

    engine: EngineClient
    served_model_name: str
    status: Callable[[], tuple[bool, str]]
    metrics: ServerMetrics | None = None
    max_prompt_tokens: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    #: chat templates and parsers (set once the tokenizer is known).
    chat: ChatSettings = field(default_factory=ChatSettings)
    #: request ids of the HTTP requests live in the engine.
    live: set[str] = field(default_factory=set)
    #: Each token's own bytes from the vocabulary, made at first use (`token_bytes`).
    _token_bytes: TokenBytes | None = field(default=None, init=False, repr=False)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The token's own bytes (`core.token_bytes.TokenBytes`); None without a tokenizer."""
        if self.tokenizer is None:
            return None
        if self._token_bytes is None or self._token_bytes.tokenizer is not self.tokenizer:
            self._token_bytes = TokenBytes(self.tokenizer)
        return self._token_bytes(token_id)

    def check_ready(self) -> None:
        """Raises OpenAIError 503 naming why the server does not take requests now."""
        ready, detail = self.status()
        if not ready:
            raise OpenAIError(503, detail, None, "unavailable")

    def check_model(self, model: str | None) -> None:
        """Raises OpenAIError 404 for a model name other than the served one (None is fine)."""
        if model is not None and model != self.served_model_name:
            raise OpenAIError(
                404,
                f"model: {model!r} does not exist; this server serves {self.served_model_name!r} "
                "(--served-model-name)",
                "model",
                "model_not_found",
            )

    @property
    def tokenizer(self) -> Any | None:
        return self.engine.tokenizer

    def max_model_len(self) -> int:
        info = self.engine.model_info
        if info is None:
            raise OpenAIError(503, "the engine is not ready", None, "unavailable")
        return info.max_model_len

    def check_request(self, prompt: list[int], params: SamplingParams, field_name: str) -> None:
        """The engine's own checks, before a response starts (a stream's status is then
        already sent): the prompt limit, then `validate_request` against the model's limits.

        Raises:
            RequestError: naming the field, the value and the limit.
        """
        info = self.engine.model_info
        assert info is not None  # check_ready
        prompt = truncate_prompt(prompt, params, info.max_model_len)
        limit = self.max_prompt_tokens
        if limit is not None and len(prompt) > limit:
            raise RequestError(
                ErrorCode.OUT_OF_RANGE,
                field_name,
                f"{field_name}: {len(prompt)} tokens is over the limit of {limit} prompt tokens "
                "(--max-prompt-tokens)",
            )
        validate_request(prompt, params, vocab_size=info.vocab_size,
                         max_model_len=info.max_model_len)

    async def abort_all(self) -> int:
        """Abort every live HTTP request (the end of a drain); returns how many were sent."""
        sent = 0
        for rid in list(self.live):
            sent += await self.engine.abort(rid)
        return sent

    async def open_streams(
        self, prompts: list[list[int]], params: SamplingParams, prefix: str
    ) -> PromptStreams:
        """Submit one engine request per prompt and wait for each one's first output, so that
        a refusal (queue full, bad field) is an HTTP status, not an error inside a stream.

        Raises:
            RequestError: a refusal; the requests already submitted are aborted.
        """
        base = f"{prefix}-{current_request_id() or uuid.uuid4().hex}"  # vLLM's X-Request-Id
        ids = [base if len(prompts) == 1 else f"{base}-{i}" for i in range(len(prompts))]
        streams = PromptStreams(self, base)
        try:
            for i, (rid, prompt) in enumerate(zip(ids, prompts, strict=True)):
                await streams.add(i, rid, prompt, params)
        except BaseException:
            await streams.close()
            raise
        return streams


class PromptStreams:
    """The engine streams of one HTTP request (one per prompt), merged.

    `outputs()` yields lists of `(prompt_index, EngineCoreOutput)` that were ready together:
    at most one output per (prompt, completion) in a list, so a list is one engine step's
    chunk. `close()` aborts whatever is still running (a client that went away).
    """

    def __init__(self, state: HttpState, request_id: str) -> None:
        self.state = state
        self.request_id = request_id
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._pending: list[tuple[int, EngineCoreOutput]] = []

    async def add(self, index: int, rid: str, prompt: list[int], params: SamplingParams) -> None:
        timer = RequestTimer()  # before the first output: the arrival, for TTFT and e2e
        stream = self.state.engine.generate(rid, prompt, params, arrival_time=time.time())
        self.state.live.add(rid)
        try:
            first = await anext(stream)
        except RequestError:  # refused (or the engine is down): never ran, nothing to observe
            self.state.live.discard(rid)
            await stream.aclose()
            raise
        except BaseException:  # cancelled while it waited (the client went): aborted
            self.state.live.discard(rid)
            await stream.aclose()
            self._observe(timer, "abort")
            raise
        self._pending.append((index, first))
        timer.record(first)
        self._tasks.append(asyncio.create_task(self._pump(index, rid, stream, first, params.n,
                                                          timer)))

    def _observe(self, timer: RequestTimer, finish_reason: str) -> None:
        """The request's end into the request-level metrics (once per engine request)."""
        metrics = self.state.metrics
        if metrics is not None:
            metrics.observe_finished(timer, finish_reason)

    async def _pump(
        self, index: int, rid: str, stream: AsyncIterator[EngineCoreOutput],
        first: EngineCoreOutput, n: int, timer: RequestTimer,
    ) -> None:
        """Queue the request's outputs until its last completion finishes.

        Every request is observed exactly once: with its engine finish reason when its last
        completion finished (a server abort or drain finishes it with "abort"), else as "abort"
        (vLLM's `finished_reason="abort"`): the pump was cancelled (`close()`: the client went,
        the handler was cancelled) or the engine failed it mid-run.
        """
        left = n - first.finished
        last_reason = str(first.finish_reason)
        try:
            async with aclosing(stream):
                if left:
                    async for out in stream:
                        timer.record(out)
                        left -= out.finished
                        last_reason = str(out.finish_reason)
                        self._queue.put_nowait((index, out))
            self._queue.put_nowait((index, None))
        except RequestError as exc:
            self._queue.put_nowait((index, exc))
        finally:
            self.state.live.discard(rid)
            self._observe(timer, "abort" if left else last_reason)

    async def outputs(self) -> AsyncIterator[list[tuple[int, EngineCoreOutput]]]:
        """Every output until all prompts' completions have finished.

        Raises:
            RequestError: the engine failed a request while it ran (e.g. it went down).
        """
        running = len(self._tasks)
        batch, self._pending = self._pending, []
        if batch:
            yield batch
        while running:
            items = [await self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            batch, seen = [], set()
            for index, out in items:
                if out is None:
                    running -= 1
                    continue
                if isinstance(out, RequestError):
                    raise out
                key = (index, out.index)
                if key in seen:
                    yield batch
                    batch, seen = [], set()
                seen.add(key)
                batch.append((index, out))
            if batch:
                yield batch

    async def close(self) -> None:
        """Cancel the pumps: their engine streams close, which aborts unfinished requests."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
