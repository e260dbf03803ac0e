"""Engine configuration: frozen dataclasses composed into one `EngineConfig`.

User mistakes raise `ValueError` naming the field, the value and the limit.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moe_engine.startup.host_memory import DEFAULT_CPU_MEMORY_UTILIZATION
from moe_engine.startup.quant_config import DTYPES, QuantConfig
from moe_engine.startup.spec_config import SpeculativeConfig

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
    """A byte count: a plain integer or with a unit ("512MiB", "4G", "4GiB", "1.5GB"; K/M/G/T
    powers of 1000, Ki/Mi/Gi/Ti of 1024).

    Raises:
        ValueError: anything else (names the text).
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if match is None:
        raise ValueError(f"expected bytes like 4294967296 or 4GiB, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


#: `SchedulerConfig.policy` values (vLLM's `--scheduling-policy`).
SCHEDULING_POLICIES = ("fcfs", "priority")

#: vLLM's other names of dtypes (`--dtype half`, `LLM(dtype="float")`).
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


@dataclass(frozen=True)
class ModelConfig:
    """What to load.

    Attributes:
        model: a directory with config.json and *.safetensors (and optionally tokenizer files).
        dtype: "auto" (the checkpoint's torch_dtype, float32 when unset), "bfloat16",
            "float16" (alias "half"), "float32" (alias "float").
        max_model_len: longest prompt + output (tokens); None means the model's
            max_position_embeddings.
        seed: seed for weight-independent randomness (sampling without a per-request seed).
        weight_version: the version string of the weights loaded at startup, reported with
            every output until an update replaces it (SGLang's `--weight-version`).
        tokenizer: a folder with the tokenizer files to use instead of `model`'s own
            (`--tokenizer`, as vLLM's); None: `model`'s.
    """

    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    weight_version: str = "default"
    tokenizer: str | None = None

    @property
    def tokenizer_path(self) -> str:
        """The folder the tokenizer is loaded from: `tokenizer`, else `model`."""
        return self.tokenizer or self.model

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(
                f"max_model_len must be >= 2 tokens (one prompt token and one generated), "
                f"got {self.max_model_len}"
            )

    def hf_config(self) -> dict:
        """The checkpoint's config.json as a dict (`read_config_json`).

        Raises:
            FileNotFoundError: when config.json is missing.
            ValueError: when it is not a JSON object (names the file and the error's position).
        """
        return read_config_json(self.model)

    def torch_dtype(self) -> torch.dtype:
        """The dtype weights and activations use.

        Raises:
            ValueError: for an unknown dtype name.
        """
        name = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if name == "auto":
            cfg = self.hf_config()
            name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        if name not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)} (or half, float); "
                             f"got {name!r}")
        return DTYPES[name]


def read_config_json(model_dir: str | Path) -> dict:
    """`model_dir`/config.json as a dict.

    Raises:
        FileNotFoundError: there is no config.json (naming the directory).
        ValueError: it is not valid JSON, naming the file, the line, the column and what
            the parser expected there; or it holds something other than a JSON object.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model: no config.json in {str(model_dir)!r}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno} (char {e.pos})"
        ) from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object {{...}}, got {json.dumps(config)[:40]}")
    return config


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    Attributes:
        block_size: tokens per KV block.
        kv_cache_memory: bytes for the KV cache; None derives it from free memory.
        num_blocks_override: exact number of blocks (tests use it to force preemption).
        enable_prefix_caching: reuse the KV blocks of earlier requests' identical prefixes
            (full blocks only; `kv_cache.KVCacheManager`).
    """

    block_size: int = 16
    kv_cache_memory: int | None = None
    num_blocks_override: int | None = None
    enable_prefix_caching: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory is not None and (
            not isinstance(self.kv_cache_memory, int) or isinstance(self.kv_cache_memory, bool)
        ):
            raise ValueError(f"kv_cache_memory must be a byte count (int), got "
                             f"{self.kv_cache_memory!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batch limits for one step.

    Attributes:
        max_num_seqs: most requests in one step.
        max_num_batched_tokens: most tokens (prefill chunks + decodes) in one step.
        max_waiting: most requests queued before new ones are refused (RESOURCE_EXHAUSTED).
        stream_interval: a request's new tokens are sent to its stream every this many tokens
            (the first token and the final output always at once; vLLM's and SGLang's
            `--stream-interval`). 1 sends every token as it is sampled; larger values cut the
            messages per token (core to front end, front end to client) at the cost of
            burstier streams. Generated tokens never change.
        policy: the waiting queue's order (vLLM's `--scheduling-policy`): "fcfs" (arrival
            order; a request's `priority` must be 0) or "priority" (lower `priority` first,
            ties by arrival; a preemption takes the running request with the highest value,
            the newest among equals).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting: int = 4096
    stream_interval: int = 1
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1 requests, got {self.max_waiting}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1 tokens, got {self.stream_interval}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"policy (--scheduling-policy) must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.policy!r}"
            )


