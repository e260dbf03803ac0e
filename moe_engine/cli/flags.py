"""`moe-serve`'s engine flags: one `add_*_args` per configuration they fill, and their value
types (the front end's `ServerOptions` flags are in `server_flags.py`).

`cli/serve.py`'s `build_parser` calls these in the order `moe-serve --help` lists the flags;
where one configuration's flags are not next to each other there (`ModelConfig`,
`CacheConfig`, `ParallelConfig`), it has one function per run of them.
`serve.engine_config_from_args` and `serve.server_options_from_args` read the parsed flags
back into those objects.
"""

from __future__ import annotations

import argparse

from kernels.plan import OPS
from moe_engine.disagg.transfer import BACKENDS
from moe_engine.server.options import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_MAX_CONCURRENT_STREAMS,
)
from moe_engine.startup.config import (
    DEVICE_CHOICES,
    DISAGG_MODES,
    SCHEDULING_POLICIES,
    DeviceConfig,
    EplbConfig,
    ModelConfig,
    SchedulerConfig,
)
from moe_engine.startup.config import parse_bytes as config_parse_bytes


def parse_bytes(text: str) -> int:
    """`config.parse_bytes` for argparse.

    Raises:
        argparse.ArgumentTypeError: anything but a byte count.
    """
    try:
        return config_parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_fraction(text: str, name: str = "gpu_memory_utilization",
                   of: str = "the device's memory") -> float:
    """--gpu-memory-utilization (and --cpu-memory-utilization): a fraction in (0, 1].

    Raises:
        argparse.ArgumentTypeError: anything else (names the value and the limit).
    """
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value <= 1:
        raise argparse.ArgumentTypeError(
            f"{name} must be a fraction in (0, 1] of {of}, got {text!r}"
        )
    return value


def parse_host_fraction(text: str) -> float:
    """--cpu-memory-utilization: a fraction in (0, 1] of the host's memory."""
    return parse_fraction(text, "cpu_memory_utilization", "the host's memory")


def add_model_path_args(p: argparse.ArgumentParser) -> None:
    """--model: the checkpoint (`ModelConfig.model`, resolved by `serve.resolve_model`)."""
    p.add_argument(
        "--model",
        default="demo",
        help="checkpoint directory (config.json + *.safetensors [+ tokenizer]), a Hugging Face "
        "hub id (org/name) already in the local hub cache ($HF_HUB_CACHE; nothing is "
        "downloaded), or 'demo' (default: a small Qwen3-MoE demo made on first use)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="tokenizer folder (or a hub id in the local hub cache) to use instead of the "
        "checkpoint's own (default: the --model folder's tokenizer files, if any)",
    )


#: `--dtype` values (vLLM's) and the `ModelConfig.dtype` each means.
DTYPE_CHOICES = {"auto": "auto", "bfloat16": "bfloat16", "float16": "float16",
                 "half": "float16", "float32": "float32", "float": "float32"}


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--dtype and --max-model-len (`ModelConfig`)."""
    p.add_argument(
        "--dtype", default="auto", choices=list(DTYPE_CHOICES),
        help="weights' and activations' dtype (default auto: the checkpoint's torch_dtype); "
        "half is float16 and float is float32, as vLLM's",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output limit (tokens)")


def add_scheduler_args(p: argparse.ArgumentParser) -> None:
    """Batch limits per step and the stream interval (`SchedulerConfig`)."""
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    p.add_argument(
        "--stream-interval", type=int, default=1, metavar="N",
        help="send each request's new tokens every N tokens (default 1: every token; the "
        "first token and the last output at once): fewer messages per token, burstier streams",
    )
    p.add_argument(
        "--scheduling-policy", choices=SCHEDULING_POLICIES, default=SchedulerConfig.policy,
        help="waiting queue order (vLLM's): fcfs (arrival order; requests must send priority "
        "0) or priority (lower `priority` first, ties by arrival; preemption takes the "
        "least urgent running request); default %(default)s",
    )


def add_seed_args(p: argparse.ArgumentParser) -> None:
    """--seed (`ModelConfig.seed`)."""
    p.add_argument(
        "--seed", type=int, default=ModelConfig.seed,
        help="the engine's random seed (vLLM's): requests without their own seed draw from a "
        "generator seeded with it, so the same requests in the same order give the same "
        "tokens after a restart (default %(default)s)",
    )


def add_cache_args(p: argparse.ArgumentParser) -> None:
    """--kv-cache-memory and --block-size (`CacheConfig`)."""
    p.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=None,
        help="bytes for the KV cache, e.g. 2GiB (default: derived, from --cpu-memory-utilization "
        "on cpu and --gpu-memory-utilization on cuda)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")


def add_disagg_args(p: argparse.ArgumentParser) -> None:
    """Prefill/decode disaggregation and its KV transfer (`DisaggConfig`)."""
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


def add_prefix_caching_args(p: argparse.ArgumentParser) -> None:
    """--enable-prefix-caching (`CacheConfig.enable_prefix_caching`)."""
    p.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="reuse the KV cache of full blocks that earlier requests computed for the same "
        "prefix (hits and queries in GetServerStats and /metrics)",
    )


def add_routed_experts_args(p: argparse.ArgumentParser) -> None:
    """--enable-return-routed-experts (`EngineConfig.enable_return_routed_experts`; vLLM's
    flag name)."""
    p.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="record every token's top-k expert ids per MoE layer (kept per KV slot on the "
        "host), so that requests may ask for them with return_routed_experts (routing replay "
        "for RL; docs/weight_updates.md)",
    )


def add_quant_args(p: argparse.ArgumentParser) -> None:
    """4-bit weights: --quantization, --quant-group-size, --quantized-layers
    (`QuantConfig`)."""
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


def add_device_args(p: argparse.ArgumentParser) -> None:
    """--device, --gpu-memory-utilization, --cpu-memory-utilization and --enforce-eager
    (`config.DeviceConfig`)."""
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
        "--cpu-memory-utilization",
        type=parse_host_fraction,
        default=DeviceConfig.cpu_memory_utilization,
        metavar="F",
        help="fraction in (0, 1] of the host's total memory the engine may use on cpu "
        f"(default {DeviceConfig.cpu_memory_utilization}: the rest stays with the OS and the "
        "page cache); the KV cache gets what the memory already in use, the weights held and "
        "the activations of one --max-num-batched-tokens step leave, and a model that does not "
        "fit exits before loading. Ignored on cuda",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="never capture CUDA graphs: every step runs eagerly (default: decode-only steps "
        "replay graphs captured at startup at padded batch sizes, on cuda with the triton "
        "decode kernels and --ep-size 1)",
    )



def add_limit_args(p: argparse.ArgumentParser) -> None:
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


def add_parallel_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The "expert parallelism" group: --ep-size, --collective-timeout, --expert-placement
    (`ParallelConfig`); returns the group for `add_multinode_args`."""
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
        "holds (default: experts split contiguously); with --enable-eplb the placement served "
        "first",
    )
    add_eplb_args(ep)
    return ep


