"""`moe-serve`: serve an MoE checkpoint (the built-in demo by default) over the OpenAI HTTP API
and gRPC.

    moe-serve [--model PATH|ORG/NAME|demo] [--tokenizer PATH] [--host 127.0.0.1]
              [--port 8000 (alias --http-port; 0: off)] [--grpc-port 50051 (0: off)]
              [--served-model-name NAME] [--version]
              [--enable-log-requests | --disable-log-requests] [--allow-unknown-fields]
              [--dtype auto|bfloat16|float16|half|float32|float] [--max-model-len N]
              [--max-num-seqs N]
              [--max-num-batched-tokens N] [--stream-interval N] [--kv-cache-memory BYTES]
              [--block-size N]
              [--enable-prefix-caching] [--enable-return-routed-experts]
              [--device auto|cpu|cuda] [--gpu-memory-utilization F]
              [--cpu-memory-utilization F]
              [--enforce-eager]
              [--metrics-port P] [--max-message-bytes BYTES] [--log-level LEVEL]
              [--max-waiting-requests N] [--max-prompt-tokens N] [--max-concurrent-streams N]
              [--drain-timeout S] [--api-key KEY | --api-key-file PATH]
              [--health-requires-api-key] [--tls-cert PEM --tls-key PEM [--tls-ca PEM]]
              [--allow-insecure]
              [--ep-size N] [--collective-timeout S] [--expert-placement FILE]
              [--enable-eplb [--eplb-window-steps N] [--eplb-step-interval N]
               [--num-redundant-experts R] [--eplb-balancedness-threshold T]]
              [--nnodes N --node-rank K --rdzv-endpoint HOST:PORT]
              [--speculative-method ngram [--num-speculative-tokens K] [--ngram-min N]
               [--ngram-max N] [--speculative-disable-by-batch-size N]]
              [--weight-version V]

Ready when `GET /health` on the HTTP port answers 200 (and the gRPC health service,
grpc.health.v1, says SERVING). As vLLM's, --port is the OpenAI HTTP API's port; gRPC is on
--grpc-port. SIGTERM or Ctrl-C drains and exits 0; a startup failure exits 1 with the reason
(numbers and the flag that fixes it).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from kernels.registry import (
    KernelBackendError,
    check_kernel_backend,
    parse_kernel_backend,
    resolve_device,
)
from moe_engine import __version__
from moe_engine.cli import flags, server_flags
from moe_engine.core.tokenizer import TOKENIZER_FILES
from moe_engine.errors import StartupError
from moe_engine.models import resolve_quant_config
from moe_engine.models.loader import safetensors_files
from moe_engine.server.app import serve
from moe_engine.server.options import ServerOptions
from moe_engine.server.security import resolve_api_key
from moe_engine.startup.checks import check_routing_replay
from moe_engine.startup.config import (
    CacheConfig,
    DeviceConfig,
    DisaggConfig,
    EngineConfig,
    EplbConfig,
    ModelConfig,
    ParallelConfig,
    QuantConfig,
    SchedulerConfig,
)
from moe_engine.startup.env import check_cpu_environment
from moe_engine.startup.model_path import resolve_model_dir
from moe_engine.startup.spec_config import add_speculative_arguments, speculative_config_from_args
from moe_engine.weight_update.messages import weight_version_problem

logger = logging.getLogger("moe_engine.serve")


def build_parser() -> argparse.ArgumentParser:
    """`moe-serve`'s parser; the flags come in the order `--help` lists them (`flags.py`)."""
    p = argparse.ArgumentParser(
        prog="moe-serve",
        description="Serve an MoE checkpoint over the OpenAI-compatible HTTP API (--port, "
        "default 8000) and gRPC (moe_engine.v1, --grpc-port, default 50051).",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    flags.add_model_path_args(p)
    server_flags.add_address_args(p)
    server_flags.add_chat_args(p)
    server_flags.add_frontend_args(p)
    flags.add_model_args(p)
    flags.add_scheduler_args(p)
    flags.add_seed_args(p)
    flags.add_cache_args(p)
    flags.add_disagg_args(p)
    flags.add_prefix_caching_args(p)
    flags.add_routed_experts_args(p)
    flags.add_quant_args(p)
    server_flags.add_message_args(p)
    flags.add_device_args(p)
    flags.add_limit_args(p)
    server_flags.add_access_args(p)
    ep = flags.add_parallel_args(p)
    flags.add_kernel_args(p)
    flags.add_multinode_args(ep)
    flags.add_weight_version_args(p)
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_speculative_arguments(p)
    return p


def server_options_from_args(args: argparse.Namespace) -> ServerOptions:
    """The ServerOptions the flags describe (the API key resolved from flag, file or env).

    Raises:
        ValueError: a bad value or combination (the message names the flag).
    """
    return ServerOptions(
        host=args.host,
        port=args.grpc_port or None,  # 0: off (ServerOptions' 0, any free port, is for tests)
        http_port=args.http_port or None,
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
        served_model_name=args.served_model_name,
        chat_template=args.chat_template,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=args.reasoning_parser,
        allow_unknown_fields=args.allow_unknown_fields,
        enable_log_requests=args.enable_log_requests,
    )


def engine_config_from_args(args: argparse.Namespace, model: str,
                            tokenizer: str | None = None) -> EngineConfig:
    """The EngineConfig the flags describe (`tokenizer`: the resolved --tokenizer folder).

    Raises:
        ValueError: a flag value out of range (the message names it).
    """
    return EngineConfig(
        model=ModelConfig(model=model, dtype=flags.DTYPE_CHOICES[args.dtype],
                          max_model_len=args.max_model_len, seed=args.seed,
                          weight_version=args.weight_version, tokenizer=tokenizer),
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
            policy=args.scheduling_policy,
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
        eplb=eplb_config_from_args(args),
        expert_trace=args.expert_trace,
        enable_return_routed_experts=args.enable_return_routed_experts,
        kernel_backend=args.kernel_backend,
        disagg=DisaggConfig(mode=args.disaggregation_mode, backend=args.kv_transfer_backend,
                            host=args.kv_transfer_host, timeout_s=args.kv_transfer_timeout_s),
        device=DeviceConfig(
            device=args.device,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enforce_eager=args.enforce_eager,
            cpu_memory_utilization=args.cpu_memory_utilization,
        ),
    )


#: The EPLB flags that take a value: (flag, argparse dest, `EplbConfig` field).
_EPLB_FLAGS = (
    ("--eplb-window-steps", "eplb_window_steps", "window_steps"),
    ("--eplb-step-interval", "eplb_step_interval", "step_interval"),
    ("--num-redundant-experts", "num_redundant_experts", "num_redundant_experts"),
    ("--eplb-balancedness-threshold", "eplb_balancedness_threshold", "balancedness_threshold"),
    ("--eplb-move-mib-per-step", "eplb_move_mib_per_step", "move_mib_per_step"),
)


def eplb_config_from_args(args: argparse.Namespace) -> EplbConfig:
    """The EplbConfig of --enable-eplb and its flags (EplbConfig's defaults for those left out).

    Raises:
        ValueError: an EPLB flag given without --enable-eplb (vLLM likewise refuses
            num_redundant_experts without EPLB: they would do nothing), or a value out of
            range (`EplbConfig`, naming the flag and the limit).
    """
    given = {(flag, field): getattr(args, dest) for flag, dest, field in _EPLB_FLAGS
             if getattr(args, dest) is not None}
    if not args.enable_eplb:
        for (flag, _), value in given.items():
            raise ValueError(f"{flag} {value} needs --enable-eplb (without it the experts "
                             "never move, so the flag would do nothing)")
        return EplbConfig()
    return EplbConfig(enabled=True, **{field: value for (_, field), value in given.items()})


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


def resolve_tokenizer(tokenizer: str | None) -> str | None:
    """The --tokenizer folder (a hub id through the local hub cache, as --model), checked to
    hold tokenizer files; None without the flag.

    Raises:
        FileNotFoundError: no such folder, or no tokenizer files in it (naming the flag).
    """
    if tokenizer is None:
        return None
    try:
        path = resolve_model_dir(tokenizer)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"--tokenizer {tokenizer}: {exc}") from None
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"--tokenizer {tokenizer}: no tokenizer files in {path} (expected one of "
            f"{', '.join(TOKENIZER_FILES)})"
        )
    return path


