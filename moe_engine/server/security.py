"""Access control settings of the gRPC front end: the API key, TLS material, the bind check.

The API key travels in request metadata as `authorization: Bearer <key>` (RFC 6750 section
2.1, the header gRPC's own `access_token_call_credentials` sends); `interceptors.ApiKeyInterceptor`
checks it on every call. The key comes from `--api-key`, `--api-key-file` or the environment
variable `MOE_ENGINE_API_KEY` (this module is where both `moe-serve` and `moe-client` read it).
TLS uses gRPC's own credentials: a certificate chain and key for the server, and optionally a CA
whose certificates clients must present (mutual TLS).

This module imports only grpc and the standard library, so `moe-client` stays quick to start.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import grpc

#: Environment variable holding the API key (server and client).
API_KEY_ENV = "MOE_ENGINE_API_KEY"
#: Metadata key and scheme of the API key.
AUTH_METADATA_KEY = "authorization"
AUTH_SCHEME = "Bearer"


def api_key_from_env() -> str | None:
    """`$MOE_ENGINE_API_KEY` (surrounding whitespace stripped), or None when unset or empty."""
    value = os.environ.get(API_KEY_ENV, "").strip()
    return value or None


def check_api_key(key: str, source: str) -> str:
    """`key` if it can travel in gRPC metadata (non-empty printable ASCII without spaces).

    Raises:
        ValueError: naming `source` (the flag, file or variable it came from) and the problem;
            the key itself is never echoed.
    """
    if not key:
        raise ValueError(f"{source}: the API key is empty")
    if not all(33 <= ord(c) <= 126 for c in key):
        raise ValueError(
            f"{source}: the API key must be printable ASCII without spaces ({len(key)} "
            "characters given)"
        )
    return key


def resolve_api_key(key: str | None, key_file: str | None) -> str | None:
    """The API key from `--api-key`, `--api-key-file` or `$MOE_ENGINE_API_KEY`, in that order.

    Args:
        key: the value of `--api-key`, or None.
        key_file: a file whose content (surrounding whitespace stripped) is the key, or None.

    Returns:
        The key, or None when none of the three gives one.

    Raises:
        ValueError: both flags given, an unreadable file, or a key that cannot be sent.
    """
    if key is not None and key_file is not None:
        raise ValueError("give either --api-key or --api-key-file, not both")
    if key is not None:
        return check_api_key(key.strip(), "--api-key")
    if key_file is not None:
        try:
            text = Path(key_file).read_text()
        except OSError as exc:
            raise ValueError(
                f"--api-key-file {key_file}: cannot read it ({exc.strerror or exc})"
            ) from exc
        return check_api_key(text.strip(), f"--api-key-file {key_file}")
    env = api_key_from_env()
    return check_api_key(env, f"${API_KEY_ENV}") if env is not None else None


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata a client sends with every call: `authorization: Bearer <key>` (or none)."""
    if api_key is None:
        return ()
    return ((AUTH_METADATA_KEY, f"{AUTH_SCHEME} {api_key}"),)


def is_loopback_host(host: str) -> bool:
    """Whether binding `host` only accepts connections from this machine.

    True for "localhost" and loopback addresses (127.0.0.0/8, ::1, with or without brackets);
    False for wildcard addresses ("0.0.0.0", "::"), other addresses and other host names.
    """
    name = host.strip().removeprefix("[").removesuffix("]")
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from exc


def server_credentials(
    cert: str, key: str, client_ca: str | None = None
) -> grpc.ServerCredentials:
    """TLS credentials for the server.

    Args:
        cert: PEM certificate chain file (`--tls-cert`).
        key: PEM private key file (`--tls-key`).
        client_ca: PEM CA file (`--tls-ca`); when given, every client must present a
            certificate signed by it (mutual TLS).

    Raises:
        ValueError: a file that cannot be read, naming the flag.
    """
    ca = _read(client_ca, "--tls-ca") if client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(_read(key, "--tls-key"), _read(cert, "--tls-cert"))],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def channel_credentials(
    ca: str | None = None, cert: str | None = None, key: str | None = None
) -> grpc.ChannelCredentials:
    """TLS credentials for a client.

    Args:
        ca: PEM CA file that signed the server's certificate (None: the system's roots).
        cert, key: PEM client certificate chain and key, for servers that verify clients;
            both or neither.

    Raises:
        ValueError: only one of cert and key, or a file that cannot be read.
    """
    if (cert is None) != (key is None):
        raise ValueError("give both --tls-cert and --tls-key (the client certificate), or neither")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "--tls-ca") if ca is not None else None,
        private_key=_read(key, "--tls-key") if key is not None else None,
        certificate_chain=_read(cert, "--tls-cert") if cert is not None else None,
    )
