"""The served families' layer shapes and the sweep settings of the Hopper compile check.

Shapes are the published ``config.json`` values (Hugging Face model repositories; three of them
are copied in tests/data/configs/): only the fields that reach a Triton launch. A family's
``quantizations`` are the expert weight formats the engine can serve it with (``none`` = the
compute dtype; ``int4`` needs both K dimensions of the experts to divide by the group size, so
gpt-oss, K = 2880, takes groups of 32 or 64 only; ``mxfp4`` needs K % 32 == 0).

Read by bench/gpu_variants.py (the per-op drivers) and bench/gpu_compile.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Family:
    """One served model family, as its launches see it.

    Attributes:
        name: what the report calls it.
        hidden_size: H (elements); moe_intermediate_size: I of one routed expert (elements).
        num_experts: routed experts E; top_k: experts per token.
        num_heads: query heads Hq; num_kv_heads: Hkv; head_dim: D (elements). MLA families:
            num_kv_heads 1 and ``kv_lora_rank`` / ``rope_dim`` set (the latent cache).
        max_position_embeddings: the model's longest context (tokens): the default
            ``max_model_len`` and so the width of the CUDA graphs' block tables.
        sliding_window: tokens, or None; some layers of the family use it (gpt-oss: every other
            layer), so both the windowed and the full launch are swept.
        sinks: per-head attention sinks (gpt-oss).
        clamped_swiglu: gpt-oss's clamped SwiGLU with expert biases.
        quantizations: expert formats served: "none", "int4", "mxfp4".
    """

    name: str
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    sliding_window: int | None = None
    sinks: bool = False
    clamped_swiglu: bool = False
    kv_lora_rank: int | None = None
    rope_dim: int | None = None
    quantizations: tuple[str, ...] = ("none", "int4", "mxfp4")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None


#: gpt-oss: every other layer a 128-token window; sinks; clamped SwiGLU with expert biases.
_GPT_OSS = {"sliding_window": 128, "sinks": True, "clamped_swiglu": True}

#: Positional fields: name, H, I, E, top_k, Hq, Hkv, head_dim, max_position_embeddings.
FAMILIES: tuple[Family, ...] = (
    # Qwen/Qwen3-30B-A3B
    Family("Qwen3-30B-A3B", 2048, 768, 128, 8, 32, 4, 128, 40960),
    # openai/gpt-oss-20b and gpt-oss-120b: MXFP4 experts in the checkpoint
    Family("gpt-oss-20b", 2880, 2880, 32, 4, 64, 8, 64, 131072, **_GPT_OSS),
    Family("gpt-oss-120b", 2880, 2880, 128, 4, 64, 8, 64, 131072, **_GPT_OSS),
    # deepseek-ai/DeepSeek-V3: MLA (128 heads, latent 512 + rope 64); prefill chunks run on torch
    Family(
        "DeepSeek-V3", 7168, 2048, 256, 8, 128, 1, 576, 163840, kv_lora_rank=512, rope_dim=64
    ),  # fmt: skip
    # mistralai/Mixtral-8x7B-v0.1
    Family("Mixtral-8x7B", 4096, 14336, 8, 2, 32, 8, 128, 32768),
    # Qwen/Qwen3-Next-80B-A3B: full-attention layers (linear attention layers run on torch)
    Family("Qwen3-Next-80B", 2048, 512, 512, 10, 16, 2, 256, 262144),
)

#: int4 (group size, scale dtype, zero points) combinations swept: the load-time default (128,
#: fp32, symmetric), a checkpoint's 16-bit scales, compressed-tensors' zero points, and group
#: 32 (the only one gpt-oss's K = 2880 takes with 128 unavailable, besides 64).
INT4_VARIANTS: tuple[tuple[int, torch.dtype, bool], ...] = (
    (128, torch.float32, False),
    (128, torch.bfloat16, False),
    (128, torch.bfloat16, True),
    (64, torch.float32, False),
    (32, torch.float32, False),
)


@dataclass(frozen=True)
class Sweep:
    """What the drivers iterate over.

    Attributes:
        dtypes: compute dtypes (activations, KV cache, float experts).
        num_tokens: tokens of one MoE / prefill call (before top-k).
        decode_batches: decode batch sizes (the CUDA graphs' sizes and the cap).
        max_model_lens: block-table widths (tokens) for decode; None stands for the family's
            max_position_embeddings.
        block_size: the KV cache's block size (tokens; the engine's default).
        int4_variants: see `INT4_VARIANTS`.
        moe_config: a `kernels.moe.fused_moe_configs.MoeTileConfig` forced on every fused-MoE
            call (exploring configs, the check's own test); None: the launcher's choice.
    """

    dtypes: tuple[torch.dtype, ...]
    num_tokens: tuple[int, ...]
    decode_batches: tuple[int, ...]
    max_model_lens: tuple[int | None, ...]
    block_size: int = 16
    int4_variants: tuple[tuple[int, torch.dtype, bool], ...] = INT4_VARIANTS
    moe_config: Any = None


_POW2_TOKENS = tuple(1 << i for i in range(14))  # 1 .. 8192
#: Odd counts next to each power of two: T * top_k then loses the divisibility by 16 that a
#: launch specializes on, a different compiled variant (prefill and eager steps have any T).
_ODD_TOKENS = tuple((1 << i) + 1 for i in range(1, 14))

FULL = Sweep(
    dtypes=(torch.bfloat16, torch.float16, torch.float32),
    num_tokens=tuple(sorted(set(_POW2_TOKENS + _ODD_TOKENS))),
    decode_batches=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    max_model_lens=(None, 32768, 8192, 4096, 2048, 1024),
)

QUICK = Sweep(
    dtypes=(torch.bfloat16,),
    num_tokens=(1, 4, 256, 4096),
    decode_batches=(1, 64),
    max_model_lens=(None,),
    int4_variants=(INT4_VARIANTS[0],),
)