_PORT_MAX = 65535


def check_args(args: argparse.Namespace) -> str | None:
    """A one-line message for the first flag value out of range, or None when all are fine."""
    ports = (("--port", args.http_port), ("--grpc-port", args.grpc_port),
             ("--metrics-port", args.metrics_port))
    for flag, value in ports:
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
        tokenizer = resolve_tokenizer(args.tokenizer)
        config = engine_config_from_args(args, model, tokenizer)
        device = resolve_device(config.device.device)  # --device cuda without CUDA: exit 1
        check_kernel_backend(device, config.kernel_backend)  # e.g. triton on a CPU: exit 1
        check_checkpoint(config)
        check_routing_replay(config)  # a decode instance cannot return routing: exit 1
        if config.eplb.enabled:  # 4-bit experts EPLB cannot move on this backend: exit 1
            from moe_engine.startup.checks import check_eplb_kernels

            expert_format = resolve_quant_config(config.quant, config.model.hf_config()).method
            check_eplb_kernels(config, device, expert_format)
        if config.parallel.node_rank > 0:
            return run_worker_node(config)
        from moe_engine.startup.checks import check_ep_size, needs_ep_check

        if needs_ep_check(config):
            from moe_engine.models import model_shape

            # before the port opens: a bad --ep-size, placement or EPLB setting exits 1
            check_ep_size(config, model_shape(config.model.hf_config()).num_experts)
        return asyncio.run(serve(config, options, log_level=level))
    except (StartupError, ValueError, FileNotFoundError) as exc:
        print(f"moe-serve: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
