"""`moe-router`: one gRPC endpoint in front of prefill and decode instances.

Clients call it as they call `moe-serve` (the same `moe_engine.v1.MoeEngine` Generate, Abort
and GetModelInfo, grpc.health.v1). Per Generate it picks the prefill and the decode instance
with the fewest requests in flight through this router, then:

1. decode `PrepareDecode(request)`: the decode instance validates it and allocates its
   prompt's blocks; it answers with their placement (its refusals reach the client as they are);
2. prefill `Generate(request + kv_placement)`: the prompt runs to its first token, its K/V is
   written into those blocks, then the one response comes (with the first token);
3. decode `Generate(request + remote_first_token)`: streamed back to the client, from the
   first token on.

A prefill instance that fails or dies during 1-2 ends the request with its status
(UNAVAILABLE for a dead one) and the router aborts the decode side's parked request, so its
blocks return at once (a router that dies leaves them to the decode instance's
--kv-transfer-timeout-s). The client's deadline bounds every call; a client that cancels gets
its request aborted on both sides. The finished response's trailing metadata carries the
request's `moe-prefill-s` (prefill + transfer, as the router saw it) and `moe-decode-s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


@dataclass
class Instance:
    """One backend: its address, channel, stub, and requests in flight through the router."""

    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.MoeEngineStub
    in_flight: int = 0


def _connect(address: str) -> Instance:
    channel = grpc.aio.insecure_channel(address)
    return Instance(address, channel, pb_grpc.MoeEngineStub(channel))


class RouterServicer(pb_grpc.MoeEngineServicer):
    """The router's MoeEngine service (see the module docstring)."""

    def __init__(self, prefill: list[str], decode: list[str]):
        if not prefill or not decode:
            raise ValueError("moe-router needs at least one --prefill and one --decode "
                             "instance")
        self.prefill = [_connect(a) for a in prefill]
        self.decode = [_connect(a) for a in decode]

    async def close(self) -> None:
        for inst in self.prefill + self.decode:
            await inst.channel.close()

    @staticmethod
    def _pick(instances: list[Instance]) -> Instance:
        return min(instances, key=lambda i: i.in_flight)

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        if request.kv_placement or request.HasField("remote_first_token"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "kv_placement / remote_first_token: set by the router only")
        req = pb.GenerateRequest()
        req.CopyFrom(request)
        req.request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        p, d = self._pick(self.prefill), self._pick(self.decode)
        p.in_flight += 1
        d.in_flight += 1
        t0 = time.perf_counter()
        finished = False
        try:
            first = await self._prefill(req, p, d, context)
            prefill_s = time.perf_counter() - t0
            dreq = pb.GenerateRequest()
            dreq.CopyFrom(req)
            dreq.remote_first_token = first
            try:
                async for response in d.stub.Generate(dreq, timeout=context.time_remaining()):
                    if response.finished:
                        finished = True
                        response.ttft_s = prefill_s
                        context.set_trailing_metadata((
                            ("moe-prefill-s", f"{prefill_s:.6f}"),
                            ("moe-decode-s", f"{time.perf_counter() - t0 - prefill_s:.6f}"),
                        ))
                    yield response
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), f"decode instance {d.address}: {exc.details()}")
        finally:
            p.in_flight -= 1
            d.in_flight -= 1
            if not finished:  # cancelled or failed: nothing may stay behind on either side
                await self._abort_both(req.request_id, p, d)

    async def _prefill(self, req: pb.GenerateRequest, p: Instance, d: Instance,
                       context: grpc.aio.ServicerContext) -> int:
        """Steps 1-2: the placement from `d`, the prefill on `p`; the first token."""
        try:
            placement = await d.stub.PrepareDecode(req, timeout=context.time_remaining())
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), f"decode instance {d.address}: {exc.details()}")
        preq = pb.GenerateRequest()
        preq.CopyFrom(req)
        preq.kv_placement = placement.placement
        first = None
        try:
            async for response in p.stub.Generate(preq, timeout=context.time_remaining()):
                if response.token_ids:
                    first = response.token_ids[0]
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), f"prefill instance {p.address}: {exc.details()}")
        if first is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"prefill instance {p.address} ended the request without a token")
        return first

    async def _abort_both(self, request_id: str, p: Instance, d: Instance) -> None:
        for inst in (d, p):
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
                await inst.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=5)

    async def Abort(  # noqa: N802
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        aborted = False
        for inst in self.decode + self.prefill:
            with contextlib.suppress(grpc.aio.AioRpcError):
                reply = await inst.stub.Abort(request, timeout=5)
                aborted = aborted or reply.aborted
        return pb.AbortResponse(aborted=aborted,
                                detail="aborted" if aborted else "no instance had it live")

    async def GetModelInfo(  # noqa: N802
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        inst = self._pick(self.decode)
        try:
            return await inst.stub.GetModelInfo(request, timeout=10)
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), f"decode instance {inst.address}: {exc.details()}")


async def serve_router(prefill: list[str], decode: list[str], host: str = "127.0.0.1",
                       port: int = 50050, ready: asyncio.Event | None = None,
                       stop: asyncio.Event | None = None) -> None:
    """Run the router until `stop` is set (or forever); `ready` is set once it listens.

    Raises:
        OSError: the port cannot be bound.
    """
    server = grpc.aio.server()
    servicer = RouterServicer(prefill, decode)
    pb_grpc.add_MoeEngineServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"moe-router: cannot listen on {host}:{port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    logger.info("moe-router on %s:%d: prefill %s, decode %s", host, port, prefill, decode)
    if ready is not None:
        ready.set()
    try:
        if stop is None:
            await server.wait_for_termination()
        else:
            await stop.wait()
    finally:
        await server.stop(grace=5)
        await servicer.close()
