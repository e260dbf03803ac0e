"""How `moe-client` reaches a server: TLS credentials and API-key metadata from the flags,
and the synchronous channel that sends that metadata with every call."""

from __future__ import annotations

import argparse
import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from moe_engine.server.security import (
    API_KEY_ENV,
    api_key_from_env,
    auth_metadata,
    channel_credentials,
    check_api_key,
)


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    """Call details with extra metadata (grpc's documented interceptor pattern)."""


class _MetadataInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds fixed metadata (the API key) to every call of a synchronous channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            [*(details.metadata or ()), *self.metadata],
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: grpc.ClientCallDetails,
        request: Any,
    ) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: grpc.ClientCallDetails,
        request: Any,
    ) -> Any:
        return continuation(self._details(client_call_details), request)


def connection_from_args(
    args: argparse.Namespace,
) -> tuple[grpc.ChannelCredentials | None, tuple[tuple[str, str], ...]]:
    """(TLS credentials or None for plaintext, metadata for every call) from the flags.

    Raises:
        ValueError: a key that cannot be sent, half a client certificate, an unreadable file.
    """
    key = args.api_key
    source = "--api-key"
    if key is None:
        key, source = api_key_from_env(), f"${API_KEY_ENV}"
    metadata = auth_metadata(check_api_key(key.strip(), source) if key is not None else None)
    use_tls = args.tls or any(x is not None for x in (args.tls_ca, args.tls_cert, args.tls_key))
    credentials = (
        channel_credentials(args.tls_ca, args.tls_cert, args.tls_key) if use_tls else None
    )
    return credentials, metadata


@contextlib.contextmanager
def open_channel(
    server: str,
    credentials: grpc.ChannelCredentials | None,
    metadata: tuple[tuple[str, str], ...],
) -> Iterator[grpc.Channel]:
    """A synchronous channel to `server` (TLS with `credentials`, plaintext when None) whose
    calls all carry `metadata`; closed when the block ends."""
    # No receive limit (gRPC's default is 4 MiB): a finished response with routed experts
    # carries tokens x moe_layers x top_k int32 (15 MiB for 10k tokens, 48 layers, top-8).
    options = [("grpc.max_receive_message_length", -1)]
    if credentials is None:
        raw_channel = grpc.insecure_channel(server, options=options)
    else:
        raw_channel = grpc.secure_channel(server, credentials, options=options)
    with raw_channel:
        yield grpc.intercept_channel(raw_channel, _MetadataInterceptor(metadata))
