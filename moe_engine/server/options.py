"""`ServerOptions`: how `moe-serve` listens and behaves (ports, limits, drain, access
control), checked when made; and the two checks of a listening address made before the
servers start (`transport_limit`, `check_bindable`).
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass, field

from moe_engine.errors import StartupError
from moe_engine.server.security import API_KEY_ENV, is_loopback_host

#: Default limit on one request message (bytes).
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
#: Default limit on concurrent calls (HTTP/2 streams) of one client connection.
DEFAULT_MAX_CONCURRENT_STREAMS = 1024
#: Default drain time on shutdown (seconds).
DEFAULT_DRAIN_TIMEOUT_S = 30.0
#: Default interval of the periodic stats log line (seconds), as vLLM's.
DEFAULT_LOG_STATS_INTERVAL_S = 10.0
_MIB = 1024 * 1024
#: The `moe-serve` flag of each listening port of `ServerOptions` (for messages).
PORT_FLAGS = {"http_port": "--port (HTTP)", "port": "--grpc-port", "metrics_port": "--metrics-port"}
#: `moe-serve`'s default ports: the OpenAI HTTP API's (vLLM's) and gRPC's.
DEFAULT_HTTP_PORT = 8000
DEFAULT_GRPC_PORT = 50051


def port_hint() -> str:
    """The sentence that explains the port flags (for the conflict messages)."""
    return (
        f"--port (alias --http-port) is the OpenAI HTTP API's port (default "
        f"{DEFAULT_HTTP_PORT}, as vLLM's) and gRPC listens on --grpc-port (default "
        f"{DEFAULT_GRPC_PORT}); give each its own port, or 0 to turn one off"
    )
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
        port: the gRPC port (`moe-serve --grpc-port`); 0 picks a free one (see
            `MoeServer.port`); None: no gRPC server (`--grpc-port 0`).
        max_message_bytes: the largest GenerateRequest accepted (bytes). Larger ones get
            INVALID_ARGUMENT naming the field; far larger ones (over `transport_limit`: four
            times the limit or the limit plus 64 MiB, whichever is larger) are refused by gRPC
            itself with RESOURCE_EXHAUSTED.
        metrics_port: port for Prometheus /metrics, or None for no endpoint.
        startup_timeout_s: how long loading the model may take (seconds).
        drain_grace_s: on shutdown, how long live requests may run on before they are aborted
            (seconds, `--drain-timeout`).
        stats_poll_s: how often the metrics gauges are refreshed (seconds).
        log_stats_interval_s: how often the stats log line is written while the engine is
            busy (seconds); None: never.
        max_prompt_tokens: the longest prompt accepted (tokens); longer ones get OUT_OF_RANGE
            naming the field and this limit. None: max_model_len - 1, the model's own limit.
        max_concurrent_streams: most concurrent calls of one client connection (gRPC's
            `grpc.max_concurrent_streams`, the HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS the server
            advertises); a client's further calls wait until one of its calls ends.
        api_key: the key every call must send as `authorization: Bearer <key>`, or None for no
            check. Not shown in repr.
        health_requires_api_key: also require the key for the health service (by default
            health is open, so load balancers can probe it).
        tls_cert, tls_key: PEM certificate chain and private key files: serve TLS.
        tls_ca: PEM CA file: require client certificates signed by it (mutual TLS).
        allow_insecure: allow a non-loopback `host` without an API key or client certificates.
        http_port: port of the OpenAI-compatible HTTP API (`moe-serve --port`, alias
            `--http-port`, 8000 there; 0 here picks a free one, see `MoeServer.http_port`), or
            None for none (the default of this class, `--port 0` on the command line). `host`,
            the API key, TLS and `max_message_bytes` (the body limit) apply to it too.
        served_model_name: the model name of the HTTP API (default: the checkpoint folder's
            name).
        chat_template: `--chat-template`: a Jinja file's path or the template itself (None:
            the tokenizer's).
        tool_call_parser: `--tool-call-parser` NAME (None: the checkpoint's default; "none":
            no parser).
        enable_auto_tool_choice: `--enable-auto-tool-choice`.
        reasoning_parser: `--reasoning-parser` NAME (None: the checkpoint's default; "none":
            no parser).
        allow_unknown_fields: the HTTP API ignores request fields it does not know, with one
            warning per field name, instead of refusing them with 400
            (`--allow-unknown-fields`).
        enable_log_requests: log one line per request as it arrives and one as it ends
            (`--enable-log-requests`; vLLM's flag); default off.

    Raises:
        ValueError: a limit out of range, TLS files given by halves, or a non-loopback host
            without authentication and without `allow_insecure` (naming the flags).
    """

    host: str = "127.0.0.1"
    port: int | None = DEFAULT_GRPC_PORT
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    metrics_port: int | None = None
    startup_timeout_s: float = 600.0
    drain_grace_s: float = DEFAULT_DRAIN_TIMEOUT_S
    stats_poll_s: float = 1.0
    log_stats_interval_s: float | None = DEFAULT_LOG_STATS_INTERVAL_S
    max_prompt_tokens: int | None = None
    max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS
    api_key: str | None = field(default=None, repr=False)
    health_requires_api_key: bool = False
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    allow_insecure: bool = False
    http_port: int | None = None
    served_model_name: str | None = None
    chat_template: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    allow_unknown_fields: bool = False
    enable_log_requests: bool = False

    def __post_init__(self) -> None:
        if self.max_message_bytes < 1024:
            raise ValueError(
                f"max_message_bytes must be >= 1024 bytes, got {self.max_message_bytes}"
            )
        for name in ("max_prompt_tokens", "max_concurrent_streams"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.log_stats_interval_s is not None and not self.log_stats_interval_s > 0:
            raise ValueError(
                f"log_stats_interval_s must be > 0 seconds, got {self.log_stats_interval_s}"
            )
        if self.drain_grace_s < 0:
            raise ValueError(f"drain timeout must be >= 0 seconds, got {self.drain_grace_s}")
        self._check_ports()
        self._check_tls()
        self._check_exposure()
        self._check_chat()

    def _check_chat(self) -> None:
        """Unknown parser names, --enable-auto-tool-choice with --tool-call-parser none and an
        unreadable --chat-template file, before the model loads (ValueError naming the flags)."""
        from moe_engine.server.http.chat_setup import check_parser_names, load_chat_template

        check_parser_names(self.tool_call_parser, self.reasoning_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser == "none":
            raise ValueError(  # vLLM refuses it too: auto would have no parser to read calls
                "--enable-auto-tool-choice needs a tool parser, but --tool-call-parser is "
                "'none'; drop one of the two flags")
        load_chat_template(self.chat_template)

    def _check_ports(self) -> None:
        """Refuse no front end at all, and two listeners on one port (0, any free port, never
        collides)."""
        if self.port is None and self.http_port is None:
            raise ValueError(
                "nothing to serve: both the HTTP API (--port/--http-port 0) and gRPC "
                "(--grpc-port 0) are off; give one of them a port"
            )
        named = [(PORT_FLAGS[name], getattr(self, name)) for name in PORT_FLAGS]
        seen: dict[int, str] = {}
        for flag, port in named:
            if not port:
                continue
            if port in seen:
                raise ValueError(
                    f"{seen[port]} {port} and {flag} {port} name the same port: {port_hint()}"
                )
            seen[port] = flag

    def _check_tls(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("give both --tls-cert and --tls-key, or neither")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ValueError(
                "--tls-ca (client certificate verification) needs --tls-cert and --tls-key"
            )

    def _check_exposure(self) -> None:
        """Refuse an unauthenticated server on an address other machines can reach."""
        authenticated = self.api_key is not None or self.tls_ca is not None
        if authenticated or self.allow_insecure or is_loopback_host(self.host):
            return
        raise ValueError(
            f"refusing to listen on {self.host} (not a loopback address) without authentication: "
            f"anyone who can reach it could use the server. Set an API key (--api-key, "
            f"--api-key-file or ${API_KEY_ENV}) or client certificates (--tls-ca), or pass "
            "--allow-insecure to serve it unauthenticated"
        )

    @property
    def tls(self) -> bool:
        """Whether the server speaks TLS."""
        return self.tls_cert is not None


def check_bindable(host: str, port: int, flag: str = "--grpc-port") -> None:
    """Refuse a port that cannot be bound, before gRPC tries it (gRPC prints its own raw log
    lines for a failed bind). Probes every address `host` resolves to with SO_REUSEADDR, as
    gRPC binds; port 0 (any free port) is not probed.

    Args:
        flag: the flag that sets this port (named in the message).

    Raises:
        StartupError: one line naming the address, the reason (in use, not permitted) and the
            flag to change.
    """
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError(f"cannot listen on {host}:{port} (--host): {exc.strerror}") from None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise StartupError(
                        f"cannot listen on {host}:{port}: the port is in use (another "
                        f"moe-serve?); stop that process or pick another {flag}"
                    ) from None
                if exc.errno == errno.EACCES:
                    raise StartupError(
                        f"cannot listen on {host}:{port}: permission denied (ports below 1024 "
                        f"need privileges); pick another {flag}"
                    ) from None
                # Anything else (e.g. no IPv6 on this machine): gRPC decides.