def add_eplb_args(ep: argparse._ArgumentGroup) -> None:
    """Runtime expert load balancing into the "expert parallelism" group (`EplbConfig`).

    The numeric flags default to None so that `serve.eplb_config_from_args` can tell a flag
    given without --enable-eplb (refused) from one left out (EplbConfig's default).
    """
    ep.add_argument(
        "--enable-eplb", action="store_true",
        help="rebalance the experts over the ranks while serving (vLLM's and SGLang's flag): "
        "every --eplb-step-interval steps the routing load of the last --eplb-window-steps "
        "steps is summed over the ranks, and when the ranks' balancedness (mean / max of "
        "their predicted load) is below --eplb-balancedness-threshold a new placement is "
        "planned (as `moe-skew plan`) and the moved experts' weights travel between ranks "
        "over the next steps, swapped in on every rank at once. Needs --ep-size > 1",
    )
    ep.add_argument(
        "--eplb-window-steps", type=int, default=None, metavar="N",
        help=f"steps of recorded routing load a placement is planned from (default "
        f"{EplbConfig.window_steps}, vLLM's window_size)",
    )
    ep.add_argument(
        "--eplb-step-interval", type=int, default=None, metavar="N",
        help=f"steps between two rebalancing decisions (default {EplbConfig.step_interval}, "
        "vLLM's step_interval)",
    )
    ep.add_argument(
        "--num-redundant-experts", type=int, default=None, metavar="R",
        help="extra expert slots in all, R / ep_size per rank, holding replicas of hot experts "
        "(default 0; a multiple of --ep-size, at most num_experts * (ep_size - 1); only with "
        "--enable-eplb, as vLLM's)",
    )
    ep.add_argument(
        "--eplb-balancedness-threshold", type=float, default=None, metavar="T",
        help="rebalance only when the window's rank balancedness (mean / max, in (0, 1]) is "
        f"below T (default {EplbConfig.balancedness_threshold}; 1.0: at every interval "
        "where a better placement exists)",
    )
    ep.add_argument(
        "--eplb-move-mib-per-step", type=float, default=None, metavar="MIB",
        help="while a rebalance moves expert weights, the most MiB a rank sends (and receives "
        f"plus copies) per step (default {EplbConfig.move_mib_per_step}): smaller spreads the "
        "move over more steps, each stalled less",
    )


def add_kernel_args(p: argparse.ArgumentParser) -> None:
    """--kernel-backend and --expert-trace (`EngineConfig`)."""
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


def add_multinode_args(ep: argparse._ArgumentGroup) -> None:
    """--nnodes, --node-rank, --rdzv-endpoint into the "expert parallelism" group
    (`ParallelConfig`)."""
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


def add_weight_version_args(p: argparse.ArgumentParser) -> None:
    """--weight-version (`ModelConfig.weight_version`)."""
    p.add_argument(
        "--weight-version",
        default=ModelConfig.weight_version,
        metavar="V",
        help="the version string of the weights loaded at startup, carried by every response "
        "and GetModelInfo until an UpdateWeights call names a new one (SGLang's "
        f"--weight-version; default {ModelConfig.weight_version!r})",
    )