#: `--disaggregation-mode` values: one instance does both, or only prefills, or only decodes.
DISAGG_MODES = ("none", "prefill", "decode")


@dataclass(frozen=True)
class DisaggConfig:
    """Prefill/decode disaggregation (`moe_engine.disagg`).

    Attributes:
        mode: "none", "prefill" (run prompts to their first token and send their KV blocks
            to a decode instance) or "decode" (take requests whose KV a prefill instance
            sends, then decode).
        backend: the KV transfer engine (`disagg.transfer.BACKENDS`).
        host: the address peers reach this instance's transfer engine at.
        timeout_s: a transfer to a hung peer fails after this long; a decode instance drops a
            request whose K/V has not arrived this long after it was placed.
        role_factory: what builds a prefill or decode instance's role, as "module:attribute"
            called with (core, this config); the engine resolves it at runtime
            (`engine.role.role_for`), so it never imports `moe_engine.disagg`.
    """

    mode: str = "none"
    backend: str = "mooncake-tcp"
    host: str = "127.0.0.1"
    timeout_s: float = 30.0
    role_factory: str = "moe_engine.disagg.role:make_role"

    def __post_init__(self) -> None:
        if self.mode not in DISAGG_MODES:
            raise ValueError(f"disaggregation mode must be one of {', '.join(DISAGG_MODES)}, "
                             f"got {self.mode!r}")
        if not self.timeout_s >= 5:
            raise ValueError(f"kv transfer timeout must be >= 5 s, got {self.timeout_s}")


@dataclass(frozen=True)
class ParallelConfig:
    """Ranks and threads.

    Attributes:
        ep_size: expert-parallel ranks, experts split evenly (1 = one rank) unless
            `expert_placement` says otherwise.
        num_threads: intra-op CPU threads of a rank; None = `default_threads()` (shared among
            the ranks of a node).
        collective_timeout_s: how long a rank waits in a collective (all-to-all, step control)
            before it declares the others dead (seconds); also bounds how long a hung rank can
            hold the server before it goes down.
        nnodes, node_rank, rdzv_endpoint: torch elastic launcher settings (`torchrun`'s
            --nnodes, --node-rank, --rdzv-endpoint "host:port"; None = this node, a free port).
        expert_placement: a placement JSON file (`comm.placement`), None = contiguous.
    """

    ep_size: int = 1
    num_threads: int | None = None
    collective_timeout_s: float = 60.0
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    expert_placement: str | None = None

    def __post_init__(self) -> None:
        if self.ep_size < 1:
            raise ValueError(f"ep_size must be >= 1, got {self.ep_size}")
        if self.collective_timeout_s <= 0:
            raise ValueError(
                f"collective_timeout_s must be > 0 seconds, got {self.collective_timeout_s}"
            )
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank must be in [0, nnodes {self.nnodes}), got {self.node_rank}"
            )
        if self.ep_size % self.nnodes:
            raise ValueError(
                f"ep_size {self.ep_size} must be a multiple of nnodes {self.nnodes} "
                f"(the same number of ranks on every node)"
            )


