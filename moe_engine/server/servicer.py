"""The `moe_engine.v1.MoeEngine` gRPC servicer (grpc.aio) over an `EngineClient`.

Requests are converted to `SamplingParams` (`convert.py`; unset optional fields take vLLM's
defaults: max_tokens 16, temperature 1.0), checked against the message-size limit and
validated; every refusal is a gRPC status whose message names the field, the value and the
limit, with the field also in the trailing metadata key `moe-field`. When the client cancels
or its deadline passes, grpc.aio cancels the handler and the request is aborted in the engine,
which frees its KV blocks. Every stream that gets a first response ends with exactly one
`finished` response, also when `Abort` races with the request's own end; `Abort` reports which
of the two won.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from moe_engine.core.validation import truncate_prompt
from moe_engine.engine.client import EngineClient
from moe_engine.errors import ErrorCode, RequestError
from moe_engine.sampling_params import SamplingParams
from moe_engine.server.convert import (
    expert_load_to_proto,
    first_logprobs_from_proto,
    model_info_to_proto,
    response_from_output,
    sampling_params_from_proto,
    server_stats_to_proto,
)
from moe_engine.server.interceptors import abort_with_refusal
from moe_engine.server.metrics import RequestTimer, ServerMetrics
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.server.weight_rpcs import WeightControlRpcs

logger = logging.getLogger(__name__)

#: How long Abort waits for the request's stream to end, to say whether it was aborted (s).
ABORT_WAIT_S = 5.0


class MoeEngineServicer(WeightControlRpcs, pb_grpc.MoeEngineServicer):
    """Serves Generate / Abort / GetModelInfo / GetServerStats / GetExpertLoad, and the RL
    rollout RPCs (`weight_rpcs.WeightControlRpcs`: pause, resume, weight updates).

    Args:
        engine: a started (or starting) EngineClient.
        max_message_bytes: the largest GenerateRequest accepted (bytes, serialized).
        metrics: where to record per-request latencies, or None.
        max_prompt_tokens: the longest prompt accepted (tokens, `--max-prompt-tokens`), or
            None for the model's own limit (max_model_len - 1).

    `ready` is False until the model is loaded and again while draining; Generate then answers
    UNAVAILABLE with `status_detail()`: what the starting engine does (from its StartupProgress)
    or `unavailable_reason` (set while draining).
    """

    def __init__(
        self,
        engine: EngineClient,
        max_message_bytes: int,
        metrics: ServerMetrics | None = None,
        *,
        max_prompt_tokens: int | None = None,
    ) -> None:
        self.engine = engine
        self.max_message_bytes = max_message_bytes
        self.metrics = metrics
        self.max_prompt_tokens = max_prompt_tokens
        self.ready = False
        self.unavailable_reason: str | None = None
        # request_id -> future of its finish reason ("" when it ended without a final output).
        self._live: dict[str, asyncio.Future[str]] = {}

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            self._check_ready()
            self._check_size(request)
            _check_request_id(request.request_id)
            params = sampling_params_from_proto(request)
            prompt = self._truncated(self._prompt_ids(request), params)
            self._check_prompt_len(prompt)
        except RequestError as exc:
            await abort_with_refusal(context, exc)
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        # A duplicate live id is not tracked: the engine refuses it (ALREADY_EXISTS).
        ended = None if request_id in self._live else asyncio.get_running_loop().create_future()
        if ended is not None:
            self._live[request_id] = ended
        timer = RequestTimer()
        observed = refused = False  # the metrics see each request end once
        left = params.n  # completions still running; the request ends with the last one
        stream = self.engine.generate(
            request_id, prompt, params, arrival_time=time.time(),
            kv_placement=request.kv_placement or None,
            remote_first_token=request.remote_first_token
            if request.HasField("remote_first_token") else None,
            remote_first_logprobs=first_logprobs_from_proto(request),
        )
        try:
            async with aclosing(stream):
                try:
                    async for out in stream:
                        timer.record(out)
                        left -= out.finished
                        last = out.finished and left == 0
                        if last and ended is not None and not ended.done():
                            ended.set_result(str(out.finish_reason))
                        response = response_from_output(out)
                        if out.finished and timer.first_token_s is not None:
                            response.ttft_s = timer.first_token_s - timer.arrival_s
                        if last:
                            observed = True
                            self._observe(timer, str(out.finish_reason))
                        yield response
                except RequestError as exc:
                    refused = timer.last_output_s == 0.0  # before any output: it never ran
                    await abort_with_refusal(context, exc)
        finally:
            if not (observed or refused):  # cancelled (client gone, deadline) or failed
                self._observe(timer, "abort")
            if ended is not None:
                if not ended.done():
                    ended.set_result("")
                del self._live[request_id]

    def _observe(self, timer: RequestTimer, finish_reason: str) -> None:
        """One request's end into the request-level metrics (vLLM counts a request that ends
        without finishing under `finished_reason="abort"`)."""
        if self.metrics is not None:
            self.metrics.observe_finished(timer, finish_reason)

    async def PrepareDecode(  # noqa: N802
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.DecodePlacement:
        """Park a request on this decode instance; its KV placement for the prefill side."""
        try:
            self._check_ready()
            self._check_size(request)
            _check_request_id(request.request_id)
            if not request.request_id:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, "request_id",
                                   "request_id: PrepareDecode needs the request's id")
            params = sampling_params_from_proto(request)
            prompt = self._truncated(self._prompt_ids(request), params)
            self._check_prompt_len(prompt)
            placement = await self.engine.prepare_decode(request.request_id, prompt, params)
        except RequestError as exc:
            await abort_with_refusal(context, exc)
        return pb.DecodePlacement(placement=placement)

    async def Abort(  # noqa: N802
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        # Idempotent, as the proto says: an unknown id (the empty one included: the server
        # names requests that come without an id) is OK with aborted = false.
        rid = request.request_id
        ended = self._live.get(rid)
        if ended is None and self.engine.abort_parked(rid):
            return pb.AbortResponse(aborted=True,
                                    detail="aborted while it waited for its K/V (decode instance)")
        if ended is None:
            return pb.AbortResponse(
                aborted=False, detail=f"request_id {rid!r} is not live (unknown, or finished)"
            )
        sent = await self.engine.abort(rid)
        try:
            reason = await asyncio.wait_for(asyncio.shield(ended), ABORT_WAIT_S)
        except TimeoutError:
            detail = f"abort sent; the request had not ended {ABORT_WAIT_S:.0f} s later"
            return pb.AbortResponse(aborted=sent, detail=detail)
        if reason == "abort":
            detail = "aborted" if sent else "already being aborted by another call"
            return pb.AbortResponse(aborted=sent, detail=detail)
        if reason:
            detail = f"the request finished ({reason}) before the abort took effect"
        else:
            detail = "the request ended (cancelled or failed) before the abort took effect"
        return pb.AbortResponse(aborted=False, detail=detail)

    async def abort_all(self) -> int:
        """Abort every live request (the end of a drain); returns how many aborts were sent."""
        sent = 0
        for rid in list(self._live):
            sent += await self.engine.abort(rid)
        return sent

    async def GetModelInfo(  # noqa: N802
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        try:
            self._check_ready(draining_ok=True)
        except RequestError as exc:
            await abort_with_refusal(context, exc)
        info = self.engine.model_info
        assert info is not None  # _check_ready
        if info.eplb_enabled:  # the experts move while serving: ask for the live placement
            try:
                info = await self.engine.get_model_info()
            except RequestError as exc:
                await abort_with_refusal(context, exc)
        return model_info_to_proto(info)

    async def GetServerStats(  # noqa: N802
        self, request: pb.GetServerStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerStats:
        try:
            self._check_ready(draining_ok=True)
            stats = await self.engine.get_stats()
        except RequestError as exc:
            await abort_with_refusal(context, exc)
        return server_stats_to_proto(stats)

    async def GetExpertLoad(  # noqa: N802
        self, request: pb.GetExpertLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExpertLoad:
        try:
            self._check_ready(draining_ok=True)
            load = await self.engine.get_expert_load()
        except RequestError as exc:
            await abort_with_refusal(context, exc)
        info = self.engine.model_info
        return expert_load_to_proto(
            load, window=request.window, ep_size=info.ep_size if info is not None else 1
        )

    def status_detail(self) -> str:
        """Why the server does not serve, or "serving": the engine's death, the drain, or what
        the starting engine does (phase, seconds elapsed and about how many are left)."""
        if self.engine.dead.is_set():
            return f"engine unavailable: {self.engine.death_reason}"
        if self.ready:
            return "serving"
        if self.unavailable_reason is not None:
            return f"server unavailable: {self.unavailable_reason}"
        return f"server unavailable: {self.engine.startup_status.describe()}"

    def _check_ready(self, draining_ok: bool = False) -> None:
        if self.engine.dead.is_set():
            raise RequestError(ErrorCode.UNAVAILABLE, "engine", self.status_detail())
        if not self.ready and not (draining_ok and self.engine.model_info is not None):
            detail = self.status_detail()
            if self.unavailable_reason is None:
                detail += "; retry when health is SERVING"
            raise RequestError(ErrorCode.UNAVAILABLE, "engine", detail)

    def _check_size(self, request: pb.GenerateRequest) -> None:
        size = request.ByteSize()
        if size <= self.max_message_bytes:
            return
        # Name the biggest field: that is the one to shrink.
        sizes = {
            "text": len(request.text.encode()) if request.HasField("text") else 0,
            "prompt_ids": request.prompt_ids.ByteSize() if request.HasField("prompt_ids") else 0,
            "stop": sum(len(s.encode()) for s in request.stop),
            "stop_token_ids": 5 * len(request.stop_token_ids),
        }
        field = max(sizes, key=sizes.__getitem__)
        raise RequestError(
            ErrorCode.INVALID_ARGUMENT,
            field,
            f"{field}: the request is {size} bytes, over the message size limit of "
            f"{self.max_message_bytes} bytes (--max-message-bytes)",
        )

    def _truncated(self, prompt: list[int], params: SamplingParams) -> list[int]:
        """The prompt cut by `truncate_prompt_tokens` (`validation.truncate_prompt`), before
        the --max-prompt-tokens check, as vLLM truncates before its length checks."""
        info = self.engine.model_info
        if info is None or params.truncate_prompt_tokens is None:
            return prompt
        return truncate_prompt(prompt, params, info.max_model_len)

    def _check_prompt_len(self, prompt: list[int]) -> None:
        limit = self.max_prompt_tokens
        if limit is not None and len(prompt) > limit:
            raise RequestError(
                ErrorCode.OUT_OF_RANGE,
                "prompt",
                f"prompt: {len(prompt)} tokens is over the limit of {limit} prompt tokens "
                "(--max-prompt-tokens)",
            )

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        which = request.WhichOneof("prompt")
        if which == "prompt_ids":
            return list(request.prompt_ids.ids)
        if which == "text":
            return self.engine.encode(request.text)
        raise RequestError(
            ErrorCode.INVALID_ARGUMENT, "prompt", "prompt: set either text or prompt_ids"
        )


#: Longest client-chosen request id (characters): ids are logged and kept per live request.
MAX_REQUEST_ID_CHARS = 256


def _check_request_id(request_id: str) -> None:
    """Refuse a client-chosen id longer than `MAX_REQUEST_ID_CHARS` (INVALID_ARGUMENT)."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise RequestError(
            ErrorCode.INVALID_ARGUMENT,
            "request_id",
            f"request_id: {len(request_id)} characters, at most {MAX_REQUEST_ID_CHARS}",
        )

