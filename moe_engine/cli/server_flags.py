"""`moe-serve`'s front-end flags (the `ServerOptions` they fill): where the APIs listen, the
chat API's template and parsers, streaming, message sizes, and access control. The engine's
flags are in `flags.py`; `cli/serve.py` calls both in the order `--help` lists them.
"""

from __future__ import annotations

import argparse

from moe_engine.cli.flags import parse_bytes
from moe_engine.server.options import (
    DEFAULT_GRPC_PORT,
    DEFAULT_HTTP_PORT,
    DEFAULT_MAX_MESSAGE_BYTES,
)
from moe_engine.server.security import API_KEY_ENV


def add_address_args(p: argparse.ArgumentParser) -> None:
    """Where the server listens: --host, --port (alias --http-port), --grpc-port,
    --served-model-name (`ServerOptions`). As vLLM's, --port is the OpenAI HTTP API's."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--port",
        "--http-port",
        dest="http_port",
        type=int,
        default=DEFAULT_HTTP_PORT,
        metavar="P",
        help="port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        f"/v1/models, /metrics, ...; default {DEFAULT_HTTP_PORT}, as vLLM's; 0: no HTTP API); "
        "--host, the API key and TLS flags apply to it. --http-port is the same flag",
    )
    p.add_argument(
        "--grpc-port",
        type=int,
        default=DEFAULT_GRPC_PORT,
        metavar="P",
        help=f"port of the gRPC API (moe_engine.v1, health, reflection; default "
        f"{DEFAULT_GRPC_PORT}; 0: no gRPC API)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model name of the HTTP API (default: the checkpoint folder's name); "
        "requests naming another model get 404",
    )


def add_chat_args(p: argparse.ArgumentParser) -> None:
    """The HTTP chat API's template and parsers (`ServerOptions`; vLLM's flag names)."""
    p.add_argument(
        "--chat-template", default=None, metavar="PATH_OR_TEMPLATE",
        help="the chat template of /v1/chat/completions: a Jinja file's path or the template "
        "itself (default: the tokenizer's)",
    )
    p.add_argument(
        "--tool-call-parser", default=None, metavar="NAME",
        help="the tool-call parser of chat outputs (default: the checkpoint's family's; "
        "'none': no parsing)",
    )
    p.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help='let tool_choice "auto" (the default when tools are given) parse tool calls from '
        "the output with the tool-call parser",
    )
    p.add_argument(
        "--reasoning-parser", default=None, metavar="NAME",
        help="the reasoning parser that splits reasoning_content off chat outputs (default: "
        "the checkpoint's family's; 'none': off, the reasoning stays in content)",
    )


def add_frontend_args(p: argparse.ArgumentParser) -> None:
    """Request logging and unknown request fields (`ServerOptions`)."""
    log = p.add_mutually_exclusive_group()
    log.add_argument(
        "--enable-log-requests", action="store_true",
        help="log one line per request as it arrives (id, prompt tokens, sampling "
        "parameters; not the prompt) and one as it ends (vLLM's flag; default off)",
    )
    log.add_argument(
        "--disable-log-requests", action="store_true",
        help="no per-request log lines: the default (vLLM's older flag, accepted for scripts)",
    )
    p.add_argument(
        "--allow-unknown-fields", action="store_true",
        help="the HTTP API ignores request fields it does not know, with one warning per field "
        "name, instead of refusing them with 400 (for SDKs that send other engines' extras; "
        "default off: a misspelt field is an error, not silently dropped)",
    )


def add_message_args(p: argparse.ArgumentParser) -> None:
    """--metrics-port and --max-message-bytes (`ServerOptions`)."""
    p.add_argument(
        "--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port"
    )
    p.add_argument(
        "--max-message-bytes",
        type=parse_bytes,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help=f"largest GenerateRequest accepted, e.g. 16MiB (default {DEFAULT_MAX_MESSAGE_BYTES} "
        "bytes); larger requests get INVALID_ARGUMENT naming the field, the size and this "
        "flag; gRPC itself refuses (RESOURCE_EXHAUSTED) only messages over 4x this or this "
        "plus 64 MiB, whichever is larger",
    )


def add_access_args(p: argparse.ArgumentParser) -> None:
    """API key, TLS and the non-loopback bind check."""
    g = p.add_argument_group(
        "access control",
        f"an API key (--api-key, --api-key-file or ${API_KEY_ENV}) is checked on every call "
        "from the metadata 'authorization: Bearer KEY' (UNAUTHENTICATED otherwise); a "
        "non-loopback --host needs a key or --tls-ca unless --allow-insecure",
    )
    key = g.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key",
        default=None,
        help=f"the API key (default: none, or ${API_KEY_ENV}); visible to other local users in "
        "the process list, so prefer --api-key-file or the variable",
    )
    key.add_argument(
        "--api-key-file", default=None, help="file holding the API key (default: none)"
    )
    g.add_argument(
        "--health-requires-api-key",
        action="store_true",
        help="also require the key for the gRPC health service (default: health is open)",
    )
    g.add_argument(
        "--tls-cert", default=None, help="PEM certificate chain: serve TLS (default: plaintext)"
    )
    g.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert (default: none)")
    g.add_argument(
        "--tls-ca",
        default=None,
        help="PEM CA: require client certificates signed by it (mutual TLS; default off)",
    )
    g.add_argument(
        "--allow-insecure",
        action="store_true",
        help="allow a non-loopback --host without an API key or client certificates "
        "(default off: such a server refuses to start)",
    )
