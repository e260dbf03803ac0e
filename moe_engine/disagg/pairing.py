"""One request through a prefill and a decode instance: what `moe-router` does per request, for
both its front ends (gRPC `router.RouterServicer` and the OpenAI HTTP API over
`router_engine.RouterEngine`).

Per request `Pairing.generate` picks the prefill and the decode instance with the fewest
requests in flight through this router, then:

1. decode `PrepareDecode(request)`: the decode instance validates it and allocates its
   prompt's blocks; it answers with their placement (its refusals reach the client as they are);
2. prefill `Generate(request + kv_placement)`: the prompt runs to its first token, its K/V is
   written into those blocks, then the one response comes (with the first token);
3. decode `Generate(request + remote_first_token)`: streamed back, from the first token on.

Any failure (a refusal, a dead or silent instance, the caller's deadline) raises `BackendError`
with the backend's status and field, naming the instance; a call that does not finish (failed,
or closed early by a client that went away) is aborted on both sides, so the decode instance's
parked blocks return at once (a router that dies leaves them to the decode instance's
--kv-transfer-timeout-s).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from moe_engine.errors import ErrorCode, RequestError
from moe_engine.server.interceptors import FIELD_METADATA_KEY
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc

#: How long the router waits for each instance to acknowledge an abort (seconds).
ABORT_TIMEOUT_S = 5.0


class BackendError(Exception):
    """A paired request that failed: the gRPC status to end it with, the field, the message
    (which names the instance).

    Attributes:
        code: the status (the backend's own, or UNAVAILABLE for an instance that ended the
            request without a token).
        field: the request field at fault (the backend's `moe-field`), "" when none.
        message: what happened, prefixed with the instance's role and address.
    """

    def __init__(self, code: grpc.StatusCode, field: str, message: str) -> None:
        super().__init__(message)
        self.code, self.field, self.message = code, field, message

    @classmethod
    def of(cls, role: str, address: str, exc: grpc.aio.AioRpcError) -> BackendError:
        found = [v for k, v in (exc.trailing_metadata() or ()) if k == FIELD_METADATA_KEY]
        return cls(exc.code(), str(found[0]) if found else "",
                   f"{role} instance {address}: {exc.details()}")

    def as_request_error(self) -> RequestError:
        """The engine-level refusal (for the HTTP front end): the same code where the engine
        has one, UNAVAILABLE for the rest (deadline, cancelled, internal)."""
        try:
            code = ErrorCode(self.code.name)
        except ValueError:
            code = ErrorCode.UNAVAILABLE
        return RequestError(code, self.field or "engine", self.message)


@dataclass
class Instance:
    """One backend: its address, channel, stub, and requests in flight through the router."""

    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.MoeEngineStub
    in_flight: int = 0


def connect(address: str) -> Instance:
    """An Instance for `address` (HOST:PORT); the channel connects on first use."""
    channel = grpc.aio.insecure_channel(address)
    return Instance(address, channel, pb_grpc.MoeEngineStub(channel))


@dataclass
class PairTimes:
    """Where one request's time went, as the router saw it (seconds from its start).

    Attributes:
        prefill_s: PrepareDecode + the prefill + its K/V transfer, up to the first token.
        decode_s: from the first token to the last response.
    """

    prefill_s: float = 0.0
    decode_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)


class Pairing:
    """The prefill and decode instances, and the three steps of the module docstring.

    Args:
        prefill, decode: HOST:PORT of each instance (at least one of each).

    Raises:
        ValueError: either list is empty.
    """

    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        if not prefill or not decode:
            raise ValueError("moe-router needs at least one --prefill and one --decode "
                             "instance")
        self.prefill = [connect(a) for a in prefill]
        self.decode = [connect(a) for a in decode]

    async def close(self) -> None:
        for inst in self.prefill + self.decode:
            await inst.channel.close()

    @staticmethod
    def pick(instances: list[Instance]) -> Instance:
        """The instance with the fewest requests in flight (the first among equals)."""
        return min(instances, key=lambda i: i.in_flight)

    async def generate(self, request: pb.GenerateRequest, deadline: float | None = None,
                       times: PairTimes | None = None) -> AsyncIterator[pb.GenerateResponse]:
        """The request's responses, as a single instance would stream them; the finished one
        carries `ttft_s` as the router measured it (arrival to the first token).

        Args:
            request: with its request_id set and no kv_placement / remote_first_token.
            deadline: `time.monotonic()` by which every step must be done, None for none.
            times: filled in as the request goes.

        Raises:
            BackendError: see the module docstring.
        """
        times = times or PairTimes()
        p, d = self.pick(self.prefill), self.pick(self.decode)
        p.in_flight += 1
        d.in_flight += 1
        finished = False
        try:
            first = await self._prefill(request, p, d, deadline)
            times.prefill_s = time.perf_counter() - times.started
            dreq = pb.GenerateRequest()
            dreq.CopyFrom(request)
            dreq.remote_first_token = first.token_ids[0]
            if first.logprobs:
                dreq.remote_first_logprob.CopyFrom(first.logprobs[0])
            try:
                async for response in d.stub.Generate(dreq, timeout=_left(deadline)):
                    if response.finished:
                        finished = True
                        response.ttft_s = times.prefill_s
                        times.decode_s = time.perf_counter() - times.started - times.prefill_s
                    yield response
            except grpc.aio.AioRpcError as exc:
                raise BackendError.of("decode", d.address, exc) from None
        finally:
            p.in_flight -= 1
            d.in_flight -= 1
            if not finished:  # failed or closed early: nothing may stay behind on either side
                await asyncio.shield(self._abort_both(request.request_id, p, d))

    async def _prefill(self, req: pb.GenerateRequest, p: Instance, d: Instance,
                       deadline: float | None) -> pb.GenerateResponse:
        """Steps 1-2: the placement from `d`, the prefill on `p`; its response with the first
        token (and its logprobs entry)."""
        try:
            placement = await d.stub.PrepareDecode(req, timeout=_left(deadline))
        except grpc.aio.AioRpcError as exc:
            raise BackendError.of("decode", d.address, exc) from None
        preq = pb.GenerateRequest()
        preq.CopyFrom(req)
        preq.kv_placement = placement.placement
        first = None
        try:
            async for response in p.stub.Generate(preq, timeout=_left(deadline)):
                if response.token_ids:
                    first = response
        except grpc.aio.AioRpcError as exc:
            raise BackendError.of("prefill", p.address, exc) from None
        if first is None:
            raise BackendError(grpc.StatusCode.UNAVAILABLE, "",
                               f"prefill instance {p.address} ended the request without a "
                               "token")
        return first

    async def _abort_both(self, request_id: str, p: Instance, d: Instance) -> None:
        for inst in (d, p):
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
                await inst.stub.Abort(pb.AbortRequest(request_id=request_id),
                                      timeout=ABORT_TIMEOUT_S)

    async def abort(self, request_id: str) -> bool:
        """Abort `request_id` on every instance; True when one of them had it live."""
        aborted = False
        for inst in self.decode + self.prefill:
            with contextlib.suppress(grpc.aio.AioRpcError):
                reply = await inst.stub.Abort(pb.AbortRequest(request_id=request_id),
                                              timeout=ABORT_TIMEOUT_S)
                aborted = aborted or reply.aborted
        return aborted

    async def model_info(self, timeout_s: float = 10.0) -> pb.ModelInfo:
        """GetModelInfo of the least loaded decode instance.

        Raises:
            BackendError: it does not answer.
        """
        inst = self.pick(self.decode)
        try:
            return await inst.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise BackendError.of("decode", inst.address, exc) from None


def _left(deadline: float | None) -> float | None:
    """Seconds until `deadline` (at least a millisecond: gRPC then answers DEADLINE_EXCEEDED)."""
    return None if deadline is None else max(1e-3, deadline - time.monotonic())
