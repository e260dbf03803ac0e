"""The request side of `EngineClient`: one output queue per live request, and RPCs with replies.

`generate` sends one EngineCoreRequest and yields its outputs (deltas) from an asyncio.Queue;
the client's output reader (`EngineClient._dispatch`, `client.py`) hands every output,
refusal and reply to `_deliver`. When the consumer of `generate` stops early (cancelled,
closed, deadline), the request is aborted in the core, which frees its KV blocks before its
next step. Requests are validated here first (the limits come with Ready), so most bad requests
never reach the step loop. Under expert parallelism a request goes to the rank with the fewest
live requests. The transport (`_send`) and the core process's lifetime are `EngineClient`'s.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from moe_engine.core.outputs import EngineCoreOutput, EngineStats, ExpertLoad, ModelInfo
from moe_engine.core.validation import truncate_prompt, validate_request
from moe_engine.engine.messages import (
    AbortRequests,
    AddError,
    CoreInput,
    CoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ExpertLoadReply,
    GetExpertLoad,
    GetModelInfo,
    GetStats,
    ModelInfoReply,
    PrepareDecode,
    PrepareDecodeReply,
    StatsReply,
)
from moe_engine.engine.status import StartupStatus
from moe_engine.errors import ErrorCode, RequestError
from moe_engine.sampling_params import SamplingParams
from moe_engine.weight_update.messages import ControlInput, ControlReply

logger = logging.getLogger(__name__)


class RequestStreams:
    """Live requests' output queues and pending replies; `EngineClient` adds the core process.

    Attributes:
        model_info: the core's ModelInfo (set once the core is ready, else None).
        startup_status: what the starting core last said it does (`describe()` for text).
        tokenizer: the checkpoint's tokenizer in this process, or None.
        dead: set when the core process has exited or failed; death_reason says why.
        paused: whether the core was paused at its last control reply (`PauseGeneration`).
        log_requests: log one INFO line per request as it is sent to the core (id, prompt
            length, sampling parameters) and one as it ends (finish reason, tokens);
            `moe-serve --enable-log-requests`, as vLLM's.
    """

    def __init__(self) -> None:
        self.model_info: ModelInfo | None = None
        self.log_requests = False
        self.startup_status = StartupStatus()
        self.tokenizer: Any | None = None
        self.dead = asyncio.Event()
        self.death_reason: str | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._aborting: set[str] = set()
        self._replies: dict[int, asyncio.Future] = {}
        self._rank_load: list[int] = [0]
        self._rank_of: dict[str, int] = {}
        #: Decode instance: request_id -> (the rank PrepareDecode parked it on, when the core
        #: drops it unless its K/V came: time.monotonic() seconds).
        self._parked: dict[str, tuple[int, float]] = {}
        self._parked_timeout_s = 30.0
        self._reply_ids = itertools.count()
        self.paused = False

    @property
    def num_live_requests(self) -> int:
        """Requests whose streams are open in this front end."""
        return len(self._streams)

    def encode(self, text: str) -> list[int]:
        """Tokenise a text prompt.

        Raises:
            RequestError: INVALID_ARGUMENT ("text") when the checkpoint has no tokenizer.
        """
        if self.tokenizer is None:
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT,
                "text",
                "text: this model has no tokenizer; send the prompt as prompt_ids (or start "
                "the server with --tokenizer PATH)",
            )
        return list(self.tokenizer.encode(text))

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        *,
        kv_placement: bytes | None = None,
        remote_first_token: int | None = None,
        remote_first_logprobs: tuple[float, dict[int, float]] | None = None,
    ) -> AsyncIterator[EngineCoreOutput]:
        """Submit one request and yield its outputs (deltas) until the finished one (with
        `params.n` > 1: until each of its n completions has sent its finished output; every
        output's `index` names its completion).

        Args:
            request_id: unique among live requests.
            prompt_token_ids: the prompt, token ids in [0, vocab_size).
            params: sampling parameters.
            arrival_time: when the request arrived (time.time() seconds; default now).
            kv_placement, remote_first_token, remote_first_logprobs: a prefill/decode
                split's fields (`EngineCoreRequest`; the router sets them).

        Raises:
            RequestError: the request is refused (bad field, out of range, duplicate live id,
                queue full) or the engine is down (UNAVAILABLE).

        If the caller stops iterating before the finished output (cancellation, `aclose`), the
        request is aborted in the core.
        """
        self._check_alive()
        info = self.model_info
        if info is None:
            raise RequestError(
                ErrorCode.UNAVAILABLE, "engine",
                f"engine unavailable: {self.startup_status.describe()}",
            )
        if request_id in self._streams:
            raise RequestError(
                ErrorCode.ALREADY_EXISTS,
                "request_id",
                f"request_id: {request_id!r} is already in use by a live request",
            )
        prompt_token_ids = truncate_prompt(prompt_token_ids, params, info.max_model_len)
        validate_request(
            prompt_token_ids,
            params,
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
        )
        if params.stop and self.tokenizer is None:
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT,
                "stop",
                "stop: this model has no tokenizer, so stop strings cannot be matched; use "
                "stop_token_ids",
            )
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        arrival = time.time() if arrival_time is None else arrival_time
        rank = self._parked.pop(request_id, (None, 0.0))[0] if remote_first_token is not None \
            else None  # a parked request continues on the rank that holds its blocks
        if rank is not None:
            self._rank_load[rank] -= 1
        else:
            rank = self._least_loaded_rank()
        add = EngineCoreRequest(request_id, list(prompt_token_ids), params, arrival, rank,
                                kv_placement, remote_first_token, remote_first_logprobs)
        try:
            self._send(add)
        except RequestError:
            del self._streams[request_id]
            raise
        self._rank_load[rank] += params.n  # each completion is a request of that rank
        self._rank_of[request_id] = rank
        if self.log_requests:
            logger.info("Received request %s: %d prompt tokens, params: %s", request_id,
                        len(prompt_token_ids), params)
        remaining = params.n
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    remaining = 0
                    raise item
                remaining -= item.finished
                if self.log_requests and item.finished:
                    logger.info("Finished request %s (completion %d): finish_reason %s, %d "
                                "output tokens", request_id, item.index, item.finish_reason,
                                item.num_output_tokens)
                yield item
        finally:
            if self._streams.get(request_id) is queue:
                del self._streams[request_id]
                self._rank_load[self._rank_of.pop(request_id)] -= params.n
            self._aborting.discard(request_id)
            if remaining:
                self._try_send(AbortRequests([request_id]))

    async def abort(self, request_id: str) -> bool:
        """Abort a live request; its stream ends with finish_reason ABORT.

        Returns:
            True when the request was live (and not already being aborted); False otherwise,
            so repeated aborts are harmless.
        """
        if request_id not in self._streams or request_id in self._aborting:
            return False
        self._aborting.add(request_id)
        self._try_send(AbortRequests([request_id]))
        return True

    def abort_parked(self, request_id: str) -> bool:
        """Decode instance: abort a request PrepareDecode parked (no stream yet), so its
        blocks are freed now rather than after the transfer timeout; False when none is."""
        entry = self._parked.pop(request_id, None)
        if entry is None:
            return False
        self._rank_load[entry[0]] -= 1
        self._try_send(AbortRequests([request_id]))
        return True

    async def get_stats(self, timeout_s: float = 30.0) -> EngineStats:
        """The engine's stats (summed over ranks, and per rank), read after the step in
        progress.

        Raises:
            RequestError: UNAVAILABLE when the core is down or does not answer in time.
        """
        reply = await self._request_reply(GetStats, timeout_s)
        assert isinstance(reply, StatsReply)
        return reply.stats

    async def get_expert_load(self, timeout_s: float = 30.0) -> ExpertLoad:
        """Token-expert counts per MoE layer and expert (summed over ranks), with summaries.

        Raises:
            RequestError: UNAVAILABLE when the core is down or does not answer in time.
        """
        reply = await self._request_reply(GetExpertLoad, timeout_s)
        assert isinstance(reply, ExpertLoadReply)
        return reply.load

    async def get_model_info(self, timeout_s: float = 30.0) -> ModelInfo:
        """The model info asked afresh (under expert parallelism: every rank's experts and pid).

        Raises:
            RequestError: UNAVAILABLE when the core is down or does not answer in time.
        """
        reply = await self._request_reply(GetModelInfo, timeout_s)
        assert isinstance(reply, ModelInfoReply)
        return reply.info

    async def control(
        self, make: Callable[[int], ControlInput], timeout_s: float
    ) -> ControlReply:
        """Send one RL control message and wait for its answer (`control.py`: pause, resume,
        join or leave a weight-update group, new weights).

        Args:
            make: builds the message from its reply id, e.g.
                `lambda rid: UpdateWeights(rid, "step-3", "disk", path=...)`.
            timeout_s: how long to wait for the answer (seconds); an update may take minutes.
                When it passes the core still finishes what it started (the answer is dropped).

        Returns:
            The core's reply; a refusal has `code` set (with `field` and `message`), and the
            caller reports it. `model_info.weight_version` follows every reply's version.

        Raises:
            RequestError: UNAVAILABLE when the core is down or does not answer in time.
        """
        reply = await self._request_reply(make, timeout_s)
        assert isinstance(reply, ControlReply)
        self.paused = reply.paused
        info = self.model_info
        if info is not None and reply.weight_version and (
            reply.weight_version != info.weight_version
        ):
            self.model_info = msgspec.structs.replace(info, weight_version=reply.weight_version)
        return reply

    async def prepare_decode(self, request_id: str, prompt_token_ids: list[int],
                             params: SamplingParams, timeout_s: float = 30.0) -> bytes:
        """Decode instance: park a request with its prompt's blocks allocated; returns where
        its K/V goes (`disagg.handoff.KVPlacement`, msgpack) for the prefill instance.

        Raises:
            RequestError: the request is refused (a bad field; RESOURCE_EXHAUSTED when there
                is no room now; INVALID_ARGUMENT on an instance not in decode mode) or the
                core is down (UNAVAILABLE).
        """
        info = self.model_info
        if info is not None:
            prompt_token_ids = truncate_prompt(prompt_token_ids, params, info.max_model_len)
            validate_request(prompt_token_ids, params, vocab_size=info.vocab_size,
                             max_model_len=info.max_model_len)
        self._expire_parked()
        rank = self._least_loaded_rank()
        add = EngineCoreRequest(request_id, list(prompt_token_ids), params, time.time(), rank)
        # counted at once: concurrent PrepareDecodes spread over the ranks; the blocks are held
        # there until the request continues, is aborted or expires
        self._rank_load[rank] += 1
        try:
            reply = await self._request_reply(lambda rid: PrepareDecode(rid, add), timeout_s)
            assert isinstance(reply, PrepareDecodeReply)
            if reply.code:
                raise RequestError(ErrorCode(reply.code), reply.field, reply.message)
        except BaseException:
            self._rank_load[rank] -= 1
            raise
        self._parked[request_id] = (rank, time.monotonic() + self._parked_timeout_s)
        return reply.placement

    def _least_loaded_rank(self) -> int:
        return min(range(len(self._rank_load)), key=self._rank_load.__getitem__)

    def _expire_parked(self) -> None:
        """Forget parked requests the core has dropped by now (their K/V never came)."""
        now = time.monotonic()
        for rid in [r for r, (_, t) in self._parked.items() if t < now]:
            self._rank_load[self._parked.pop(rid)[0]] -= 1

    async def _request_reply(self, make: Callable[[int], CoreInput], timeout_s: float) -> Any:
        """Send `make(reply_id)` and wait up to `timeout_s` for the reply with that id.

        Raises:
            RequestError: UNAVAILABLE when the core is down, unreachable or silent too long.
        """
        self._check_alive()
        reply_id = next(self._reply_ids)
        message = make(reply_id)
        future = asyncio.get_running_loop().create_future()
        self._replies[reply_id] = future
        try:
            self._send(message)
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise RequestError(
                ErrorCode.UNAVAILABLE, "engine",
                f"engine core did not answer {type(message).__name__} within {timeout_s:.0f} s",
            ) from None
        finally:
            self._replies.pop(reply_id, None)


    def _check_alive(self) -> None:
        if self.dead.is_set():
            raise RequestError(
                ErrorCode.UNAVAILABLE, "engine", f"engine unavailable: {self.death_reason}"
            )

    def _send(self, message: CoreInput) -> None:
        """Send to the core without blocking (the transport is `EngineClient`'s).

        Raises:
            RequestError: UNAVAILABLE when the socket is gone.
        """
        raise NotImplementedError

    def _try_send(self, message: CoreInput) -> None:
        """Best-effort send (aborts and shutdown), never raising."""
        try:
            self._send(message)
        except RequestError as exc:
            logger.debug("dropped %s: %s", type(message).__name__, exc.message)

    def _deliver(self, message: CoreOutput) -> bool:
        """Hand a request's output or refusal to its stream, or a reply to its waiter.

        Returns:
            Whether `message` was one of those (the client handles the others).
        """
        match message:
            case EngineCoreOutputs(outputs=outputs):
                for out in outputs:
                    queue = self._streams.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
            case AddError(request_id=rid, code=code, field=field, message=text):
                queue = self._streams.get(rid)
                if queue is not None:
                    queue.put_nowait(RequestError(code, field, text))
            case (StatsReply() | ExpertLoadReply() | ModelInfoReply() | ControlReply()
                  | PrepareDecodeReply()):
                future = self._replies.get(message.reply_id)
                if future is not None and not future.done():
                    future.set_result(message)
            case _:
                return False
        return True

    def _fail_requests(self, error: RequestError) -> None:
        """End every open stream and pending reply with `error`."""
        for queue in self._streams.values():
            queue.put_nowait(error)
        for future in self._replies.values():
            if not future.done():
                future.set_exception(error)
