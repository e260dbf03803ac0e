"""DeepSeek's MLA attention prologue in Triton, one launch per layer (the "rotary" op of the
triton backend for MLA layers, `KernelPlan.mla_rope_prologue`): the latent c_kv normed by
`kv_a_layernorm`, the shared k_pe roped, [c_kv | k_pe] written into the latent cache at
`slot_mapping`, and every head's q_pe roped (DeepSeek-V2, arXiv:2405.04434, sec. 2.1; the torch
path is `MLAAttention.forward`'s rotary, norm, cat and `index_copy_`, about 25 launches).

The rope and the cache write repeat every rounding of the torch path (the helpers of
`kernels.dense.triton_rope`), so the roped parts are bit-identical to it; the norm's row sum
differs in order. Slots < 0 are not written. The rope rows (n q_pe heads and k_pe per token)
are flattened and cut into programs as the dense prologue's; the c_kv norms take programs of
their own after them, one token each on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dense.triton_rope import (
    check_index,
    check_tables,
    pad_pow2,
    prologue_warps,
    rope_tile,
)
from kernels.triton_common import interpreting, round_to


@triton.jit
def mla_rope_cache_kernel(
    kv_a_ptr, q_pe_ptr, positions_ptr, cos_ptr, sin_ptr, kv_norm_ptr, cache_ptr,
    slot_mapping_ptr, q_pe_out_ptr, eps, num_tokens, rope_programs, stride_kv_a, stride_qt,
    stride_qh, stride_cos, stride_cb, stride_cs, num_heads,
    BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, RANK: tl.constexpr, RANK_PAD: tl.constexpr,
    ROPE: tl.constexpr, ROPE_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    INTERLEAVED: tl.constexpr, ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """Programs [0, rope_programs): BLOCK_R of the T x (n + 1) rope rows, token-major (n q_pe
    heads -> q_pe_out [T, n, ROPE], then k_pe -> the latent cache's last ROPE columns); the
    others: BLOCK_T tokens' c_kv, normed -> the latent cache's first RANK columns."""
    pid = tl.program_id(0)
    dtype = q_pe_out_ptr.dtype.element_ty
    if pid < rope_programs:
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < num_tokens * (num_heads + 1)
        t = (rows // (num_heads + 1)).to(tl.int64)
        j = rows % (num_heads + 1)
        is_q = j < num_heads
        src = tl.where(is_q, q_pe_ptr + t * stride_qt + j * stride_qh,
                       kv_a_ptr + t * stride_kv_a + RANK)  # fmt: skip
        pos = tl.load(positions_ptr + t, mask=row_ok, other=0)
        y = rope_tile(src, pos, row_ok, row_ok, cos_ptr, sin_ptr, stride_cos, kv_norm_ptr,
                      kv_norm_ptr, is_q, eps, dtype, ROPE, ROPE_PAD, ROPE, False, INTERLEAVED,
                      ROUND_BF16)  # fmt: skip
        slot = tl.load(slot_mapping_ptr + t, mask=row_ok, other=-1).to(tl.int64)
        latent = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + RANK
        dest = tl.where(is_q, q_pe_out_ptr + (t * num_heads + j) * ROPE, cache_ptr + latent)
        ok = row_ok & (is_q | (slot >= 0))
        d = tl.arange(0, ROPE_PAD)
        tl.store(dest[:, None] + d[None, :], y, mask=ok[:, None] & (d < ROPE)[None, :])
    else:  # (names apart from the branch above: compiled Triton unifies shared names)
        tok = ((pid - rope_programs) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        tok_ok = tok < num_tokens
        col = tl.arange(0, RANK_PAD)
        c_mask = tok_ok[:, None] & (col < RANK)[None, :]
        c = tl.load(kv_a_ptr + tok[:, None] * stride_kv_a + col[None, :], mask=c_mask, other=0.0)
        c = c.to(tl.float32)
        inv = tl.math.rsqrt(tl.sum(c * c, 1) / RANK + eps)[:, None]
        w = tl.load(kv_norm_ptr + col, mask=col < RANK, other=0.0).to(tl.float32)[None, :]
        c = round_to(w * round_to(c * inv, dtype, ROUND_BF16).to(tl.float32), dtype, ROUND_BF16)
        tok_slot = tl.load(slot_mapping_ptr + tok, mask=tok_ok, other=-1).to(tl.int64)
        c_row = (tok_slot // BLOCK_SIZE) * stride_cb + (tok_slot % BLOCK_SIZE) * stride_cs
        tl.store(cache_ptr + c_row[:, None] + col[None, :], c,
                 mask=c_mask & (tok_slot >= 0)[:, None])  # fmt: skip


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
    *,
    blocks: tuple[int, int] | None = None,
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
        blocks: (rope rows, tokens) per program, powers of two (tests); None: 2048 values and
            one token on a GPU, everything in two programs under the interpreter.

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
    rope_rows = t * (n + 1)
    rope_pad = pad_pow2(rope)
    if blocks is not None:
        block_r, block_t = blocks
    elif interpreting():  # its cost is per program: one of each kind
        block_r, block_t = pad_pow2(rope_rows), pad_pow2(t)
    else:
        block_r, block_t = max(1, 2048 // rope_pad), 1
    rope_programs = triton.cdiv(rope_rows, block_r)
    mla_rope_cache_kernel[(rope_programs + triton.cdiv(t, block_t),)](
        kv_a, q_pe, positions, cos_cache, sin_cache, kv_norm, latent_cache, slot_mapping, out,
        eps, t, rope_programs, kv_a.stride(0), q_pe.stride(0), q_pe.stride(1),
        cos_cache.stride(0), latent_cache.stride(0), latent_cache.stride(1), n,
        BLOCK_R=block_r, BLOCK_T=block_t, RANK=rank, RANK_PAD=pad_pow2(rank), ROPE=rope,
        ROPE_PAD=rope_pad, BLOCK_SIZE=latent_cache.shape[1], INTERLEAVED=interleaved,
        ROUND_BF16=interpreting() and kv_a.dtype == torch.bfloat16,
        num_warps=prologue_warps(max(block_r * rope_pad, block_t * pad_pow2(rank))),
        enable_fp_fusion=False,
    )  # fmt: skip
    return out
