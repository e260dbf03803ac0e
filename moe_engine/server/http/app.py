"""The FastAPI app and the uvicorn server that runs it in the gRPC server's event loop.

`HttpServer.start` binds the port itself (so a busy port is one StartupError line, not
uvicorn's exit) and runs `uvicorn.Server.serve` as a task of the running loop, beside grpc.aio:
both front ends share one EngineClient. uvicorn's own signal handling is off: `moe-serve`'s
SIGTERM handler drains both front ends (`MoeServer.stop`).

`AccessMiddleware` (pure ASGI, before any routing) checks `Authorization: Bearer <key>` (the
same key as gRPC; /health, /ping, /version, /metrics, /openapi.json and /docs are open unless
--health-requires-api-key) and the body size: over --max-message-bytes is 413, from
Content-Length or while the body streams in. Outside it, `RequestContextMiddleware` puts
`X-Request-Id` on every response.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import ssl
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI

from moe_engine import __version__
from moe_engine.errors import StartupError
from moe_engine.server.http.admin import router as admin_router
from moe_engine.server.http.errors import OpenAIError, error_bytes, install_handlers
from moe_engine.server.http.request_context import RequestContextMiddleware
from moe_engine.server.http.routes import router
from moe_engine.server.http.state import HttpState

logger = logging.getLogger(__name__)

#: How long uvicorn waits for open connections at shutdown, after the drain (seconds).
_SHUTDOWN_GRACE_S = 2.0
#: Paths served without the API key unless --health-requires-api-key: probes, the version,
#: Prometheus' scrape and the API's own description (as vLLM, whose key guards /v1 only).
_OPEN_PATHS = ("/health", "/ping", "/version", "/metrics", "/openapi.json", "/docs",
               "/docs/oauth2-redirect")


def build_app(
    state: HttpState, *, max_body_bytes: int, api_key: str | None = None,
    health_requires_api_key: bool = False, on_auth_failure: Callable[[], None] | None = None,
    admin: bool = True, allow_unknown_fields: bool = False,
) -> Any:
    """The ASGI app: FastAPI with the routes and error handlers (and its OpenAPI description
    on /openapi.json, Swagger UI on /docs), inside AccessMiddleware, inside
    `RequestContextMiddleware` (X-Request-Id on every response; `allow_unknown_fields`:
    `--allow-unknown-fields`); `admin` False leaves out the RL admin endpoints (the router:
    they act on one engine)."""
    app = FastAPI(title="moe-engine", version=__version__, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.http = state
    install_handlers(app)
    app.include_router(router)
    if admin:
        app.include_router(admin_router)  # SGLang's RL endpoints: /pause_generation, ...
    open_paths = () if health_requires_api_key else _OPEN_PATHS
    access = AccessMiddleware(app, max_body_bytes, api_key, open_paths, on_auth_failure)
    return RequestContextMiddleware(access, allow_unknown_fields)


class AccessMiddleware:
    """API key and body-size checks in front of the app (ASGI).

    Args:
        app: the wrapped ASGI app.
        max_body_bytes: the largest request body accepted (bytes).
        api_key: the key each request must carry as `Authorization: Bearer <key>`, or None.
        open_paths: paths served without the key.
        on_auth_failure: called on each refused key (the auth-failures counter).
    """

    def __init__(self, app: Any, max_body_bytes: int, api_key: str | None,
                 open_paths: tuple[str, ...], on_auth_failure: Callable[[], None] | None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key
        self.open_paths = open_paths
        self.on_auth_failure = on_auth_failure

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            self._check_key(scope["path"], headers.get("authorization"))
            self._check_length(headers.get("content-length"))
            receive = await self._buffer_body(receive)
        except OpenAIError as exc:
            await _send_error(send, exc)
            return
        await self.app(scope, receive, send)

    def _check_key(self, path: str, authorization: str | None) -> None:
        if self.api_key is None or path in self.open_paths:
            return
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                              self.api_key.encode()):
            return
        if self.on_auth_failure is not None:
            self.on_auth_failure()
        what = "a wrong API key" if authorization else "no API key"
        raise OpenAIError(
            401, f"{what}: send the server's key as 'Authorization: Bearer <key>'", None,
            "invalid_api_key",
        )

    def _too_large(self, size: int | str) -> OpenAIError:
        return OpenAIError(
            413, f"the request body is {size} bytes, over the limit of {self.max_body_bytes} "
            "bytes (--max-message-bytes)", None, "request_too_large",
        )

    def _check_length(self, content_length: str | None) -> None:
        if content_length is not None and content_length.isdigit():
            if int(content_length) > self.max_body_bytes:
                raise self._too_large(int(content_length))

    async def _buffer_body(self, receive: Callable) -> Callable:
        """Read the whole body (refusing it once it passes the limit) and return a `receive`
        that replays it, then passes on to the connection's (for http.disconnect)."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return _replay([message], receive)
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                raise self._too_large(f"over {size}")
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        return _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}],
                       receive)


def _replay(messages: list[dict], receive: Callable) -> Callable:
    async def replayed() -> dict:
        if messages:
            return messages.pop(0)
        return await receive()

    return replayed


async def _send_error(send: Callable, exc: OpenAIError) -> None:
    body = error_bytes(exc)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if exc.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the owner of the loop drains on SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) with SO_REUSEADDR (not yet listening).

    Raises:
        StartupError: one line naming the address, the reason and --port.
    """
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise StartupError(f"cannot listen on {host}:{port} (--host): {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
    except OSError as exc:
        sock.close()
        raise StartupError(
            f"cannot serve HTTP on {host}:{port}: {exc.strerror or exc}; pick another --port "
            "(the OpenAI HTTP API's port; alias --http-port)"
        ) from None
    sock.set_inheritable(True)
    return sock


class HttpServer:
    """The HTTP front end's uvicorn server in the current event loop.

    Args:
        app: the ASGI app (`build_app`).
        host, port: where to listen (port 0: any free port; see `port` after `start`).
        tls_cert, tls_key, tls_ca: as the gRPC server's (mutual TLS with `tls_ca`).
    """

    def __init__(self, app: Any, host: str, port: int, *, tls_cert: str | None = None,
                 tls_key: str | None = None, tls_ca: str | None = None) -> None:
        self.host = host
        self.port = port
        self.config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
            ssl_certfile=tls_cert, ssl_keyfile=tls_key, ssl_ca_certs=tls_ca,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls_ca else ssl.CERT_NONE,
            timeout_graceful_shutdown=_SHUTDOWN_GRACE_S, timeout_keep_alive=30,
            backlog=4096, limit_concurrency=None,
        )
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Bind and start serving (returns once the port accepts connections).

        Raises:
            StartupError: the port cannot be bound, or a TLS file cannot be read.
        """
        sock = bind_socket(self.host, self.port)
        self.port = sock.getsockname()[1]
        try:
            self.config.load()
        except (OSError, ssl.SSLError) as exc:
            sock.close()
            raise StartupError(f"HTTP TLS (--tls-cert/--tls-key/--tls-ca): {exc}") from exc
        self._server = _Server(self.config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="http-server")
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise StartupError(f"the HTTP server on {self.host}:{self.port} did not start")
            await asyncio.sleep(0.01)
        logger.info("OpenAI-compatible HTTP API on %s://%s:%d/v1",
                    "https" if self.config.is_ssl else "http", self.host, self.port)

    async def stop(self) -> None:
        """Stop accepting, close idle connections, wait briefly for the rest, end the task."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(self._task, _SHUTDOWN_GRACE_S + 5)
        self._server = self._task = None
