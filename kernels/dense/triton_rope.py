"""The attention prologue in Triton: q/k RMSNorm, rotary embedding and the KV-cache write in one
launch per layer (the "rotary" op of the triton backend, `KernelPlan.rope_prologue`), where
the torch path is about 20 launches (8 per q/k norm, 5 per roped tensor, 2 cache writes).

`qk_norm_rope_cache` has the contract of `kernels.dense.ops.qk_norm_rope_cache` (the native
  CPU kernel) for a fused QKV output: split, optional per-head RMSNorm of q and k (Qwen3's
  rounding), RoPE (RoFormer, Su et al. 2021) on the first `rotary_dim` dims of each head
  ("rotate half" pairs (x_i, x_{i+R/2}) as transformers' `apply_rotary_pos_emb`, or
  interleaved pairs (x_2i, x_2i+1) returned de-interleaved as `apply_rotary_pos_emb_interleave`),
  k and v written at `slot_mapping`, q returned.
The MLA counterpart, on the same helpers, is `kernels.attention.triton_mla_prologue`.

One program per token handles all its heads (the row tiles fit registers at real sizes: 64 x
128 values). Every rounding of the torch path is repeated (cos/sin cast to the dtype, each
product and the sum rounded), with floating-point contraction off, so the rope and the cache
write are bit-identical to the torch ops; only the norms' row sums differ in order. Slots < 0
(padding) are not written (vLLM's convention); positions must lie in [0, P) of the tables
(not checked on the device, which would cost a host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dense.triton_norm import interpreting, round_to


@triton.jit
def rope_rows(
    ptr,
    row_stride,
    rows,
    norm_ptr,
    eps,
    c1,
    s1,
    c2,
    s2,
    ROWS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT: tl.constexpr,
    HALF_PAD: tl.constexpr,
    REST_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    dtype: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """`rows` head rows at ptr + row * row_stride: optional RMSNorm over HEAD_DIM, then RoPE
    on the first ROT dims. Returns the rotated halves (y1 [ROWS_PAD, HALF_PAD], y2) and the
    pass-through rest (y3 [ROWS_PAD, REST_PAD]) in `dtype`."""
    r = tl.arange(0, ROWS_PAD)
    i = tl.arange(0, HALF_PAD)
    j = tl.arange(0, REST_PAD)
    row_ok = r < rows
    half_ok = row_ok[:, None] & (i < ROT // 2)[None, :]
    rest_ok = row_ok[:, None] & (j < HEAD_DIM - ROT)[None, :]
    base = ptr + r.to(tl.int64)[:, None] * row_stride
    if INTERLEAVED:
        ia, ib = 2 * i, 2 * i + 1
    else:
        ia, ib = i, i + ROT // 2
    a = tl.load(base + ia[None, :], mask=half_ok, other=0.0).to(tl.float32)
    b = tl.load(base + ib[None, :], mask=half_ok, other=0.0).to(tl.float32)
    c = tl.load(base + ROT + j[None, :], mask=rest_ok, other=0.0).to(tl.float32)
    if HAS_NORM:
        ss = tl.sum(a * a, 1) + tl.sum(b * b, 1) + tl.sum(c * c, 1)
        inv = tl.math.rsqrt(ss / HEAD_DIM + eps)[:, None]
        wa = tl.load(norm_ptr + ia, mask=i < ROT // 2, other=0.0).to(tl.float32)[None, :]
        wb = tl.load(norm_ptr + ib, mask=i < ROT // 2, other=0.0).to(tl.float32)[None, :]
        wc = tl.load(norm_ptr + ROT + j, mask=j < HEAD_DIM - ROT, other=0.0)
        a = round_to(wa * round_to(a * inv, dtype, ROUND_BF16).to(tl.float32), dtype, ROUND_BF16)
        b = round_to(wb * round_to(b * inv, dtype, ROUND_BF16).to(tl.float32), dtype, ROUND_BF16)
        c = round_to(
            wc.to(tl.float32)[None, :] * round_to(c * inv, dtype, ROUND_BF16).to(tl.float32),
            dtype,
            ROUND_BF16,
        )
        a, b, c = a.to(tl.float32), b.to(tl.float32), c.to(tl.float32)
    # torch: x * cos + rotate_half(x) * sin, each product rounded to the dtype, then the sum
    y1 = round_to(a * c1[None, :], dtype, ROUND_BF16).to(tl.float32) + round_to(
        -b * s1[None, :], dtype, ROUND_BF16
    ).to(tl.float32)
    y2 = round_to(b * c2[None, :], dtype, ROUND_BF16).to(tl.float32) + round_to(
        a * s2[None, :], dtype, ROUND_BF16
    ).to(tl.float32)
    return (
        round_to(y1, dtype, ROUND_BF16),
        round_to(y2, dtype, ROUND_BF16),
        round_to(c, dtype, ROUND_BF16),
    )


@triton.jit
def all_of(ok, like):
    """The scalar bool `ok` as a bool tensor shaped like the int tensor `like` (the
    interpreter refuses a mask of a tensor and'ed with a scalar)."""
    return (like * 0 + ok.to(tl.int32)) != 0


@triton.jit
def store_rows(
    ptr,
    row_stride,
    rows,
    y1,
    y2,
    y3,
    ok,
    ROWS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT: tl.constexpr,
    HALF_PAD: tl.constexpr,
    REST_PAD: tl.constexpr,
):
    """The de-interleaved rows [y1 | y2 | y3] at ptr + row * row_stride (where `ok`)."""
    r = tl.arange(0, ROWS_PAD)
    i = tl.arange(0, HALF_PAD)
    j = tl.arange(0, REST_PAD)
    row_ok = (r < rows) & all_of(ok, r)
    base = ptr + r.to(tl.int64)[:, None] * row_stride
    half_ok = row_ok[:, None] & (i < ROT // 2)[None, :]
    tl.store(base + i[None, :], y1, mask=half_ok)
    tl.store(base + ROT // 2 + i[None, :], y2, mask=half_ok)
    tl.store(base + ROT + j[None, :], y3, mask=row_ok[:, None] & (j < HEAD_DIM - ROT)[None, :])


@triton.jit
def cos_sin(
    cos_ptr,
    sin_ptr,
    pos,
    stride_cos,
    dtype: tl.constexpr,
    ROT: tl.constexpr,
    HALF_PAD: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """The position's cos/sin halves, cast to the dtype (torch: `cos_cache[pos].to(dtype)`)."""
    i = tl.arange(0, HALF_PAD)
    ok = i < ROT // 2
    row = pos.to(tl.int64) * stride_cos
    c1 = tl.load(cos_ptr + row + i, mask=ok, other=0.0)
    s1 = tl.load(sin_ptr + row + i, mask=ok, other=0.0)
    c2 = tl.load(cos_ptr + row + ROT // 2 + i, mask=ok, other=0.0)
    s2 = tl.load(sin_ptr + row + ROT // 2 + i, mask=ok, other=0.0)
    return (
        round_to(c1, dtype, ROUND_BF16).to(tl.float32),
        round_to(s1, dtype, ROUND_BF16).to(tl.float32),
        round_to(c2, dtype, ROUND_BF16).to(tl.float32),
        round_to(s2, dtype, ROUND_BF16).to(tl.float32),
    )


@triton.jit
def qk_norm_rope_cache_kernel(
    qkv_ptr, positions_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, k_cache_ptr, v_cache_ptr,
    slot_mapping_ptr, q_out_ptr, eps, stride_qkv, stride_cos, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, num_heads, num_kv_heads,
    HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    ROT: tl.constexpr, HALF_PAD: tl.constexpr, REST_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HAS_NORM: tl.constexpr, INTERLEAVED: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """One token: q -> q_out [T, Hq, D]; k, v -> the caches at its slot (skipped if < 0)."""
    t = tl.program_id(0).to(tl.int64)
    dtype = q_out_ptr.dtype.element_ty
    pos = tl.load(positions_ptr + t)
    c1, s1, c2, s2 = cos_sin(cos_ptr, sin_ptr, pos, stride_cos, dtype, ROT, HALF_PAD,
                              ROUND_BF16)  # fmt: skip
    row = qkv_ptr + t * stride_qkv
    y1, y2, y3 = rope_rows(row, HEAD_DIM, num_heads, q_norm_ptr, eps, c1, s1, c2, s2,
                            HQ_PAD, HEAD_DIM, ROT, HALF_PAD, REST_PAD, HAS_NORM, INTERLEAVED,
                            dtype, ROUND_BF16)  # fmt: skip
    store_rows(q_out_ptr + t * num_heads * HEAD_DIM, HEAD_DIM, num_heads, y1, y2, y3, t >= 0,
                HQ_PAD, HEAD_DIM, ROT, HALF_PAD, REST_PAD)  # fmt: skip
    slot = tl.load(slot_mapping_ptr + t)
    blk, off = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    k_row = row + num_heads * HEAD_DIM
    y1, y2, y3 = rope_rows(k_row, HEAD_DIM, num_kv_heads, k_norm_ptr, eps, c1, s1, c2, s2,
                            HKV_PAD, HEAD_DIM, ROT, HALF_PAD, REST_PAD, HAS_NORM, INTERLEAVED,
                            dtype, ROUND_BF16)  # fmt: skip
    store_rows(k_cache_ptr + blk * stride_kb + off * stride_ks, stride_kh, num_kv_heads,
                y1, y2, y3, slot >= 0, HKV_PAD, HEAD_DIM, ROT, HALF_PAD, REST_PAD)  # fmt: skip
    h = tl.arange(0, HKV_PAD)
    d = tl.arange(0, D_PAD)
    v_ok = (h < num_kv_heads)[:, None] & (d < HEAD_DIM)[None, :]
    v = tl.load(k_row + num_kv_heads * HEAD_DIM + h[:, None] * HEAD_DIM + d[None, :], mask=v_ok)
    tl.store(v_cache_ptr + blk * stride_vb + off * stride_vs + h[:, None] * stride_vh
             + d[None, :], v, mask=v_ok & all_of(slot >= 0, v_ok.to(tl.int32)))  # fmt: skip


def prologue_warps(tile: int) -> int:
    """Warps for a program holding `tile` values of a row tile: 4 up to 4096 (Qwen3-30B-A3B's
    32 x 128 query heads: 56 registers, no spills on sm_90), more above (GLM-4.5's 96 x 128
    spilled at 4)."""
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
    qk_norm_rope_cache_kernel[(t,)](
        qkv, positions, cos_cache, sin_cache, qkv_norm, qkv_norm if k_norm is None else k_norm,
        k_cache, v_cache, slot_mapping, q, eps, qkv.stride(0), cos_cache.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3], num_heads, num_kv_heads,
        HQ_PAD=pad_pow2(num_heads), HKV_PAD=pad_pow2(num_kv_heads), HEAD_DIM=d,
        D_PAD=pad_pow2(d), ROT=rot, HALF_PAD=pad_pow2(rot // 2), REST_PAD=pad_pow2(d - rot),
        BLOCK_SIZE=k_cache.shape[1],
        HAS_NORM=q_norm is not None, INTERLEAVED=interleaved,
        ROUND_BF16=interpreting() and qkv.dtype == torch.bfloat16,
        num_warps=prologue_warps(pad_pow2(num_heads) * pad_pow2(d)), enable_fp_fusion=False,
    )  # fmt: skip
    return q
