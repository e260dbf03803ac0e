"""DeepSeek's MLA attention prologue in Triton, one launch per layer (the "rotary" op of the
triton backend for MLA layers, `KernelPlan.mla_rope_prologue`): the latent c_kv normed by
`kv_a_layernorm`, the shared k_pe roped, [c_kv | k_pe] written into the latent cache at
`slot_mapping`, and every head's q_pe roped (DeepSeek-V2, arXiv:2405.04434, sec. 2.1; the torch
path is `MLAAttention.forward`'s rotary, norm, cat and `index_copy_`, about 25 launches).

The rope and the cache write repeat every rounding of the torch path (the helpers of
`kernels.dense.triton_rope`), so the roped parts are bit-identical to it; the norm's row sum
differs in order. Slots < 0 are not written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dense.triton_norm import interpreting, round_to
from kernels.dense.triton_rope import (
    all_of,
    check_index,
    check_tables,
    cos_sin,
    pad_pow2,
    prologue_warps,
    rope_rows,
    store_rows,
)


@triton.jit
def mla_rope_cache_kernel(
    kv_a_ptr, q_pe_ptr, positions_ptr, cos_ptr, sin_ptr, kv_norm_ptr, cache_ptr,
    slot_mapping_ptr, q_pe_out_ptr, eps, stride_kv_a, stride_qt, stride_qh, stride_cos,
    stride_cb, stride_cs, num_heads,
    H_PAD: tl.constexpr, RANK: tl.constexpr, RANK_PAD: tl.constexpr, ROPE: tl.constexpr,
    HALF_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, INTERLEAVED: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """One token: q_pe -> q_pe_out [T, n, ROPE]; [norm(c_kv) | rope(k_pe)] -> the latent cache
    at its slot (skipped if < 0)."""
    t = tl.program_id(0).to(tl.int64)
    dtype = q_pe_out_ptr.dtype.element_ty
    pos = tl.load(positions_ptr + t)
    c1, s1, c2, s2 = cos_sin(cos_ptr, sin_ptr, pos, stride_cos, dtype, ROPE, HALF_PAD,
                              ROUND_BF16)  # fmt: skip
    y1, y2, y3 = rope_rows(q_pe_ptr + t * stride_qt, stride_qh, num_heads, kv_norm_ptr, eps,
                            c1, s1, c2, s2, H_PAD, ROPE, ROPE, HALF_PAD, 1, False, INTERLEAVED,
                            dtype, ROUND_BF16)  # fmt: skip
    store_rows(q_pe_out_ptr + t * num_heads * ROPE, ROPE, num_heads, y1, y2, y3, t >= 0,
                H_PAD, ROPE, ROPE, HALF_PAD, 1)  # fmt: skip
    slot = tl.load(slot_mapping_ptr + t)
    dest = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    r = tl.arange(0, RANK_PAD)
    ok = r < RANK
    c = tl.load(kv_a_ptr + t * stride_kv_a + r, mask=ok, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(c * c, 0) / RANK + eps)
    w = tl.load(kv_norm_ptr + r, mask=ok, other=0.0).to(tl.float32)
    c = round_to(w * round_to(c * inv, dtype, ROUND_BF16).to(tl.float32), dtype, ROUND_BF16)
    tl.store(dest + r, c, mask=ok & all_of(slot >= 0, r))
    y1, y2, y3 = rope_rows(kv_a_ptr + t * stride_kv_a + RANK, 0, 1, kv_norm_ptr, eps,
                            c1, s1, c2, s2, 1, ROPE, ROPE, HALF_PAD, 1, False, INTERLEAVED,
                            dtype, ROUND_BF16)  # fmt: skip
    store_rows(dest + RANK, 0, 1, y1, y2, y3, slot >= 0, 1, ROPE, ROPE, HALF_PAD, 1)


def mla_rope_cache(
    kv_a: torch.Tensor,
    q_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kv_norm: torch.Tensor,
    eps: float,
    latent_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    interleaved: bool,
) -> torch.Tensor:
    """An MLA layer's prologue in one launch: `kv_a_layernorm` on c_kv, RoPE on k_pe and on
    every head's q_pe, [c_kv | k_pe] written into the latent cache (the torch path:
    `MLAAttention.forward`'s rotary, norm, cat and `index_copy_`).

    Args:
        kv_a: [T, r + rope] output of `kv_a_proj_with_mqa` (c_kv then k_pe), rows dense.
        q_pe: [T, n, rope] the queries' rope parts (a strided view of q is fine), kv_a's dtype.
        positions: [T] int32/int64, each in [0, P).
        cos_cache, sin_cache: [P, rope] float32 tables.
        kv_norm: [r] `kv_a_layernorm` weight (Qwen3-style rounding), kv_a's dtype.
        eps: its epsilon.
        latent_cache: [num_blocks, block_size, r + rope] of kv_a's dtype, last dim dense.
        slot_mapping: [T] int32/int64 flat slots; < 0: not written.
        interleaved: rope on interleaved pairs (DeepSeek checkpoints), output de-interleaved.

    Returns:
        q_pe roped: [T, n, rope] dense, kv_a's dtype.

    Raises:
        ValueError: shapes, dtypes or layouts that do not fit.
    """
    t, width = kv_a.shape
    rope = cos_cache.shape[-1]
    rank = width - rope
    if rank < 1 or kv_a.stride(1) != 1 or rope % 2:
        raise ValueError(
            f"kv_a must be [T, r + {rope}] with dense rows and an even rope, got "
            f"{tuple(kv_a.shape)}"
        )
    check_tables(cos_cache, sin_cache, rope, kv_a.device)
    if (
        q_pe.dim() != 3
        or q_pe.shape[0] != t
        or q_pe.shape[2] != rope
        or q_pe.stride(2) != 1
        or q_pe.dtype != kv_a.dtype
    ):
        raise ValueError(
            f"q_pe must be [{t}, n, {rope}] {kv_a.dtype} with a dense last dim, "
            f"got {q_pe.dtype} {tuple(q_pe.shape)}"
        )
    if kv_norm.dtype != kv_a.dtype or kv_norm.numel() != rank or not kv_norm.is_contiguous():
        raise ValueError(f"kv_norm must be dense [{rank}] {kv_a.dtype}")
    if (
        latent_cache.dim() != 3
        or latent_cache.shape[2] != width
        or latent_cache.dtype != kv_a.dtype
        or latent_cache.stride(2) != 1
    ):
        raise ValueError(
            f"latent_cache must be [blocks, block_size, {width}] {kv_a.dtype}, "
            f"got {latent_cache.dtype} {tuple(latent_cache.shape)}"
        )
    check_index("positions", positions, t)
    check_index("slot_mapping", slot_mapping, t)
    n = q_pe.shape[1]
    out = q_pe.new_empty(t, n, rope)
    if t == 0:
        return out
    mla_rope_cache_kernel[(t,)](
        kv_a, q_pe, positions, cos_cache, sin_cache, kv_norm, latent_cache, slot_mapping, out,
        eps, kv_a.stride(0), q_pe.stride(0), q_pe.stride(1), cos_cache.stride(0),
        latent_cache.stride(0), latent_cache.stride(1), n, H_PAD=pad_pow2(n), RANK=rank,
        RANK_PAD=pad_pow2(rank), ROPE=rope, HALF_PAD=pad_pow2(rope // 2),
        BLOCK_SIZE=latent_cache.shape[1], INTERLEAVED=interleaved,
        ROUND_BF16=interpreting() and kv_a.dtype == torch.bfloat16,
        num_warps=prologue_warps(pad_pow2(n) * rope), enable_fp_fusion=False,
    )  # fmt: skip
    return out
