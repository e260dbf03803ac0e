"""`moe-serve`: serve an MoE checkpoint (the built-in demo by default) over gRPC.

    moe-serve [--model PATH|demo] [--host 127.0.0.1] [--port 50051]
              [--dtype auto|bfloat16|float32] [--max-model-len N] [--max-num-seqs N]
              [--max-num-batched-tokens N] [--kv-cache-memory BYTES] [--block-size N]
              [--metrics-port P] [--max-message-bytes BYTES] [--log-level LEVEL]

Ready when the gRPC health service (grpc.health.v1) says SERVING. SIGTERM or Ctrl-C drains and
exits 0; a startup failure exits 1 with the reason (numbers and the flag that fixes it).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import sys

from moe_engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    QuantConfig,
    SchedulerConfig,
)
from moe_engine.errors import StartupError
from moe_engine.server.app import DEFAULT_MAX_MESSAGE_BYTES, ServerOptions, serve

logger = logging.getLogger("moe_engine.serve")

_UNITS = {
    "": 1,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "t": 1000**4,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
}


def parse_bytes(text: str) -> int:
    """A byte count: a plain integer or with a unit ("512MiB", "4G", "4GiB", "1.5GB").

    Raises:
        argparse.ArgumentTypeError: for anything else.
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected bytes like 4294967296 or 4GiB, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moe-serve", description="Serve an MoE checkpoint over gRPC (moe_engine.v1)."
    )
    p.add_argument(
        "--model",
        default="demo",
        help="checkpoint directory (config.json + *.safetensors [+ tokenizer]) or 'demo' "
        "(default: a small Qwen3-MoE demo made on first use)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (default 50051)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output limit (tokens)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    p.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=None,
        help="bytes for the KV cache, e.g. 2GiB (default: derived from free memory)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--quantization",
        default="none",
        choices=["none", "int4", "mxfp4"],
        help="store the routed experts in 4 bits, quantized at load time (default none); "
        "on CPU int4 is also faster, mxfp4 is a slow exact path for now",
    )
    p.add_argument(
        "--quant-group-size",
        type=int,
        default=128,
        choices=[32, 64, 128],
        help="int4 values per scale (default 128)",
    )
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
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def engine_config_from_args(args: argparse.Namespace, model: str) -> EngineConfig:
    """The EngineConfig the flags describe.

    Raises:
        ValueError: a flag value out of range (the message names it).
    """
    return EngineConfig(
        model=ModelConfig(model=model, dtype=args.dtype, max_model_len=args.max_model_len),
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
        ),
        quant=QuantConfig(method=args.quantization, group_size=args.quant_group_size),
    )


def resolve_model(model: str) -> str:
    """The checkpoint directory: `model` itself, or the demo checkpoint for "demo"."""
    if model != "demo":
        return model
    from moe_engine.demo import ensure_demo_checkpoint

    path = str(ensure_demo_checkpoint())
    logger.info("demo checkpoint: %s", path)
    return path


_PORT_MAX = 65535


def check_args(args: argparse.Namespace) -> str | None:
    """A one-line message for the first flag value out of range, or None when all are fine."""
    for flag, value in (("--port", args.port), ("--metrics-port", args.metrics_port)):
        if value is not None and not 0 <= value <= _PORT_MAX:
            return f"{flag} must be in 0..{_PORT_MAX}, got {value}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = check_args(args)
    if problem is not None:
        print(f"moe-serve: error: {problem}", file=sys.stderr)
        return 2
    level = getattr(logging, args.log_level)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        model = resolve_model(args.model)
        config = engine_config_from_args(args, model)
        config.model.hf_config()  # fail fast on a path without config.json
        options = ServerOptions(
            host=args.host,
            port=args.port,
            max_message_bytes=args.max_message_bytes,
            metrics_port=args.metrics_port,
        )
        return asyncio.run(serve(config, options, log_level=level))
    except (StartupError, ValueError, FileNotFoundError) as exc:
        print(f"moe-serve: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
