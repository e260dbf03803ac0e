"""The attention prologue in Triton: q/k RMSNorm, rotary embedding and the KV-cache write in one
launch per layer (the "rotary" op of the triton backend, `KernelPlan.rope_prologue`), where
the torch path is about 20 launches (8 per q/k norm, 5 per roped tensor, 2 cache writes).

`qk_norm_rope_cache` has the contract of `kernels.dense.ops.qk_norm_rope_cache` (the native
CPU kernel) for a fused QKV output: split, optional per-head RMSNorm of q and k (Qwen3's
rounding), RoPE (RoFormer, Su et al. 2021) on the first `rotary_dim` dims of each head ("rotate
half" pairs (x_i, x_{i+R/2}) as transformers' `apply_rotary_pos_emb`, or interleaved pairs
(x_2i, x_2i+1) returned de-interleaved as `apply_rotary_pos_emb_interleave`), k and v written
at `slot_mapping`, q returned. The MLA counterpart, on the same `rope_tile`, is
`kernels.attention.triton_mla_prologue`.

The T x (Hq + 2 Hkv) head rows of the step are flattened, token-major, and cut into programs
of `BLOCK_R` rows (2048 values each on a GPU, so a batch-1 step still spreads over a few SMs;
one program under the interpreter, whose cost is per program). Every rounding of the torch path
is repeated (cos/sin cast to the dtype, each product and the sum rounded), with floating-point
contraction off, so the rope and the cache write are bit-identical to the torch ops; only the
norms' row sums differ in order. Slots < 0 (padding) are not written (vLLM's convention);
positions must lie in [0, P) of the tables (not checked on the device: a host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import interpreting, round_to


@triton.jit
def rope_tile(
    row_ptr,
    pos,
    row_ok,
    apply,
    cos_ptr,
    sin_ptr,
    stride_cos,
    wq_ptr,
    wk_ptr,
    use_wq,
    eps,
    dtype: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    ROT: tl.constexpr,
    HAS_NORM: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Head rows [R] (pointers to each row's first of HEAD_DIM values) at positions pos [R]:
    with HAS_NORM an RMSNorm over the row (weights wq where use_wq, else wk; Qwen3's
    rounding), then RoPE on the first ROT dims in torch's rounding (cos/sin cast to the dtype,
    each product rounded, then the sum), output de-interleaved. Rows where `apply` is False
    come back as loaded (values). Returns [R, D_PAD] in `dtype`."""
    d = tl.arange(0, D_PAD)
    half = ROT // 2
    rot = d < ROT
    first = d < half
    if INTERLEAVED:  # output d < half takes x[2d], d >= half takes x[2(d - half) + 1]
        src = tl.where(first, 2 * d, 2 * (d - half) + 1)
        partner = tl.where(first, src + 1, src - 1)
    else:
        src = d
        partner = tl.where(first, d + half, d - half)
    src = tl.where(rot, src, d)
    partner = tl.where(rot, partner, d)
    mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    base = row_ptr[:, None]
    raw = tl.load(base + d[None, :], mask=mask, other=0.0)
    xs = tl.load(base + src[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv = tl.math.rsqrt(tl.sum(xs * xs, 1) / HEAD_DIM + eps)[:, None]
        d_ok = d < HEAD_DIM
        wq = tl.load(wq_ptr + src, mask=d_ok, other=0.0)[None, :]
        wk = tl.load(wk_ptr + src, mask=d_ok, other=0.0)[None, :]
        ws = tl.where(use_wq[:, None], wq, wk).to(tl.float32)
        wq = tl.load(wq_ptr + partner, mask=d_ok, other=0.0)[None, :]
        wk = tl.load(wk_ptr + partner, mask=d_ok, other=0.0)[None, :]
        wp = tl.where(use_wq[:, None], wq, wk).to(tl.float32)
        xs = round_to(ws * round_to(xs * inv, dtype, ROUND_BF16).to(tl.float32), dtype, ROUND_BF16)
        xp = round_to(wp * round_to(xp * inv, dtype, ROUND_BF16).to(tl.float32), dtype, ROUND_BF16)
        xs, xp = xs.to(tl.float32), xp.to(tl.float32)
    table = pos.to(tl.int64)[:, None] * stride_cos + d[None, :]
    table_ok = row_ok[:, None] & rot[None, :]
    c = tl.load(cos_ptr + table, mask=table_ok, other=0.0)
    s = tl.load(sin_ptr + table, mask=table_ok, other=0.0)
    c = round_to(c, dtype, ROUND_BF16).to(tl.float32)
    s = round_to(s, dtype, ROUND_BF16).to(tl.float32)
    # torch: x * cos + rotate_half(x) * sin; rotate_half's first half is -x2 (negation exact)
    sign = tl.where(first, -1.0, 1.0)[None, :]
    y = round_to(xs * c, dtype, ROUND_BF16).to(tl.float32) + round_to(
        sign * xp * s, dtype, ROUND_BF16
    ).to(tl.float32)
    y = round_to(tl.where(rot[None, :], y, xs), dtype, ROUND_BF16)
    return tl.where(apply[:, None], y, raw)


@triton.jit
def qk_norm_rope_cache_kernel(
    qkv_ptr, positions_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, k_cache_ptr, v_cache_ptr,
    slot_mapping_ptr, q_out_ptr, eps, num_rows, stride_qkv, stride_cos, stride_kb, stride_ks,
    stride_kh, stride_vb, stride_vs, stride_vh, num_heads, num_kv_heads,
    BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, ROT: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HAS_NORM: tl.constexpr, INTERLEAVED: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """BLOCK_R of the T x (Hq + 2 Hkv) head rows of qkv, token-major: q rows -> q_out
    [T, Hq, D]; k, v rows -> the caches at their token's slot (skipped if < 0)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    t = (rows // (num_heads + 2 * num_kv_heads)).to(tl.int64)
    h = rows % (num_heads + 2 * num_kv_heads)
    is_q = h < num_heads
    is_v = h >= num_heads + num_kv_heads
    pos = tl.load(positions_ptr + t, mask=row_ok, other=0)
    y = rope_tile(qkv_ptr + t * stride_qkv + h * HEAD_DIM, pos, row_ok, h < num_heads +
                  num_kv_heads, cos_ptr, sin_ptr, stride_cos, q_norm_ptr, k_norm_ptr, is_q, eps,
                  q_out_ptr.dtype.element_ty, HEAD_DIM, D_PAD, ROT, HAS_NORM, INTERLEAVED,
                  ROUND_BF16)  # fmt: skip
    d = tl.arange(0, D_PAD)[None, :]
    d_ok = d < HEAD_DIM
    q_off = (t * num_heads + h) * HEAD_DIM
    tl.store(q_out_ptr + q_off[:, None] + d, y, mask=(row_ok & is_q)[:, None] & d_ok)
    slot = tl.load(slot_mapping_ptr + t, mask=row_ok, other=-1).to(tl.int64)
    blk, off = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    written = row_ok & (slot >= 0) & (h >= num_heads)
    kh = h - num_heads
    k_off = blk * stride_kb + off * stride_ks + kh * stride_kh
    tl.store(k_cache_ptr + k_off[:, None] + d, y, mask=(written & (is_v == 0))[:, None] & d_ok)
    v_off = blk * stride_vb + off * stride_vs + (kh - num_kv_heads) * stride_vh
    tl.store(v_cache_ptr + v_off[:, None] + d, y, mask=(written & is_v)[:, None] & d_ok)


def prologue_warps(tile: int) -> int:
    """Warps for a program holding a tile of `tile` values: 4 up to 4096, more above."""
    return min(16, max(4, tile // 1024))


def pad_pow2(n: int) -> int:
    return max(1, triton.next_power_of_2(n))


def check_index(name: str, idx: torch.Tensor, t: int) -> None:
    if (
        idx.dtype not in (torch.int32, torch.int64)
        or idx.shape != (t,)
        or (not idx.is_contiguous())
    ):
        raise ValueError(
            f"{name} must be dense int32/int64 [{t}], got {idx.dtype} {tuple(idx.shape)}"
        )


def check_tables(cos_cache, sin_cache, rot: int, device) -> None:
    for name, table in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if (
            table.dtype != torch.float32
            or table.dim() != 2
            or table.shape[1] != rot
            or table.stride(1) != 1
            or table.device != device
        ):
            raise ValueError(
                f"{name} must be float32 [P, {rot}] on {device}, got "
                f"{table.dtype} {tuple(table.shape)} on {table.device}"
            )
    if cos_cache.stride() != sin_cache.stride():
        raise ValueError("cos_cache and sin_cache must share their strides")


def qk_norm_rope_cache(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    interleaved: bool = False,
    block_rows: int | None = None,
) -> torch.Tensor:
    """A layer's attention prologue in one launch (the contract of
    `kernels.dense.ops.qk_norm_rope_cache`, plus partial and interleaved rope).

    Args:
        qkv: [T, (Hq + 2 Hkv) * D] float32/bfloat16/float16, rows dense (a row stride is free).
        num_heads: Hq; num_kv_heads: Hkv (D follows from qkv's width).
        positions: [T] int32/int64 positions, each in [0, P).
        cos_cache, sin_cache: [P, R] float32 tables (`RotaryEmbedding.cos_cache`), R even and
            <= D: the first R dims of each head are rotated, the rest pass through.
        q_norm, k_norm: [D] weights of qkv's dtype, or both None (no q/k norm).
        eps: the norms' epsilon.
        k_cache, v_cache: [num_blocks, block_size, Hkv, D] of qkv's dtype, last dim dense.
        slot_mapping: [T] int32/int64 flat slot (block * block_size + offset) per token; < 0:
            not written.
        interleaved: rotate the pairs (x_2i, x_2i+1) and return them de-interleaved.
        block_rows: head rows per program (a power of two; tests), None: 2048 values a
            program on a GPU, every row in one program under the interpreter (its cost is per
            program).

    Returns:
        q: [T, Hq, D], qkv's dtype.

    Raises:
        ValueError: shapes, dtypes or layouts that do not fit.
    """
    t, width = qkv.shape
    d = width // (num_heads + 2 * num_kv_heads)
    rot = cos_cache.shape[-1]
    if width != (num_heads + 2 * num_kv_heads) * d or qkv.stride(1) != 1:
        raise ValueError(
            f"qkv must be [T, (Hq + 2 Hkv) * D] with dense rows, got "
            f"{tuple(qkv.shape)} for Hq={num_heads}, Hkv={num_kv_heads}"
        )
    if rot % 2 or not 2 <= rot <= d:
        raise ValueError(f"the tables rotate {rot} dims: must be even and in [2, {d}]")
    check_tables(cos_cache, sin_cache, rot, qkv.device)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (
            c.dtype != qkv.dtype
            or c.dim() != 4
            or tuple(c.shape[2:]) != (num_kv_heads, d)
            or c.stride(-1) != 1
        ):
            raise ValueError(
                f"{name} must be [blocks, block_size, {num_kv_heads}, {d}] "
                f"{qkv.dtype}, got {c.dtype} {tuple(c.shape)}"
            )
    if k_cache.shape[1] != v_cache.shape[1]:
        raise ValueError("k_cache and v_cache must share their block size")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm are given together or not at all")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None and (w.dtype != qkv.dtype or w.numel() != d or not w.is_contiguous()):
            raise ValueError(f"{name} must be dense [{d}] {qkv.dtype}")
    check_index("positions", positions, t)
    check_index("slot_mapping", slot_mapping, t)
    q = qkv.new_empty(t, num_heads, d)
    if t == 0:
        return q
    qkv_norm = q if q_norm is None else q_norm
    rows = t * (num_heads + 2 * num_kv_heads)
    d_pad = pad_pow2(d)
    block_r = block_rows or (pad_pow2(rows) if interpreting() else max(1, 2048 // d_pad))
    qk_norm_rope_cache_kernel[(triton.cdiv(rows, block_r),)](
        qkv, positions, cos_cache, sin_cache, qkv_norm, qkv_norm if k_norm is None else k_norm,
        k_cache, v_cache, slot_mapping, q, eps, rows, qkv.stride(0), cos_cache.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3], num_heads, num_kv_heads,
        BLOCK_R=block_r, HEAD_DIM=d, D_PAD=d_pad, ROT=rot, BLOCK_SIZE=k_cache.shape[1],
        HAS_NORM=q_norm is not None, INTERLEAVED=interleaved,
        ROUND_BF16=interpreting() and qkv.dtype == torch.bfloat16,
        num_warps=prologue_warps(block_r * d_pad), enable_fp_fusion=False,
    )  # fmt: skip
    return q
