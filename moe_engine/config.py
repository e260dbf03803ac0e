"""Engine configuration: frozen dataclasses composed into one `EngineConfig`.

User mistakes raise `ValueError` naming the field, the value and the limit.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    """What to load.

    Attributes:
        model: a directory with config.json and *.safetensors (and optionally tokenizer files).
        dtype: "auto" (the checkpoint's torch_dtype, float32 when unset), "bfloat16", "float32".
        max_model_len: longest prompt + output (tokens); None means the model's
            max_position_embeddings.
        seed: seed for weight-independent randomness (sampling without a per-request seed).
    """

    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0

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
        name = self.dtype
        if name == "auto":
            cfg = self.hf_config()
            name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        if name not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
        return _DTYPES[name]


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
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batch limits for one step.

    Attributes:
        max_num_seqs: most requests in one step.
        max_num_batched_tokens: most tokens (prefill chunks + decodes) in one step.
        max_waiting: most requests queued before new ones are refused (RESOURCE_EXHAUSTED).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting: int = 4096

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1 requests, got {self.max_waiting}")


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
class QuantConfig:
    """4-bit routed experts.

    Attributes:
        method: "none", "int4" (group-wise symmetric, `quant.int4`) or "mxfp4" (OCP MX v1.0,
            `quant.mxfp4`); the routed experts of a float checkpoint are quantized at load time,
            attention, router and embeddings keep the model dtype. "auto" (like "none") serves
            the experts as the checkpoint stores them; `resolve_quant_config` turns it into
            one of the others.
        group_size: int4 values per scale (32, 64 or 128).
        symmetric: int4 without zero points (load-time quantization is always symmetric; a
            pre-quantized checkpoint may be asymmetric).
        checkpoint_format: None when experts are quantized at load time (or not at all);
            "compressed-tensors" when the checkpoint stores them int4 already
            (`quant.compressed_tensors`), "mxfp4" when it stores them MXFP4 (gpt-oss
            `*_blocks` / `*_scales`); set by `resolve_quant_config`.
        scale_dtype: the int4 scales' dtype, "bfloat16", "float16" or "float32": the
            checkpoint's weight dtype (`resolve_quant_config`), so a 16-bit checkpoint keeps
            16-bit scales; None (unresolved) counts as float32.
    """

    method: str = "none"
    group_size: int = 128
    symmetric: bool = True
    checkpoint_format: str | None = None
    scale_dtype: str | None = None

    @property
    def bits_per_weight(self) -> float | None:
        """Storage per expert weight (bits): 4 plus the scale's share; None when unquantized.

        int4 keeps one `scale_dtype` scale per group (16 or 32 bits; 4.5 bits per weight for
        16-bit scales in groups of 32), plus a uint8 zero point when asymmetric; MXFP4 one
        8-bit E8M0 scale per 32 values. (The native kernel's layout; the torch fallback's
        int4 matmul stores a bfloat16 scale and offset pair per group instead.)
        """
        if self.method == "int4":
            scale_bits = 8 * _DTYPES[self.scale_dtype or "float32"].itemsize
            return 4 + (scale_bits + (0 if self.symmetric else 8)) / self.group_size
        if self.method == "mxfp4":
            return 4 + 8 / 32
        return None

    def __post_init__(self) -> None:
        if self.method not in ("none", "auto", "int4", "mxfp4"):
            raise ValueError(
                f"quantization must be one of none, auto, int4, mxfp4; got {self.method!r}"
            )
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"quant group_size must be 32, 64 or 128, got {self.group_size}")
        if self.scale_dtype is not None and self.scale_dtype not in _DTYPES:
            raise ValueError(
                f"quant scale_dtype {self.scale_dtype!r} must be one of {', '.join(_DTYPES)}"
            )
        formats = {CHECKPOINT_INT4_FORMAT: "int4", CHECKPOINT_MXFP4_FORMAT: "mxfp4"}
        if self.checkpoint_format is not None and (
            formats.get(self.checkpoint_format) != self.method
        ):
            raise ValueError(
                f"quant checkpoint_format {self.checkpoint_format!r} with method "
                f"{self.method!r}: experts load pre-quantized only as int4 "
                f"({CHECKPOINT_INT4_FORMAT}) or mxfp4 ({CHECKPOINT_MXFP4_FORMAT})"
            )


#: The pre-quantized expert formats `resolve_quant_config` recognises in config.json.
CHECKPOINT_INT4_FORMAT = "compressed-tensors"
CHECKPOINT_MXFP4_FORMAT = "mxfp4"  # gpt-oss: quantization_config {"quant_method": "mxfp4"}
#: FP8 block-quantized checkpoints (`quant.fp8`): dequantized while loading.
CHECKPOINT_FP8_METHOD = "fp8"
#: model_type values whose checkpoints may store MXFP4 experts (`*_blocks` / `*_scales`).
_MXFP4_MODEL_TYPES = ("gpt_oss",)


def resolve_quant_config(
    quant: QuantConfig, hf_config: dict, weight_dtype: torch.dtype | None = None
) -> QuantConfig:
    """The expert format to run: `--quantization` against what config.json says is stored.

    An FP8 block-quantized checkpoint (quant_method "fp8", `quant.fp8`) is dequantized while
    loading, so its experts arrive as float tensors: every --quantization value applies to it
    as to a float checkpoint (none/auto: dequantized experts; int4/mxfp4: re-quantized).
    A checkpoint whose routed experts are compressed-tensors pack-quantized int4
    (`quant.compressed_tensors`) is served as stored, with --quantization none or auto, or int4
    with the checkpoint's group size; a gpt-oss checkpoint with MXFP4 experts (quant_method
    "mxfp4", `*_blocks` / `*_scales`) likewise, with none, auto or mxfp4. Without such experts,
    "auto" becomes "none" and the others stand (load-time quantization of float experts).

    Args:
        quant: the requested configuration (flags).
        hf_config: config.json as a dict.
        weight_dtype: the dtype the checkpoint's weights load in (`ModelConfig.torch_dtype`):
            int4 scales are kept in it (`QuantConfig.scale_dtype`); None leaves scale_dtype
            as it is.

    Raises:
        ValueError: a quantization_config this engine cannot load, a group size the int4 path
            lacks, or an explicit --quantization / --quant-group-size that conflicts with the
            checkpoint (the message names both and the flag that fixes it).
    """
    resolved = _resolve_method(quant, hf_config)
    if weight_dtype is not None and resolved.method == "int4" and resolved.scale_dtype is None:
        names = {dtype: name for name, dtype in _DTYPES.items()}
        resolved = replace(resolved, scale_dtype=names.get(weight_dtype, "float32"))
    return resolved


def _resolve_method(quant: QuantConfig, hf_config: dict) -> QuantConfig:
    """`resolve_quant_config` without the scale dtype."""
    from quant.compressed_tensors import parse_quantization_config

    if quant.checkpoint_format is not None:  # resolved already
        return quant
    stored_config = hf_config.get("quantization_config")
    stored = stored_config.get("quant_method") if isinstance(stored_config, dict) else None
    if stored == CHECKPOINT_MXFP4_FORMAT:
        return _resolve_mxfp4_checkpoint(quant, hf_config)
    if stored == CHECKPOINT_FP8_METHOD:
        return _resolve_fp8_checkpoint(quant, hf_config)
    ct = parse_quantization_config(hf_config)
    if ct is None and hf_config.get("quantization_config"):
        method = hf_config["quantization_config"].get("quant_method")
        raise ValueError(
            f"config.json quantization_config: quant_method {method!r} is not supported "
            f"(only {CHECKPOINT_INT4_FORMAT!r} pack-quantized int4, {CHECKPOINT_FP8_METHOD!r} "
            f"block-quantized e4m3, and {CHECKPOINT_MXFP4_FORMAT!r} for gpt-oss)"
        )
    scheme = _expert_scheme(ct, hf_config) if ct is not None else None
    if scheme is None:
        if quant.method in ("int4", "mxfp4"):
            check_quant_divides(quant, hf_config)
        return replace(quant, method="none") if quant.method == "auto" else quant
    stored = (
        f"int4 group {scheme.group_size} {'symmetric' if scheme.symmetric else 'asymmetric'} "
        f"({CHECKPOINT_INT4_FORMAT} pack-quantized, config group {scheme.name!r})"
    )
    if scheme.group_size not in (32, 64, 128):
        raise ValueError(
            f"the checkpoint's experts are {stored}; the int4 path needs group size 32, 64 or 128"
        )
    if quant.method == "mxfp4" or (
        quant.method == "int4" and quant.group_size != scheme.group_size
    ):
        asked = f"--quantization {quant.method}" + (
            f" --quant-group-size {quant.group_size}" if quant.method == "int4" else ""
        )
        raise ValueError(
            f"{asked} conflicts with the checkpoint, whose experts are {stored}; pass "
            f"--quantization auto (or int4 with --quant-group-size {scheme.group_size})"
        )
    return QuantConfig(
        "int4", scheme.group_size, scheme.symmetric, CHECKPOINT_INT4_FORMAT, quant.scale_dtype
    )


def _resolve_fp8_checkpoint(quant: QuantConfig, hf_config: dict) -> QuantConfig:
    """An FP8 block-quantized checkpoint: its quantization_config is checked here (before any
    weight is read); its experts load dequantized, so --quantization is resolved as for a
    float checkpoint (no value conflicts with it).

    Raises:
        ValueError: an FP8 config `quant.fp8.parse_fp8_config` refuses, or a 4-bit group that
            does not divide the experts (`check_quant_divides`).
    """
    from quant.fp8 import parse_fp8_config

    parse_fp8_config(hf_config)
    if quant.method in ("int4", "mxfp4"):
        check_quant_divides(quant, hf_config)
    return replace(quant, method="none") if quant.method == "auto" else quant


def check_quant_divides(quant: QuantConfig, hf_config: dict) -> None:
    """Refuse load-time 4-bit experts whose group does not divide a dimension it groups, before
    any weight is read. Groups run along each expert projection's input: hidden_size for the
    gate/up projection (w13 [2I, H]), the expert width I for the down projection (w2 [H, I]).

    Raises:
        ValueError: naming the dimension by its config.json name and value, the group size, and
            the flag value that fits (--quant-group-size; MXFP4's block is always 32).
    """
    from moe_engine.models import resolve_config_dict

    model_cls = resolve_config_dict(hf_config)[1]
    shape = model_cls.model_shape(hf_config)
    dims = {
        "hidden_size": shape.hidden_size,
        model_cls.experts_width_field(hf_config): shape.moe_intermediate_size,
    }
    group = quant.group_size if quant.method == "int4" else 32
    bad = next((name for name, size in dims.items() if size % group), None)
    if bad is None:
        return
    what = f"--quant-group-size {group}" if quant.method == "int4" else "MXFP4's block of 32"
    fits = [g for g in (32, 64, 128) if all(size % g == 0 for size in dims.values())]
    both = " and ".join(f"{name}={size}" for name, size in dims.items())
    fix = (
        f"pass --quantization int4 --quant-group-size {fits[-1]} (it divides {both})"
        if fits
        else f"no int4 group size (32, 64, 128) divides {both}: pass --quantization none"
    )
    raise ValueError(
        f"{what} does not divide the experts' {bad}={dims[bad]} (config.json); {fix}"
    )


def _resolve_mxfp4_checkpoint(quant: QuantConfig, hf_config: dict) -> QuantConfig:
    """A gpt-oss checkpoint whose experts are MXFP4 (quant_method "mxfp4"): served as stored
    with --quantization none, auto or mxfp4.

    Raises:
        ValueError: another model type, or --quantization int4 (names the flag to use).
    """
    model_type = hf_config.get("model_type")
    if model_type not in _MXFP4_MODEL_TYPES:
        raise ValueError(
            f"config.json quantization_config: quant_method 'mxfp4' is supported for "
            f"{', '.join(_MXFP4_MODEL_TYPES)} checkpoints only, not model_type {model_type!r}"
        )
    if quant.method == "int4":
        raise ValueError(
            "--quantization int4 conflicts with the checkpoint, whose experts are mxfp4 "
            "(quantization_config quant_method 'mxfp4'); pass --quantization auto (or mxfp4)"
        )
    return QuantConfig("mxfp4", 32, True, CHECKPOINT_MXFP4_FORMAT)


def _expert_scheme(ct, hf_config: dict):
    """The compressed-tensors scheme of the first MoE layer's expert 0 (its gate projection,
    named as the architecture's checkpoint names it), or None when the routed experts stay
    float."""
    from moe_engine.models import resolve_config_dict

    model_cls = resolve_config_dict(hf_config)[1]
    layers = model_cls.model_shape(hf_config).moe_layers
    if not layers:
        return None
    return ct.scheme_for(model_cls.checkpoint_expert_name(layers[0], 0, "gate"))


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
            gets what the weights and a profiled activation peak leave (`moe_engine.memory`).
            Ignored on a CPU (the KV cache is sized by kv_cache_memory / MemAvailable there).
        enforce_eager: never capture CUDA graphs (`--enforce-eager`, vLLM's flag): every step
            runs eagerly. By default decode-only steps replay graphs captured at startup
            where they apply (`moe_engine.cuda_graphs`).
    """

    device: str = "auto"
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.device not in DEVICE_CHOICES:
            raise ValueError(
                f"device must be one of {', '.join(DEVICE_CHOICES)}; got {self.device!r}"
            )
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ValueError(
                f"gpu_memory_utilization (--gpu-memory-utilization) must be a fraction in "
                f"(0, 1] of the device's memory, got {util!r}"
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
    """

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    expert_trace: str | None = None
    kernel_backend: str = "auto"
    device: DeviceConfig = field(default_factory=DeviceConfig)


def native_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 / AMX), per oneDNN."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def compute_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype the CPU path computes in for weights of `weight_dtype`.

    bfloat16 without native support is emulated by oneDNN at a fraction of float32's speed
    (measured 19 vs 159 GFLOP/s on an AVX2 core pair), so such CPUs compute in float32 on the
    bfloat16-rounded weights unless MOE_ENGINE_FORCE_BF16=1.
    """
    if weight_dtype != torch.bfloat16 or os.environ.get("MOE_ENGINE_FORCE_BF16") == "1":
        return weight_dtype
    return torch.bfloat16 if native_bf16_matmul() else torch.float32


def default_threads(reserve_front_end: bool = False) -> int:
    """Intra-op threads for the CPU path: MOE_ENGINE_THREADS, else all cores.

    With `reserve_front_end` (a server whose gRPC process shares the machine), one core is left
    to the front end: intra-op threads that share every core with it stall each other
    (measured 10x slower steps on 2 cores).
    """
    if "MOE_ENGINE_THREADS" in os.environ:
        return int(os.environ["MOE_ENGINE_THREADS"])
    cores = os.cpu_count() or 1
    return max(1, cores - 1) if reserve_front_end else cores


def cache_root() -> Path:
    """Where generated checkpoints live: $MOE_ENGINE_CACHE, else ~/.cache/moe-engine."""
    root = os.environ.get("MOE_ENGINE_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "moe-engine"
