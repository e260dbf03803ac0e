"""`moe-router --prefill HOST:PORT[,...] --decode HOST:PORT[,...] [--host H] [--port P]
[--http-port N]`: one endpoint in front of `moe-serve --disaggregation-mode prefill` and
`decode` instances (`moe_engine.disagg.router`). Clients use it as they use moe-serve: gRPC
(`moe-client --server`) and, with --http-port, the OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from moe_engine.disagg.router import serve_router


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
    p.add_argument("--port", type=int, default=50050, help="gRPC port (default 50050)")
    p.add_argument("--http-port", type=int, default=None,
                   help="also serve the OpenAI-compatible HTTP API (/v1/completions, "
                        "/v1/chat/completions, ...) on this port (default: none)")
    p.add_argument("--tokenizer", default=None,
                   help="the HTTP API's tokenizer (a checkpoint folder; default: the model "
                        "path the decode instances report, which this machine must have)")
    p.add_argument("--served-model-name", default=None,
                   help="the HTTP API's model name (default: the model folder's name, as "
                        "moe-serve)")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
    try:
        asyncio.run(serve_router(args.prefill, args.decode, args.host, args.port,
                                 http_port=args.http_port, tokenizer=args.tokenizer,
                                 served_model_name=args.served_model_name))
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
