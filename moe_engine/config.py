"""Engine configuration: frozen dataclasses composed into one `EngineConfig`.

User mistakes raise `ValueError` naming the field, the value and the limit.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
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
        """The checkpoint's config.json as a dict.

        Raises:
            FileNotFoundError: when config.json is missing.
        """
        path = Path(self.model) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model: no config.json in {self.model!r}")
        return json.loads(path.read_text())

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


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    Attributes:
        block_size: tokens per KV block.
        kv_cache_memory: bytes for the KV cache; None derives it from free memory.
        num_blocks_override: exact number of blocks (tests use it to force preemption).
    """

    block_size: int = 16
    kv_cache_memory: int | None = None
    num_blocks_override: int | None = None

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


@dataclass(frozen=True)
class ParallelConfig:
    """Ranks and threads.

    Attributes:
        ep_size: expert-parallel ranks, experts split evenly (1 = one rank).
        num_threads: intra-op CPU threads of a rank; None = `default_threads()`.
    """

    ep_size: int = 1
    num_threads: int | None = None


@dataclass(frozen=True)
class QuantConfig:
    """4-bit routed experts.

    Attributes:
        method: "none", "int4" (group-wise symmetric, `quant.int4`) or "mxfp4" (OCP MX v1.0,
            `quant.mxfp4`); the routed experts of a float checkpoint are quantized at load time,
            attention, router and embeddings keep the model dtype.
        group_size: int4 values per scale (32, 64 or 128).
    """

    method: str = "none"
    group_size: int = 128

    @property
    def bits_per_weight(self) -> float | None:
        """Storage per expert weight (bits): 4 plus the scale's share; None when unquantized.

        int4 keeps a 32-bit float scale per group; MXFP4 one 8-bit E8M0 scale per 32 values.
        """
        if self.method == "int4":
            return 4 + 32 / self.group_size
        if self.method == "mxfp4":
            return 4 + 8 / 32
        return None

    def __post_init__(self) -> None:
        if self.method not in ("none", "int4", "mxfp4"):
            raise ValueError(f"quantization must be one of none, int4, mxfp4; got {self.method!r}")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"quant group_size must be 32, 64 or 128, got {self.group_size}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs, composed of the configs above."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)


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
