"""`moe-serve`: serve an MoE checkpoint (the built-in demo by default) over gRPC.

    moe-serve [--model PATH|ORG/NAME|demo] [--host 127.0.0.1] [--port 50051] [--version]
              [--http-port P] [--served-model-name NAME]
              [--dtype auto|bfloat16|float32] [--max-model-len N] [--max-num-seqs N]
              [--max-num-batched-tokens N] [--stream-interval N] [--kv-cache-memory BYTES]
              [--block-size N]
              [--enable-prefix-caching] [--device auto|cpu|cuda] [--gpu-memory-utilization F]
              [--enforce-eager]
              [--metrics-port P] [--max-message-bytes BYTES] [--log-level LEVEL]
              [--max-waiting-requests N] [--max-prompt-tokens N] [--max-concurrent-streams N]
              [--drain-timeout S] [--api-key KEY | --api-key-file PATH]
              [--health-requires-api-key] [--tls-cert PEM --tls-key PEM [--tls-ca PEM]]
              [--allow-insecure]
              [--ep-size N] [--collective-timeout S] [--expert-placement FILE]
              [--nnodes N --node-rank K --rdzv-endpoint HOST:PORT]
              [--speculative-method ngram [--num-speculative-tokens K] [--ngram-min N]
               [--ngram-max N] [--speculative-disable-by-batch-size N]]
              [--weight-version V]

Ready when the gRPC health service (grpc.health.v1) says SERVING. SIGTERM or Ctrl-C drains and
exits 0; a startup failure exits 1 with the reason (numbers and the flag that fixes it).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from kernels.registry import (
    OPS,
    KernelBackendError,
    check_kernel_backend,
    parse_kernel_backend,
    resolve_device,
)
from moe_engine import __version__
from moe_engine.disagg.transfer import BACKENDS
from moe_engine.errors import StartupError
from moe_engine.models.loader import safetensors_files
from moe_engine.server.app import serve
from moe_engine.server.options import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_MAX_CONCURRENT_STREAMS,
    DEFAULT_MAX_MESSAGE_BYTES,
    ServerOptions,
)
from moe_engine.server.security import API_KEY_ENV, resolve_api_key
from moe_engine.startup.config import (
    DEVICE_CHOICES,
    DISAGG_MODES,
    CacheConfig,
    DeviceConfig,
    DisaggConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    QuantConfig,
    SchedulerConfig,
    check_cpu_environment,
)
from moe_engine.startup.config import parse_bytes as config_parse_bytes
from moe_engine.startup.model_path import resolve_model_dir
from moe_engine.startup.quant_config import resolve_quant_config
from moe_engine.startup.spec_config import add_speculative_arguments, speculative_config_from_args
from moe_engine.weight_update.messages import weight_version_problem

logger = logging.getLogger("moe_engine.serve")


def parse_bytes(text: str) -> int:
    """`config.parse_bytes` for argparse.

    Raises:
        argparse.ArgumentTypeError: anything but a byte count.
    """
    try:
        return config_parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_fraction(text: str) -> float:
    """--gpu-memory-utilization: a fraction in (0, 1].

    Raises:
        argparse.ArgumentTypeError: anything else (names the value and the limit).
    """
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value <= 1:
        raise argparse.ArgumentTypeError(
            f"gpu_memory_utilization must be a fraction in (0, 1] of the device's memory, "
            f"got {text!r}"
        )
    return value


def add_device_flags(p: argparse.ArgumentParser) -> None:
    """--device, --gpu-memory-utilization and --enforce-eager (`config.DeviceConfig`)."""
    p.add_argument(
        "--device",
        default="auto",
        choices=list(DEVICE_CHOICES),
        help="where weights, KV cache and activations live (default auto: cuda when torch "
        "sees a CUDA device, else cpu)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=parse_fraction,
        default=DeviceConfig.gpu_memory_utilization,
        metavar="F",
        help="fraction in (0, 1] of the CUDA device's memory for weights, activations and KV "
        f"cache (default {DeviceConfig.gpu_memory_utilization}); the KV cache gets what the "
        "weights and a profiled activation peak leave. Ignored on cpu",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="never capture CUDA graphs: every step runs eagerly (default: decode-only steps "
        "replay graphs captured at startup at padded batch sizes, on cuda with the triton "
        "decode kernels and --ep-size 1)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moe-serve", description="Serve an MoE checkpoint over gRPC (moe_engine.v1)."
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument(
        "--model",
        default="demo",
        help="checkpoint directory (config.json + *.safetensors [+ tokenizer]), a Hugging Face "
        "hub id (org/name) already in the local hub cache ($HF_HUB_CACHE; nothing is "
        "downloaded), or 'demo' (default: a small Qwen3-MoE demo made on first use)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (default 50051)")
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        metavar="P",
        help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, ...) on this port, same engine (default: off); --host, the API key and "
        "TLS flags apply to it",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model name of the HTTP API (default: the checkpoint folder's name); "
        "requests naming another model get 404",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output limit (tokens)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    p.add_argument(
        "--stream-interval", type=int, default=1, metavar="N",
        help="send each request's new tokens every N tokens (default 1: every token; the "
        "first token and the last output at once): fewer messages per token, burstier streams",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=None,
        help="bytes for the KV cache, e.g. 2GiB (default: derived from free memory)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--disaggregation-mode", choices=DISAGG_MODES, default="none",
        help="prefill/decode disaggregation behind moe-router: prefill (run prompts to their "
        "first token, write their KV blocks to a decode instance) or decode (take requests "
        "whose KV a prefill instance writes, then decode); default none: both",
    )
    p.add_argument("--kv-transfer-backend", choices=BACKENDS, default="mooncake-tcp",
                   help="the KV transfer engine (default: %(default)s)")
    p.add_argument("--kv-transfer-host", default="127.0.0.1",
                   help="address peers reach this instance's transfer engine at (default: "
                   "%(default)s)")
    p.add_argument("--kv-transfer-timeout-s", type=float, default=30.0,
                   help="a transfer to a hung peer fails, and a decode instance drops a request "
                   "whose KV has not arrived, after this many seconds (>= 5; default "
                   "%(default)s)")
    p.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="reuse the KV cache of full blocks that earlier requests computed for the same "
        "prefix (hits and queries in GetServerStats and /metrics)",
    )
    p.add_argument(
        "--quantization",
        default="none",
        choices=["none", "auto", "int4", "mxfp4"],
        help="store the routed experts in 4 bits, quantized at load time (default none); "
        "on CPU int4 is faster than bf16 at small batches, mxfp4 is exact and faster at 1 "
        "token. A checkpoint whose experts are already 4-bit (gpt-oss MXFP4, "
        "compressed-tensors pack-quantized int4) is served as stored with none or auto; "
        "another value that conflicts with it is a startup error",
    )
    p.add_argument(
        "--quant-group-size",
        type=int,
        default=128,
        choices=[32, 64, 128],
        help="int4 values per scale (default 128)",
    )
    p.add_argument(
        "--quantized-layers",
        default="experts",
        choices=["experts", "all"],
        help="which layers --quantization makes 4-bit (default experts): all also quantizes "
        "the dense projections (attention QKV and output, dense and shared-expert MLPs, the "
        "LM head; not the router or the embeddings), as a Q4_0 GGUF holds them: a batch-1 "
        "decode step reads about half the bytes of experts-only int4",
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
    add_device_flags(p)
    add_limit_flags(p)
    add_access_flags(p)
    ep = p.add_argument_group(
        "expert parallelism",
        "ranks started through torch's elastic launcher (torchrun semantics); attention is "
        "data-parallel, experts are split across ranks",
    )
    ep.add_argument(
        "--ep-size",
        type=int,
        default=1,
        help="expert-parallel ranks in all (default 1); must divide the number of experts",
    )
    ep.add_argument(
        "--collective-timeout",
        type=float,
        default=60.0,
        help="seconds a rank waits in a collective before the engine is declared failed "
        "(default 60); a dead or hung rank brings the server down within about this time",
    )
    ep.add_argument(
        "--expert-placement",
        default=None,
        help="placement JSON (from `moe-skew plan`): which experts, and replicas, each rank "
        "holds (default: experts split contiguously)",
    )
    p.add_argument(
        "--kernel-backend",
        default="auto",
        metavar="SPEC",
        help="kernel backend per op, chosen once at startup and logged: auto (default: "
        "native-cpu on a CPU, triton on CUDA, torch where neither runs an op), one backend "
        "(native-cpu, torch, triton) for every op it implements, or op=backend pairs after "
        "it, e.g. 'torch' or 'auto,linear=torch,attention_decode=torch'. Ops: "
        + ", ".join(OPS) + " (decode_layer: a decode step's whole MoE decoder layer as one "
        "native-cpu call, for bfloat16 models; decode_layer=torch runs it module by module). A "
        "backend that cannot run an op here is a startup error",
    )
    p.add_argument(
        "--expert-trace",
        default=None,
        metavar="PATH",
        help="write every step's routing counts per layer and expert (and per rank) to this "
        "NPZ trace (format: docs/trace_format.md; read it with `moe-skew report/plot/plan`); "
        "rewritten every 10 s and at shutdown",
    )
    ep.add_argument("--nnodes", type=int, default=1, help="nodes taking part (default 1)")
    ep.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this node's index (default 0); node 0 runs the gRPC front end, the others only "
        "their ranks",
    )
    ep.add_argument(
        "--rdzv-endpoint",
        default=None,
        help="host:port of node 0's rendezvous (required with --nnodes > 1; default: a free "
        "local port)",
    )
    p.add_argument(
        "--weight-version",
        default=ModelConfig.weight_version,
        metavar="V",
        help="the version string of the weights loaded at startup, carried by every response "
        "and GetModelInfo until an UpdateWeights call names a new one (SGLang's "
        f"--weight-version; default {ModelConfig.weight_version!r})",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_speculative_arguments(p)
    return p


def add_limit_flags(p: argparse.ArgumentParser) -> None:
    """Overload and lifetime limits (admission control, prompt length, streams, drain)."""
    g = p.add_argument_group("limits")
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=SchedulerConfig.max_waiting,
        help=f"most requests queued for a batch slot (default {SchedulerConfig.max_waiting}); "
        "beyond it new requests get RESOURCE_EXHAUSTED at once, naming the limit",
    )
    g.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="longest prompt accepted (tokens; default max_model_len - 1); longer ones get "
        "OUT_OF_RANGE naming the field and this limit",
    )
    g.add_argument(
        "--max-concurrent-streams",
        type=int,
        default=DEFAULT_MAX_CONCURRENT_STREAMS,
        help="most concurrent calls of one client connection (HTTP/2 streams; default "
        f"{DEFAULT_MAX_CONCURRENT_STREAMS}); a client's further calls wait for a free stream",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="on SIGTERM/Ctrl-C, seconds running requests may take to finish before they are "
        f"aborted (default {DEFAULT_DRAIN_TIMEOUT_S:.0f}); new requests get UNAVAILABLE at once",
    )


def add_access_flags(p: argparse.ArgumentParser) -> None:
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


def server_options_from_args(args: argparse.Namespace) -> ServerOptions:
    """The ServerOptions the flags describe (the API key resolved from flag, file or env).

    Raises:
        ValueError: a bad value or combination (the message names the flag).
    """
    return ServerOptions(
        host=args.host,
        port=args.port,
        max_message_bytes=args.max_message_bytes,
        metrics_port=args.metrics_port,
        drain_grace_s=args.drain_timeout,
        max_prompt_tokens=args.max_prompt_tokens,
        max_concurrent_streams=args.max_concurrent_streams,
        api_key=resolve_api_key(args.api_key, args.api_key_file),
        health_requires_api_key=args.health_requires_api_key,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        allow_insecure=args.allow_insecure,
        http_port=args.http_port,
        served_model_name=args.served_model_name,
    )


def engine_config_from_args(args: argparse.Namespace, model: str) -> EngineConfig:
    """The EngineConfig the flags describe.

    Raises:
        ValueError: a flag value out of range (the message names it).
    """
    return EngineConfig(
        model=ModelConfig(model=model, dtype=args.dtype, max_model_len=args.max_model_len,
                          weight_version=args.weight_version),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            enable_prefix_caching=args.enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_waiting=args.max_waiting_requests,
            stream_interval=args.stream_interval,
        ),
        speculative=speculative_config_from_args(args),
        quant=QuantConfig(
            method=args.quantization,
            group_size=args.quant_group_size,
            layers=args.quantized_layers,
        ),
        parallel=ParallelConfig(
            ep_size=args.ep_size,
            collective_timeout_s=args.collective_timeout,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            rdzv_endpoint=args.rdzv_endpoint,
            expert_placement=args.expert_placement,
        ),
        expert_trace=args.expert_trace,
        kernel_backend=args.kernel_backend,
        disagg=DisaggConfig(mode=args.disaggregation_mode, backend=args.kv_transfer_backend,
                            host=args.kv_transfer_host, timeout_s=args.kv_transfer_timeout_s),
        device=DeviceConfig(
            device=args.device,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enforce_eager=args.enforce_eager,
        ),
    )


def resolve_model(model: str) -> str:
    """The checkpoint directory: `model` itself, a hub id's snapshot in the local hub cache
    (`model_path.resolve_model_dir`), or the demo checkpoint for "demo".

    Raises:
        FileNotFoundError: no such directory (for a hub id: how to get its snapshot).
    """
    if model != "demo":
        return resolve_model_dir(model)
    from moe_engine.startup.demo import ensure_demo_checkpoint

    path = str(ensure_demo_checkpoint())
    logger.info("demo checkpoint: %s", path)
    return path


_PORT_MAX = 65535


def check_args(args: argparse.Namespace) -> str | None:
    """A one-line message for the first flag value out of range, or None when all are fine."""
    for flag, value in (("--port", args.port), ("--metrics-port", args.metrics_port)):
        if value is not None and not 0 <= value <= _PORT_MAX:
            return f"{flag} must be in 0..{_PORT_MAX}, got {value}"
    problem = weight_version_problem(args.weight_version)
    if problem is not None:
        return "--" + problem.replace("weight_version", "weight-version", 1)
    if args.nnodes > 1 and not args.rdzv_endpoint:
        return f"--nnodes {args.nnodes} needs --rdzv-endpoint host:port (node 0's address)"
    try:
        parse_kernel_backend(args.kernel_backend)
    except KernelBackendError as e:
        return str(e)
    return None


def check_checkpoint(config: EngineConfig) -> None:
    """What can be checked from the checkpoint directory alone, before the port opens: its
    config.json (present, valid JSON), a 4-bit group size that divides the dimensions it
    groups, an architecture whose config this engine serves (`build.read_architecture`: e.g.
    routing groups, hidden_act, rope type), and its safetensors weights (present; pickle is
    refused).

    Raises:
        FileNotFoundError, ValueError, StartupError: the message names the file, or the field
            and the flag.
    """
    from moe_engine.models.build import read_architecture

    resolve_quant_config(config.quant, config.model.hf_config())
    read_architecture(config.model.model)
    safetensors_files(config.model.model)


def run_worker_node(config: EngineConfig) -> int:
    """`--node-rank K` (K > 0): run this node's ranks in the foreground until they stop."""
    from moe_engine.engine.launcher import launch_ranks

    failure = launch_ranks(config, "ipc:///dev/null", "ipc:///dev/null")
    if failure is not None:
        print(f"moe-serve: error: {failure}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = check_args(args)
    if problem is not None:
        print(f"moe-serve: error: {problem}", file=sys.stderr)
        return 2
    level = getattr(logging, args.log_level)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_cpu_environment()  # MOE_ENGINE_THREADS=abc and the like: exit 1, port closed
        options = server_options_from_args(args)  # before anything is made or loaded
        model = resolve_model(args.model)
        config = engine_config_from_args(args, model)
        device = resolve_device(config.device.device)  # --device cuda without CUDA: exit 1
        check_kernel_backend(device, config.kernel_backend)  # e.g. triton on a CPU: exit 1
        check_checkpoint(config)
        if config.parallel.node_rank > 0:
            return run_worker_node(config)
        if config.parallel.ep_size > 1 or config.parallel.expert_placement is not None:
            from moe_engine.models import model_shape
            from moe_engine.startup.checks import check_ep_size

            # before the port opens: a bad --ep-size or placement exits 1
            check_ep_size(config, model_shape(config.model.hf_config()).num_experts)
        return asyncio.run(serve(config, options, log_level=level))
    except (StartupError, ValueError, FileNotFoundError) as exc:
        print(f"moe-serve: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
