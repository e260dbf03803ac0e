"""The server: the gRPC API (MoeEngine servicer + grpc.health.v1 + reflection; `options.port`,
`--grpc-port`) and the OpenAI HTTP API (`options.http_port`, `--port`) over one engine, and
their lifetime.

Order of startup: bind and start the gRPC server with health NOT_SERVING (clients can poll it
while the model loads) and the HTTP API (503 until then), start the engine core process, then
switch health to SERVING. Until
then every health check carries what the engine does in its trailing metadata
(`moe-engine-status`, e.g. "server unavailable: building native CPU kernels (25 s elapsed, about
40 s left)"), other calls get UNAVAILABLE with the same text, and `GET /health` on the HTTP
and the metrics ports answers 503 with it (200 once serving). While busy, a log line every
`log_stats_interval_s` gives requests, KV usage and throughput (`metrics.StatsLogger`). Shutdown
(SIGTERM / SIGINT, or `MoeServer.stop`) drains: health NOT_SERVING and new Generate calls
UNAVAILABLE, live requests get `drain_grace_s` to finish, the rest are aborted (their streams end
with finish_reason "abort"), then the core process stops. If the core process dies, the server
stops with an error.

Access control (DESIGN.md section 8): an optional API key checked on every call by
`interceptors.ApiKeyInterceptor`, optional TLS (mutual when a client CA is given), and a refusal
to listen on a non-loopback address without either unless `allow_insecure`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from moe_engine.engine.client import EngineClient
from moe_engine.engine.core_proc import DEFAULT_CORE_FACTORY
from moe_engine.errors import RequestError, StartupError
from moe_engine.server.http import HttpServer, HttpState, build_app
from moe_engine.server.http.chat_setup import chat_settings
from moe_engine.server.http.state import ChatSettings
from moe_engine.server.interceptors import (
    HEALTH_METHOD_PREFIX,
    ApiKeyInterceptor,
    DecodeErrorInterceptor,
)
from moe_engine.server.metrics import ServerMetrics, StatsLogger
from moe_engine.server.options import ServerOptions, check_bindable, transport_limit
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.server.security import server_credentials
from moe_engine.server.servicer import MoeEngineServicer
from moe_engine.startup.config import EngineConfig
from moe_engine.weight_update.messages import ResumeGeneration

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["MoeEngine"].full_name
#: After the drain time, how long aborted streams get to send their last response (seconds).
_ABORT_FLUSH_S = 2.0
#: Trailing metadata key of a health check: why it is NOT_SERVING (or "serving").
STATUS_METADATA_KEY = "moe-engine-status"


class StatusHealthServicer(health.aio.HealthServicer):
    """grpc.health.v1 whose Check also says why: the trailing metadata `moe-engine-status`
    carries `status_detail()` ("serving", or what the starting engine does), since the
    standard HealthCheckResponse has no message field.

    Args:
        status_detail: the current detail line (ASCII is sent; other characters become "?").
    """

    def __init__(self, status_detail: Callable[[], str]) -> None:
        super().__init__()
        self._status_detail = status_detail

    async def Check(  # noqa: N802 - gRPC method name
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        detail = self._status_detail().encode("ascii", "replace").decode()
        context.set_trailing_metadata(((STATUS_METADATA_KEY, detail),))
        return await super().Check(request, context)


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
        self.engine.log_requests = options.enable_log_requests
        self.metrics = ServerMetrics()
        self.servicer = MoeEngineServicer(
            self.engine,
            options.max_message_bytes,
            self.metrics,
            max_prompt_tokens=options.max_prompt_tokens,
        )
        self.health = StatusHealthServicer(self.servicer.status_detail)
        self.served_model_name = options.served_model_name or Path(config.model.model).name
        self.http_state = HttpState(
            self.engine,
            self.served_model_name,
            self._http_status,
            self.metrics,
            options.max_prompt_tokens,
        )
        self.http: HttpServer | None = None
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._metrics_http = None
        self._poll_task: asyncio.Task | None = None
        self._log_task: asyncio.Task | None = None

    async def start(self) -> None:
        """Listen, load the model, then report SERVING.

        Raises:
            StartupError: the port cannot be bound or the engine failed to start.
        """
        await self._start_grpc()
        try:
            await self._start_http()
            self._start_metrics()
            await self.engine.start(
                self.config,
                startup_timeout_s=self.options.startup_timeout_s,
                core_factory=self.core_factory,
                log_level=self.log_level,
            )
            self.http_state.chat = self._chat_settings()
        except BaseException:
            # Leave nothing behind: no listening socket, no metrics thread, no core process.
            await self.engine.shutdown(timeout_s=1.0)
            self._stop_metrics()
            await self._stop_http()
            await self._stop_grpc(0)
            raise
        self.servicer.ready = True
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        info = self.engine.model_info
        if info is not None:
            self.metrics.enable_vllm(self.served_model_name, info.max_model_len)
        if self._metrics_http is not None or self.http is not None:  # both serve /metrics
            self._poll_task = asyncio.create_task(self._poll_stats(), name="metrics-poll")
        if self.options.log_stats_interval_s is not None:
            self._log_task = asyncio.create_task(
                self._log_stats(self.options.log_stats_interval_s), name="stats-log"
            )
        where = [f"gRPC :{self.port}"] if self.port is not None else []
        where += [f"HTTP :{self.http_port}"] if self.http_port is not None else []
        logger.info("serving %s on %s (%s)", self.config.model.model, self.options.host,
                    ", ".join(where))

    def _chat_settings(self) -> ChatSettings:
        """The chat template and parsers of the HTTP API, now that the tokenizer is loaded.

        Raises:
            StartupError: a `--chat-template` file that cannot be read.
        """
        opts = self.options
        try:
            return chat_settings(
                chat_template=opts.chat_template, tool_call_parser=opts.tool_call_parser,
                reasoning_parser=opts.reasoning_parser,
                enable_auto_tool_choice=opts.enable_auto_tool_choice,
                tokenizer=self.engine.tokenizer, model_dir=self.config.model.model)
        except ValueError as exc:
            raise StartupError(str(exc)) from None

    async def _start_http(self) -> None:
        """Serve the OpenAI-compatible HTTP API when an HTTP port is configured (503 until the
        model is loaded).

        Raises:
            StartupError: the port cannot be bound or a TLS file cannot be read.
        """
        opts = self.options
        if opts.http_port is None:
            return
        app = build_app(
            self.http_state,
            max_body_bytes=opts.max_message_bytes,
            api_key=opts.api_key,
            health_requires_api_key=opts.health_requires_api_key,
            on_auth_failure=self.metrics.auth_failures.inc,
            allow_unknown_fields=opts.allow_unknown_fields,
        )
        server = HttpServer(app, opts.host, opts.http_port, tls_cert=opts.tls_cert,
                            tls_key=opts.tls_key, tls_ca=opts.tls_ca)
        await server.start()
        self.http = server

    @property
    def http_port(self) -> int | None:
        """The HTTP API's bound port (None without one)."""
        return self.http.port if self.http is not None else None

    def _http_status(self) -> tuple[bool, str]:
        """Whether the HTTP API takes new requests, and the detail line (as gRPC's)."""
        ready = self.servicer.ready and not self.engine.dead.is_set()
        return ready, self.servicer.status_detail()

    async def _stop_http(self) -> None:
        if self.http is not None:
            await self.http.stop()
            self.http = None

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
            self._metrics_http = self.metrics.start_http(port, host, health=self._http_health)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise StartupError(
                f"cannot serve metrics on {host}:{port} (--metrics-port {port}): {reason}"
            ) from exc
        bound = self._metrics_http.server_port
        logger.info("metrics on http://%s:%d/metrics, health on /health", host, bound)

    def _http_health(self) -> tuple[bool, str]:
        """`GET /health` (called from the HTTP thread; reads only)."""
        return self.servicer.ready and not self.engine.dead.is_set(), self.servicer.status_detail()

    def _stop_metrics(self) -> None:
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
            self._metrics_http = None

    def _interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """The API-key check (when a key is set) first, then the decode-error status."""
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if self.options.api_key is not None:
            exempt = () if self.options.health_requires_api_key else (HEALTH_METHOD_PREFIX,)
            interceptors.append(
                ApiKeyInterceptor(self.options.api_key, exempt, self.metrics.auth_failures.inc)
            )
        interceptors.append(DecodeErrorInterceptor())
        return interceptors

    async def _start_grpc(self) -> None:
        """Bind and start the gRPC server (health NOT_SERVING), unless `options.port` is None
        (no gRPC: `--grpc-port 0`; the health servicer still tracks the status).

        Raises:
            StartupError: the port cannot be bound or a TLS file cannot be read.
        """
        if self.options.port is None:
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            return
        receive_limit = transport_limit(self.options.max_message_bytes)
        server = grpc.aio.server(
            interceptors=self._interceptors(),
            options=[
                ("grpc.max_receive_message_length", receive_limit),
                ("grpc.max_send_message_length", -1),
                ("grpc.so_reuseport", 0),
                ("grpc.max_concurrent_streams", self.options.max_concurrent_streams),
            ],
        )
        pb_grpc.add_MoeEngineServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        host = self.options.host
        if ":" in host and not host.startswith("["):  # an IPv6 literal: [::1]:port
            host = f"[{host}]"
        address = f"{host}:{self.options.port}"
        opts = self.options
        check_bindable(self.options.host, self.options.port, "--grpc-port")  # before gRPC's logs
        try:
            if opts.tls_cert is not None and opts.tls_key is not None:
                credentials = server_credentials(opts.tls_cert, opts.tls_key, opts.tls_ca)
                self.port = server.add_secure_port(address, credentials)
            else:
                self.port = server.add_insecure_port(address)
        except ValueError as exc:  # an unreadable TLS file
            raise StartupError(str(exc)) from exc
        except RuntimeError as exc:
            raise StartupError(f"cannot listen on {address} (--host/--grpc-port): {exc}") from exc
        await server.start()
        self._server = server
        logger.info(
            "listening on %s:%d (%s, %s; NOT_SERVING until the model is loaded)",
            self.options.host,
            self.port,
            ("mutual TLS" if opts.tls_ca else "TLS") if opts.tls else "plaintext",
            "API key required" if opts.api_key is not None else "no API key",
        )

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def _poll_stats(self) -> None:
        while True:
            try:
                self.metrics.update_from_stats(await self.engine.get_stats())
                self.metrics.update_from_expert_load(await self.engine.get_expert_load())
            except RequestError as exc:
                logger.debug("metrics poll: %s", exc.message)
            await asyncio.sleep(self.options.stats_poll_s)

    async def _log_stats(self, interval_s: float) -> None:
        """Every `interval_s`, the stats log line (written only while the engine is busy)."""
        stats_log = StatsLogger()
        loop = asyncio.get_running_loop()
        while not self.engine.dead.is_set():
            try:
                stats_log.observe(await self.engine.get_stats(), loop.time())
            except RequestError as exc:
                logger.debug("stats log: %s", exc.message)
            await asyncio.sleep(interval_s)

    async def wait_for_engine_death(self) -> str:
        """Return the reason once the engine core is gone."""
        await self.engine.dead.wait()
        return self.engine.death_reason or "engine core stopped"

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain, then stop everything.

        Health turns NOT_SERVING and new Generate calls get UNAVAILABLE at once; live requests
        may run for `grace_s` seconds (default options.drain_grace_s), then the rest are aborted
        (each stream ends with a finish_reason "abort" response) before gRPC and the engine
        core stop.
        """
        grace = self.options.drain_grace_s if grace_s is None else grace_s
        self.servicer.ready = False
        self.servicer.unavailable_reason = "the server is shutting down"
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._resume_to_drain()
        await self._wait_until_idle(grace)
        if self.engine.num_live_requests and not self.engine.dead.is_set():
            aborted = await self.servicer.abort_all() + await self.http_state.abort_all()
            logger.warning("drain time (%.1f s) over: aborted %d live requests", grace, aborted)
            await self._wait_until_idle(_ABORT_FLUSH_S)
        for task in (self._poll_task, self._log_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self._stop_http()
        await self._stop_grpc(1.0)
        await self.engine.shutdown()
        self._stop_metrics()

    async def _resume_to_drain(self) -> None:
        """A paused engine steps again, so that the drain lets its live requests finish
        instead of waiting out the grace time (RL's PauseGeneration)."""
        if not self.engine.paused or self.engine.dead.is_set():
            return
        try:
            await self.engine.control(ResumeGeneration, 30.0)
            logger.info("generation resumed for the drain")
        except RequestError as exc:
            logger.warning("could not resume generation for the drain: %s", exc.message)

    async def _wait_until_idle(self, timeout_s: float) -> None:
        """Wait until no request is live in the front end, or `timeout_s` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.engine.num_live_requests and loop.time() < deadline:
            await asyncio.sleep(0.05)

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
