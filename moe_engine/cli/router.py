"""`moe-router --prefill HOST:PORT[,...] --decode HOST:PORT[,...] [--host H] [--port P]
[--grpc-port G]`: one endpoint in front of `moe-serve --disaggregation-mode prefill` and
`decode` instances (`moe_engine.disagg.router`), reached at their gRPC ports (their
--grpc-port). Clients use it as they use moe-serve: the OpenAI-compatible HTTP API on --port
(alias --http-port; default 8000, 0: off) and gRPC on --grpc-port (default 50050;
`moe-client --server`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from moe_engine.disagg.router import serve_router
from moe_engine.server.options import DEFAULT_HTTP_PORT

#: The router's default gRPC port (one below moe-serve's 50051, so both fit on one host).
ROUTER_GRPC_PORT = 50050


def _addresses(text: str) -> list[str]:
    out = [a.strip() for a in text.split(",") if a.strip()]
    bad = [a for a in out if ":" not in a or not a.rsplit(":", 1)[1].isdigit()]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT[,HOST:PORT...], got {text!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-router", description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", type=_addresses, required=True,
                   help="prefill instances (moe-serve --disaggregation-mode prefill)")
    p.add_argument("--decode", type=_addresses, required=True,
                   help="decode instances (moe-serve --disaggregation-mode decode)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", "--http-port", dest="http_port", type=int,
                   default=DEFAULT_HTTP_PORT,
                   help="port of the OpenAI-compatible HTTP API (/v1/completions, "
                        f"/v1/chat/completions, ...; default {DEFAULT_HTTP_PORT}, as moe-serve's; "
                        "0: none); --http-port is the same flag")
    p.add_argument("--grpc-port", type=int, default=ROUTER_GRPC_PORT,
                   help=f"gRPC port (default {ROUTER_GRPC_PORT})")
    p.add_argument("--tokenizer", default=None,
                   help="the HTTP API's tokenizer (a checkpoint folder; default: the model "
                        "path the decode instances report, which this machine must have)")
    p.add_argument("--served-model-name", default=None,
                   help="the HTTP API's model name (default: the model folder's name, as "
                        "moe-serve)")
    p.add_argument("--log-level", default="INFO")
    return p


def check_ports(args: argparse.Namespace) -> str | None:
    """A one-line message for a port out of range or two uses of one port, else None."""
    for flag, value in (("--port", args.http_port), ("--grpc-port", args.grpc_port)):
        if not 0 <= value <= 65535:
            return f"{flag} must be in 0..65535, got {value}"
    if args.grpc_port == 0:
        return "--grpc-port must name a port: the router always serves gRPC"
    if args.http_port == args.grpc_port:
        return (f"--port (HTTP) {args.http_port} and --grpc-port {args.grpc_port} name the same "
                f"port: --port (alias --http-port) is the OpenAI HTTP API's port (default "
                f"{DEFAULT_HTTP_PORT}) and gRPC listens on --grpc-port (default "
                f"{ROUTER_GRPC_PORT}); give each its own port, or --port 0 for no HTTP API")
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = check_ports(args)
    if problem is not None:
        print(f"moe-router: error: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
    try:
        asyncio.run(serve_router(args.prefill, args.decode, args.host, args.grpc_port,
                                 http_port=args.http_port or None, tokenizer=args.tokenizer,
                                 served_model_name=args.served_model_name))
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
