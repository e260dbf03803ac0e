"""Tile configurations of the Triton fused MoE (`kernels.moe.fused_moe`), per shape, from a table.

The same idea as vLLM's fused-MoE JSON configs (vllm/model_executor/layers/fused_moe/configs/
``E=..,N=..,device_name=...json``): for a layer shape and weight format, the best
``BLOCK_SIZE_M/N/K``, ``num_warps`` and ``num_stages`` depend mostly on the number of tokens,
so the table holds a few token buckets per (N, K, weight format), and a shape not in the table
gets `default_config`'s rule.

Key: ``(weight_format, N, K)`` with N = the intermediate size I of one expert (GEMM1 computes
``2I`` gate/up rows over K = the hidden size H; GEMM2 computes H rows over I) and
``weight_format`` one of `WEIGHT_FORMATS`; one config serves both GEMMs of a call, because
they walk the same ``moe_align_block_size`` output (one ``BLOCK_SIZE_M``). Each entry maps the
smallest token-count bucket >= the call's ``num_tokens`` (`TOKEN_BUCKETS`) to a config.

Where the entries come from: NOT measured. No GPU was available when this table was written;
the entries for the Qwen3-30B-A3B (H 2048, I 768) and gpt-oss-20b (H 2880, I 2880) expert
shapes are hand-picked starting points (the `default_config` reasoning), not copied from vLLM's
files and not benchmarked. They are to be replaced by measurements from ``bench/gpu_kernels.py``
on the target GPU (sweep the tiles per bucket, keep the fastest, write them here in this
format). Every config is valid for any shape: the launcher shrinks N/K tiles to the problem
(never below 16, Triton's ``tl.dot`` minimum), so the interpreter's tiny test shapes run with
the same table.

What IS checked, without a GPU: every entry and every `default_config` tile, compiled for sm_90
by ``bench/gpu_compile.py`` for the served families' shapes in bf16, fp16 and fp32 (int4 with
fp32/bf16 scales and zero points, MXFP4), fits the 232,448 B of shared memory an H100/H200
block gets, and the 16-bit decode tiles (<= 256 tokens) compile without register spills. That
check replaced the first hand-picked 4-bit tiles (decode 16x128x128, 4 warps, 3 stages, and
32x128x128 at 256 tokens): with the byte-per-weight loader of that time (one fp32 scale load per
weight) the decode tile needed 303,104 B of shared memory with int4 and every K-128 4-bit tile
spilled, so the 4-bit tiles here step K by 64 (under 100 KB, no decode spills with that loader;
16-33 KB with the packed loader that followed, which also fits the old K-128 tiles except
32x128x128 at 4 warps, whose MXFP4 GEMM1 still spills). Which of these is fastest is for the
GPU sweep to say; the compile check says only that they fit.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Weight formats a config is keyed by (`kernels.moe.fused_moe` WEIGHT_FORMAT 0 / 1 / 2).
WEIGHT_FORMATS = ("float", "int4", "mxfp4")

#: Token-count buckets (tokens of one call, before top-k): a call uses the first bucket >= its
#: token count, the last one above it.
TOKEN_BUCKETS = (1, 8, 16, 64, 256, 1024, 4096)


@dataclass(frozen=True)
class MoeTileConfig:
    """One launch configuration of `kernels.moe.fused_moe_kernels.fused_moe_kernel`.

    Attributes:
        BLOCK_SIZE_M: token-expert pairs per tile (also `moe_align_block_size`'s block size);
            a power of two >= 16.
        BLOCK_SIZE_N: output columns per tile; BLOCK_SIZE_K: reduction step; powers of two
            >= 16 (shrunk by the launcher to the problem when larger).
        num_warps: warps per program (compiled Triton; ignored by the interpreter).
        num_stages: software-pipelining stages of the K loop (compiled Triton).

    Raises:
        ValueError: a block size that is not a power of two >= 16, or num_warps / num_stages
            below 1 (names the field and the value).
    """

    BLOCK_SIZE_M: int = 16
    BLOCK_SIZE_N: int = 64
    BLOCK_SIZE_K: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"MoeTileConfig.{name} must be a power of two >= 16, got {value}")
        for name in ("num_warps", "num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoeTileConfig.{name} must be >= 1, got {getattr(self, name)}")


_C = MoeTileConfig

#: Both 4-bit formats of the Qwen3-30B-A3B experts: the same tiles (a byte per two weights).
#: Decode tiles stay at K 64 (see the module docstring: 16x128x128 overflowed shared memory).
_QWEN3_4BIT = {
    1: _C(16, 64, 64, 4, 3),
    64: _C(16, 64, 64, 4, 3),
    256: _C(32, 128, 64, 8, 2),
    4096: _C(64, 128, 64, 8, 2),
}

#: (weight_format, N = I, K = H) -> {token bucket: config}. Defaults to be tuned (see above).
#: Float decode tiles keep 3 stages: 4 stages of 16x64x128 needed 221,184 B in fp32.
TUNED: dict[tuple[str, int, int], dict[int, MoeTileConfig]] = {
    # Qwen3-30B-A3B experts: H 2048, I 768 (128 experts, top-8)
    ("float", 768, 2048): {
        1: _C(16, 64, 128, 4, 3),
        16: _C(16, 64, 128, 4, 3),
        64: _C(16, 128, 64, 4, 3),
        256: _C(32, 128, 64, 4, 3),
        1024: _C(64, 128, 64, 8, 3),
        4096: _C(128, 128, 64, 8, 3),
    },
    ("int4", 768, 2048): _QWEN3_4BIT,
    ("mxfp4", 768, 2048): _QWEN3_4BIT,
    # gpt-oss-20b experts: H 2880, I 2880 (32 experts, top-4)
    ("mxfp4", 2880, 2880): {
        1: _C(16, 64, 64, 4, 3),
        64: _C(16, 64, 64, 4, 3),
        256: _C(32, 128, 64, 8, 2),
        4096: _C(64, 128, 64, 8, 2),
    },
    ("float", 2880, 2880): {
        1: _C(16, 64, 128, 4, 3),
        64: _C(16, 128, 64, 4, 3),
        256: _C(32, 128, 64, 4, 3),
        4096: _C(128, 128, 64, 8, 3),
    },
}


def token_bucket(num_tokens: int) -> int:
    """The first of `TOKEN_BUCKETS` >= `num_tokens` (the last one for larger counts)."""
    for bucket in TOKEN_BUCKETS:
        if num_tokens <= bucket:
            return bucket
    return TOKEN_BUCKETS[-1]


def default_config(num_tokens: int, n: int, k: int, weight_format: str) -> MoeTileConfig:
    """The rule for shapes not in `TUNED`: vLLM's ``get_default_config`` shape, simplified.

    Small batches (decode: each expert sees a few pairs) take the smallest M tile and a wide K
    step, so that a program streams weights with few idle rows; large batches grow M to reuse
    each weight tile over more pairs. 4-bit weights keep K 64 and 8 warps from 65 tokens on
    (the K-128 tiles overflowed or spilled with the first 4-bit loader; see the module
    docstring; bench/gpu_compile.py checks every tile here fits an H100 block without
    decode-path spills). N and K only cap the tiles (the launcher shrinks them again).
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    four_bit = weight_format != "float"
    block_k = 128 if not four_bit and num_tokens <= 64 else 64
    if num_tokens <= 64:
        block_m, block_n, warps, stages = 16, 64, 4, 3
    elif num_tokens <= 1024:
        block_m, block_n, warps, stages = (32, 128, 8, 2) if four_bit else (32, 128, 4, 3)
    else:
        block_m, block_n, warps, stages = 64, 128, 8, 2
    return MoeTileConfig(
        block_m, min(block_n, _pow2_cap(n)), min(block_k, _pow2_cap(k)), warps, stages
    )


def _pow2_cap(dim: int) -> int:
    """The smallest power of two >= dim, at least 16 (a tile never wider than the problem)."""
    return max(16, 1 << max(dim - 1, 0).bit_length())


def get_moe_config(num_tokens: int, n: int, k: int, weight_format: str) -> MoeTileConfig:
    """The config of a fused-MoE call: `TUNED`'s entry for (weight_format, n, k) at the
    smallest bucket >= num_tokens that the entry has (its largest otherwise), else
    `default_config`.

    Args:
        num_tokens: tokens of the call (T, before top-k).
        n: I, the intermediate size of one expert; k: H, the hidden size.
        weight_format: "float", "int4" or "mxfp4".

    Raises:
        ValueError: an unknown weight format.
    """
    entry = TUNED.get((weight_format, n, k))
    if entry is None:
        return default_config(num_tokens, n, k, weight_format)
    for bucket in sorted(entry):
        if num_tokens <= bucket:
            return entry[bucket]
    return entry[max(entry)]
