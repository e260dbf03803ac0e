"""What `moe-client` prints for a failed call: the status code and details, with a hint.

The hints say what to do when gRPC itself refused the call: a message over the size limit, or
no connection (nothing listening, an unknown host, a TLS mismatch). An UNAVAILABLE the server
itself answered (loading, draining) gets no hint: its details already say why.
"""

from __future__ import annotations

import sys

import grpc

#: gRPC's own words (in UNAVAILABLE details) for a call that never reached a server: a host
#: name that does not resolve, and nothing listening.
_RESOLVE_FAILURES = ("errors resolving", "dns resolution failed", "name resolution")
_CONNECT_FAILURES = (
    "failed to connect",
    "connection refused",
    "connections to all backends failing",
)


def error_text(err: grpc.RpcError, server: str | None = None) -> str:
    """`CODE: details`, with a hint when gRPC itself refused an oversize message, or when the
    call could not reach `server` (nothing listening, an unknown host, a TLS mismatch)."""
    details = err.details() or ""
    text = f"{err.code().name}: {details}"
    if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
        text += (
            " (the request is far over the server's message size limit: send a smaller "
            "request, or restart moe-serve with a larger --max-message-bytes)"
        )
    elif err.code() == grpc.StatusCode.UNAVAILABLE:
        text += _connect_hint(details.lower(), server or "the address given")
    return text


def _connect_hint(details: str, server: str) -> str:
    """The hint for an UNAVAILABLE whose details are gRPC's connection errors ("" otherwise:
    the server itself answered UNAVAILABLE, e.g. while it loads or drains)."""
    if "handshake" in details or "ssl" in details:
        return (
            f" (the TLS handshake with {server} failed: drop --tls for a plaintext server, or "
            "give the CA that signed its certificate with --tls-ca)"
        )
    if "socket closed" in details:
        return (
            f" (the connection to {server} was closed: is it a moe-serve server? a TLS server "
            "needs --tls)"
        )
    if any(phrase in details for phrase in _RESOLVE_FAILURES):
        host = server.rpartition(":")[0] or server
        return f" (the host {host} of {server} does not resolve: check --server HOST:PORT)"
    if any(phrase in details for phrase in _CONNECT_FAILURES):
        return (
            f" (the server may not be running at {server}: start it with `moe-serve`, or "
            "point --server HOST:PORT at it)"
        )
    return ""


def fail(err: grpc.RpcError, server: str | None = None) -> int:
    """Print `error: <error_text>` to stderr; returns 1, the exit status for a failed call."""
    print(f"error: {error_text(err, server)}", file=sys.stderr)
    return 1
