"""`moe-router`: one endpoint in front of prefill and decode instances.

Clients call it as they call `moe-serve`: gRPC (the same `moe_engine.v1.MoeEngine` Generate,
Abort and GetModelInfo, grpc.health.v1) and, with `--http-port`, the OpenAI-compatible HTTP API
(`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/tokenize`, `/detokenize`, `/health`:
the same routes as moe-serve's, over `router_engine.RouterEngine`). Each request goes through a
prefill and a decode instance as `pairing.Pairing` describes. The client's deadline bounds
every step; a client that cancels gets its request aborted on both sides. The finished gRPC
response's trailing metadata carries the request's `moe-prefill-s` (PrepareDecode, prefill
and transfer, as the router saw them) and `moe-decode-s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from moe_engine.disagg.pairing import BackendError, Pairing, PairTimes
from moe_engine.server.interceptors import FIELD_METADATA_KEY
from moe_engine.server.options import DEFAULT_MAX_MESSAGE_BYTES
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


class RouterServicer(pb_grpc.MoeEngineServicer):
    """The router's MoeEngine service (see the module docstring)."""

    def __init__(self, pairing: Pairing):
        self.pairing = pairing

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        if (request.kv_placement or request.HasField("remote_first_token")
                or request.HasField("remote_first_logprob")):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "kv_placement / remote_first_token / remote_first_logprob: set "
                                "by the router only")
        req = pb.GenerateRequest()
        req.CopyFrom(request)
        req.request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        times = PairTimes()
        try:
            async for response in self.pairing.generate(req, deadline, times):
                if response.finished:
                    context.set_trailing_metadata((
                        ("moe-prefill-s", f"{times.prefill_s:.6f}"),
                        ("moe-decode-s", f"{times.decode_s:.6f}"),
                    ))
                yield response
        except BackendError as exc:
            await _abort(context, exc)

    async def Abort(  # noqa: N802
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        aborted = await self.pairing.abort(request.request_id)
        return pb.AbortResponse(aborted=aborted,
                                detail="aborted" if aborted else "no instance had it live")

    async def GetModelInfo(  # noqa: N802
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        try:
            return await self.pairing.model_info()
        except BackendError as exc:
            await _abort(context, exc)


async def _abort(context: grpc.aio.ServicerContext, exc: BackendError) -> None:
    """End the call with the backend's status, message and field (raises AbortError)."""
    meta = ((FIELD_METADATA_KEY, exc.field),) if exc.field else ()
    await context.abort(exc.code, exc.message, trailing_metadata=meta)


async def serve_router(prefill: list[str], decode: list[str], host: str = "127.0.0.1",
                       port: int = 50050, ready: asyncio.Event | None = None,
                       stop: asyncio.Event | None = None, http_port: int | None = None,
                       tokenizer: str | None = None, served_model_name: str | None = None
                       ) -> None:
    """Run the router until `stop` is set (or forever); `ready` is set once it listens.

    Args:
        http_port: also serve the OpenAI HTTP API there (503 until a decode instance has
            answered GetModelInfo), None for none.
        tokenizer: the HTTP API's tokenizer path (default: the decode instance's model path).
        served_model_name: the HTTP API's model name (default: that path's last part).

    Raises:
        OSError: a port cannot be bound.
    """
    pairing = Pairing(prefill, decode)
    server = grpc.aio.server()
    pb_grpc.add_MoeEngineServicer_to_server(RouterServicer(pairing), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"moe-router: cannot listen on {host}:{port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    logger.info("moe-router on %s:%d: prefill %s, decode %s", host, port, prefill, decode)
    http = starting = None
    if http_port is not None:
        http, starting = await _start_http(pairing, host, http_port, tokenizer,
                                           served_model_name)
    if ready is not None:
        ready.set()
    try:
        if stop is None:
            await server.wait_for_termination()
        else:
            await stop.wait()
    finally:
        if http is not None:
            starting.cancel()
            await http.stop()
        await server.stop(grace=5)
        await pairing.close()


async def _start_http(pairing: Pairing, host: str, port: int, tokenizer: str | None,
                      served_model_name: str | None) -> tuple[Any, asyncio.Task]:
    """The OpenAI HTTP API over a `RouterEngine`, and the task that starts the engine: the API
    takes requests once the engine has the decode instances' model info."""
    from moe_engine.disagg.router_engine import RouterEngine
    from moe_engine.server.http import HttpServer, HttpState, build_app
    from moe_engine.server.http.chat_setup import chat_settings

    engine = RouterEngine(pairing, tokenizer)
    state: HttpState | None = None

    async def start() -> None:
        await engine.start()
        # No await from model_info's setting to here: no request sees the settings missing.
        # The chat template and parsers are the checkpoint's defaults, as moe-serve's.
        assert state is not None and engine.model_info is not None
        state.chat = chat_settings(
            chat_template=None, tool_call_parser=None, reasoning_parser=None,
            enable_auto_tool_choice=False, tokenizer=engine.tokenizer,
            model_dir=engine.model_info.model)

    starting = asyncio.create_task(start())

    def status() -> tuple[bool, str]:
        if engine.model_info is not None:
            return True, "serving"
        if starting.done() and starting.exception() is not None:
            return False, f"moe-router: {starting.exception()}"
        return False, "moe-router: waiting for a decode instance's model info"

    def name() -> str:
        info = engine.model_info
        return served_model_name or (Path(info.model).name if info is not None else "")

    state = HttpState(engine, served_model_name or "", status)  # type: ignore[arg-type]
    if served_model_name is None:
        starting.add_done_callback(lambda _: setattr(state, "served_model_name", name()))
    http = HttpServer(build_app(state, max_body_bytes=DEFAULT_MAX_MESSAGE_BYTES, admin=False),
                      host, port)
    await http.start()
    return http, starting
