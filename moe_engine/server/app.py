"""The gRPC server: MoeEngine servicer + grpc.health.v1 + reflection, and its lifetime.

Order of startup: bind and start the gRPC server with health NOT_SERVING (clients can poll it
while the model loads), start the engine core process, then switch health to SERVING. Shutdown
(SIGTERM / SIGINT, or `MoeServer.stop`) drains: health NOT_SERVING and new Generate calls
UNAVAILABLE, live requests get `drain_grace_s` to finish, the rest are cancelled (and so
aborted), then the core process stops. If the core process dies, the server stops with an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from moe_engine.config import EngineConfig
from moe_engine.engine.client import EngineClient
from moe_engine.engine.core_proc import DEFAULT_CORE_FACTORY
from moe_engine.errors import RequestError, StartupError
from moe_engine.server.metrics import ServerMetrics
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.server.servicer import MoeEngineServicer

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["MoeEngine"].full_name
#: Default limit on one request message (bytes).
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
_MIB = 1024 * 1024
_GRPC_MAX = 2**31 - 1


def transport_limit(max_message_bytes: int) -> int:
    """gRPC's own receive limit for a `max_message_bytes` setting (bytes).

    Well above the setting, so that an oversize request reaches the servicer, which refuses it
    with INVALID_ARGUMENT naming the field, the size, the limit and --max-message-bytes; only
    messages over this transport limit get gRPC's bare RESOURCE_EXHAUSTED.
    """
    return min(_GRPC_MAX, max(4 * max_message_bytes, max_message_bytes + 64 * _MIB))


@dataclass(frozen=True)
class ServerOptions:
    """How the server listens and behaves.

    Attributes:
        host: address to bind (loopback by default).
        port: TCP port; 0 picks a free one (see `MoeServer.port`).
        max_message_bytes: the largest GenerateRequest accepted (bytes). Larger ones get
            INVALID_ARGUMENT naming the field; far larger ones (over `transport_limit`: four
            times the limit or the limit plus 64 MiB, whichever is larger) are refused by gRPC
            itself with RESOURCE_EXHAUSTED.
        metrics_port: port for Prometheus /metrics, or None for no endpoint.
        startup_timeout_s: how long loading the model may take (seconds).
        drain_grace_s: on shutdown, how long live requests may run on (seconds).
        stats_poll_s: how often the metrics gauges are refreshed (seconds).
    """

    host: str = "127.0.0.1"
    port: int = 50051
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    metrics_port: int | None = None
    startup_timeout_s: float = 600.0
    drain_grace_s: float = 30.0
    stats_poll_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_message_bytes < 1024:
            raise ValueError(
                f"max_message_bytes must be >= 1024 bytes, got {self.max_message_bytes}"
            )


class MoeServer:
    """One gRPC server in front of one engine core process.

    Args:
        config: the engine configuration.
        options: listening and lifetime options.
        core_factory: "module:attribute" of the engine core class (tests only).
        log_level: the core process's logging level.
    """

    def __init__(
        self,
        config: EngineConfig,
        options: ServerOptions,
        *,
        core_factory: str = DEFAULT_CORE_FACTORY,
        log_level: int = logging.INFO,
    ) -> None:
        self.config = config
        self.options = options
        self.core_factory = core_factory
        self.log_level = log_level
        self.engine = EngineClient()
        self.metrics = ServerMetrics()
        self.servicer = MoeEngineServicer(self.engine, options.max_message_bytes, self.metrics)
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._metrics_http = None
        self._poll_task: asyncio.Task | None = None

    async def start(self) -> None:
        """Listen, load the model, then report SERVING.

        Raises:
            StartupError: the port cannot be bound or the engine failed to start.
        """
        await self._start_grpc()
        try:
            self._start_metrics()
            await self.engine.start(
                self.config,
                startup_timeout_s=self.options.startup_timeout_s,
                core_factory=self.core_factory,
                log_level=self.log_level,
            )
        except BaseException:
            # Leave nothing behind: no listening socket, no metrics thread, no core process.
            await self.engine.shutdown(timeout_s=1.0)
            self._stop_metrics()
            await self._stop_grpc(0)
            raise
        self.servicer.ready = True
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        if self._metrics_http is not None:
            self._poll_task = asyncio.create_task(self._poll_stats(), name="metrics-poll")
        logger.info("serving %s on %s:%d", self.config.model.model, self.options.host, self.port)

    def _start_metrics(self) -> None:
        """Serve /metrics when a metrics port is configured.

        Raises:
            StartupError: the port cannot be bound (in use, no permission).
        """
        port = self.options.metrics_port
        if port is None:
            return
        host = self.options.host
        try:
            self._metrics_http = self.metrics.start_http(port, host)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise StartupError(
                f"cannot serve metrics on {host}:{port} (--metrics-port {port}): {reason}"
            ) from exc
        logger.info("metrics on http://%s:%d/metrics", host, self._metrics_http.server_port)

    def _stop_metrics(self) -> None:
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
            self._metrics_http = None

    async def _start_grpc(self) -> None:
        receive_limit = transport_limit(self.options.max_message_bytes)
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", receive_limit),
                ("grpc.max_send_message_length", -1),
                ("grpc.so_reuseport", 0),
            ]
        )
        pb_grpc.add_MoeEngineServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{self.options.host}:{self.options.port}"
        try:
            self.port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise StartupError(f"cannot listen on {address} (--host/--port): {exc}") from exc
        await server.start()
        self._server = server
        logger.info(
            "listening on %s:%d (NOT_SERVING until the model is loaded)",
            self.options.host,
            self.port,
        )

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def _poll_stats(self) -> None:
        while True:
            try:
                self.metrics.update_from_stats(await self.engine.get_stats())
            except RequestError as exc:
                logger.debug("metrics poll: %s", exc.message)
            await asyncio.sleep(self.options.stats_poll_s)

    async def wait_for_engine_death(self) -> str:
        """Return the reason once the engine core is gone."""
        await self.engine.dead.wait()
        return self.engine.death_reason or "engine core stopped"

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain (up to `grace_s`, default options.drain_grace_s), then stop everything."""
        grace = self.options.drain_grace_s if grace_s is None else grace_s
        self.servicer.ready = False
        self.servicer.unavailable_reason = "the server is shutting down"
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = asyncio.get_running_loop().time() + grace
        while self.engine.num_live_requests and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        if self._poll_task is not None:
            self._poll_task.cancel()
            await asyncio.gather(self._poll_task, return_exceptions=True)
        await self._stop_grpc(1.0)
        await self.engine.shutdown()
        self._stop_metrics()

    async def _stop_grpc(self, grace_s: float) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None


async def serve(config: EngineConfig, options: ServerOptions, log_level: int = logging.INFO) -> int:
    """Run a server until SIGTERM/SIGINT (exit status 0) or the engine dies (status 1).

    Raises:
        StartupError: the server could not start.
    """
    server = MoeServer(config, options, log_level=log_level)
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    start = asyncio.create_task(server.start())
    stop_wait = asyncio.create_task(stop_requested.wait())
    await asyncio.wait({start, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    if not start.done():  # interrupted while loading
        start.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await start
        await server.stop(0)
        return 0
    start.result()  # raises StartupError
    death = asyncio.create_task(server.wait_for_engine_death())
    await asyncio.wait({stop_wait, death}, return_when=asyncio.FIRST_COMPLETED)
    if death.done():
        logger.error("stopping: %s", death.result())
        await server.stop(0)
        return 1
    death.cancel()
    logger.info("shutting down: draining for up to %.0f s", options.drain_grace_s)
    await server.stop()
    return 0