@dataclass(frozen=True)
class EplbConfig:
    """Runtime expert-parallel load balancing (vLLM's `--enable-eplb`, SGLang's EPLB): the
    placement is recomputed from the recorded routing load while serving and the moved
    experts' weights travel between ranks (`moe_engine.eplb`).

    Attributes:
        enabled: `--enable-eplb`; needs ep_size > 1.
        window_steps: `--eplb-window-steps`, steps of recorded load a placement is planned
            from (>= 1).
        step_interval: `--eplb-step-interval`, steps between two rebalancing decisions (>= 1).
        num_redundant_experts: `--num-redundant-experts`, extra expert slots in all (replicas
            of hot experts), a multiple of ep_size, at most num_experts * (ep_size - 1) (an
            expert is held at most once per rank); checked against the model at startup.
        balancedness_threshold: `--eplb-balancedness-threshold`, rebalance only when the
            window's rank balancedness (mean / max tokens per rank, in (0, 1]) is below it;
            1.0 rebalances at every interval.
        move_mib_per_step: `--eplb-move-mib-per-step`, the most expert weights (MiB) a rank
            sends, and separately receives plus copies, in one step while a rebalance moves
            them (> 0; fractions allowed): smaller spreads a move over more steps, each stalled
            less. 16 MiB keeps a step's share under ~50 ms on a CPU over gloo (bench/eplb_move.py at
            Qwen3-30B-A3B's expert size, bench/NOTES.md section 36).

    Raises:
        ValueError: a value out of range, naming the flag and the limit.
    """

    enabled: bool = False
    window_steps: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int = 0
    balancedness_threshold: float = 0.95
    move_mib_per_step: float = 16.0

    def __post_init__(self) -> None:
        if self.window_steps < 1:
            raise ValueError(f"--eplb-window-steps must be >= 1, got {self.window_steps}")
        if self.step_interval < 1:
            raise ValueError(f"--eplb-step-interval must be >= 1, got {self.step_interval}")
        if self.num_redundant_experts < 0:
            raise ValueError(
                f"--num-redundant-experts must be >= 0, got {self.num_redundant_experts}")
        if not self.move_mib_per_step * (1 << 20) >= 1:
            raise ValueError("--eplb-move-mib-per-step must be at least one byte (> 0 MiB), "
                             f"got {self.move_mib_per_step}")
        if not 0.0 < self.balancedness_threshold <= 1.0:
            raise ValueError("--eplb-balancedness-threshold must be in (0, 1], got "
                             f"{self.balancedness_threshold}")


#: --device values: "auto" (cuda when torch sees a CUDA device), "cpu", "cuda".
DEVICE_CHOICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DeviceConfig:
    """Where the engine runs and how much of the device's memory it may take.

    Attributes:
        device: "auto" (cuda when torch sees a CUDA device, else cpu), "cpu" or "cuda";
            resolved once at EngineCore startup (`kernels.registry.resolve_device`). Weights,
            the KV cache and each step's batch tensors live there.
        gpu_memory_utilization: fraction in (0, 1] of the CUDA device's total memory the
            engine may use for weights, activations and KV cache (vLLM's flag); the KV cache
            gets what the weights and a profiled activation peak leave
            (`moe_engine.startup.memory`).
            Ignored on a CPU.
        cpu_memory_utilization: fraction in (0, 1] of the host's total memory the engine
            may use on a CPU (weights held, activations, KV cache); the KV cache gets what the
            rest and the memory already in use leave (`moe_engine.startup.host_memory`).
            Ignored on CUDA.
        enforce_eager: never capture CUDA graphs (`--enforce-eager`, vLLM's flag): every step
            runs eagerly. By default decode-only steps replay graphs captured at startup
            where they apply (`moe_engine.runner.cuda_graphs`).
    """

    device: str = "auto"
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    cpu_memory_utilization: float = DEFAULT_CPU_MEMORY_UTILIZATION

    def __post_init__(self) -> None:
        if self.device not in DEVICE_CHOICES:
            raise ValueError(
                f"device must be one of {', '.join(DEVICE_CHOICES)}; got {self.device!r}"
            )
        for name, util in (("gpu", self.gpu_memory_utilization),
                           ("cpu", self.cpu_memory_utilization)):
            if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
                raise ValueError(
                    f"{name}_memory_utilization (--{name}-memory-utilization) must be a "
                    f"fraction in (0, 1] of the {'device' if name == 'gpu' else 'host'}'s "
                    f"memory, got {util!r}"
                )
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs, composed of the configs above.

    Attributes:
        expert_trace: write every step's routing counts to this NPZ trace file
            (`moe_engine.skew.trace`, docs/trace_format.md); None = no trace.
        kernel_backend: `--kernel-backend`: "auto", a backend name, or op=backend pairs
            (kernels/registry.py); checked at startup.
        device: the device and its memory budget (`DeviceConfig`).
        speculative: draft tokens per step (`SpeculativeConfig`; off by default).
        disagg: prefill/decode disaggregation (`DisaggConfig`; off by default).
        eplb: runtime expert load balancing (`EplbConfig`; off by default).
        enable_return_routed_experts: `--enable-return-routed-experts`: record every token's
            top-k expert ids per MoE layer so that requests may ask for them
            (`SamplingParams.return_routed_experts`; routing replay for RL).
    """

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    expert_trace: str | None = None
    kernel_backend: str = "auto"
    device: DeviceConfig = field(default_factory=DeviceConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    eplb: EplbConfig = field(default_factory=EplbConfig)
    enable_return_routed_experts: bool = False
