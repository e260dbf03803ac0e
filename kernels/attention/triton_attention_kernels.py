"""The Triton kernels of :mod:`kernels.attention.triton_attention` (its docstring has the design,
the
sources and the launch layout); launched only through that module's functions.

Logits are kept in base 2 (pre-multiplied by log2(e), softmax by ``exp2``); rows with no visible
key keep m = -inf, l = 0, acc = 0 and store zeros (never NaN). With ``NUM_SPLITS > 1`` a program
stores its split's unnormalised (acc, m, l) and ``merge_kv_splits_kernel`` combines them (and the
sink column); with one split the sink starts each row as (m, l) = (sink, 1).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_common import round_to

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # sinks into base-2 logits


@triton.jit
def _dot(a, b, FP32_DOT: tl.constexpr):
    """``a @ b`` in fp32 accumulation; ``FP32_DOT`` upcasts the operands (fp32 inputs, and bf16
    under the interpreter, whose ``tl.dot`` multiplies raw bf16 bit patterns)."""
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _p_cast(p, dtype: tl.constexpr, FP32_DOT: tl.constexpr):
    """The probabilities as the P @ V operand: the value dtype (FlashAttention-2), or kept in
    fp32 where the dot runs in fp32 anyway."""
    if FP32_DOT:
        return p
    return p.to(dtype)


@triton.jit
def _online_softmax_step(s, m_i, l_i, acc):
    """FlashAttention-2's update for one tile of base-2 logits ``s`` [M, N] (-inf = masked).
    Returns the probabilities p [M, N] and the rescaled (m, l, acc); rows with no visible key
    yet keep m = -inf, l = 0 and acc = 0 (no NaN: the shift is taken as 0 there)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    return p, m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None]


@triton.jit
def _store_rows(out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_i, out_off, part_row, cols,
                mask, NUM_SPLITS: tl.constexpr, ROUND_BF16: tl.constexpr):
    """The normalised rows into ``out`` (one split), else the partial (acc, m, l) of this split
    at ``part_row`` = row * NUM_SPLITS + split for the reduction."""
    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + out_off, round_to(o, out_ptr.dtype.element_ty, ROUND_BF16), mask=mask)
    else:
        tl.store(part_acc_ptr + part_row[:, None] * cols.shape[0] + cols[None, :], acc, mask=mask)
        row_mask = tl.max(mask.to(tl.int32), 1) > 0
        tl.store(part_ml_ptr + part_row * 2, m_i, mask=row_mask)
        tl.store(part_ml_ptr + part_row * 2 + 1, l_i, mask=row_mask)


@triton.jit
def paged_attention_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    sinks_ptr, part_acc_ptr, part_ml_ptr, scale_log2, window, max_keys,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_bt, num_q_heads,
    GROUPS: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    FP32_DOT: tl.constexpr, ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """One (request, q tile [x split], kv head): rows = BLOCK_Q queries x G_PAD heads."""
    b = tl.program_id(0)
    q_block = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    if q_block * BLOCK_Q >= q_len:
        return
    rows = tl.arange(0, BLOCK_Q * G_PAD)
    qi = q_block * BLOCK_Q + rows // G_PAD
    head = kv_head * GROUPS + rows % G_PAD
    row_ok = (qi < q_len) & (rows % G_PAD < GROUPS)
    pos = seq_len - q_len + qi  # absolute position of each row's query
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    token = (q_start + qi).to(tl.int64)
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0)  # fmt: skip

    # keys [key_lo, key_hi) cover the tile's queries; split into NUM_SPLITS runs of whole tiles
    key_hi = tl.minimum(seq_len - q_len + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len), max_keys)
    key_lo = 0
    if HAS_WINDOW:
        key_lo = tl.maximum(seq_len - q_len + q_block * BLOCK_Q - window + 1, 0)
        key_lo = key_lo // BLOCK_N * BLOCK_N
    n_tiles = tl.cdiv(tl.maximum(key_hi - key_lo, 0), BLOCK_N)
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    tile_hi = tl.minimum(split * per_split + per_split, n_tiles)

    m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    if HAS_SINKS and NUM_SPLITS == 1:  # with splits, the reduction adds the sink column
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
        l_i += 1.0
    acc = tl.zeros([BLOCK_Q * G_PAD, HEAD_DIM_PAD], tl.float32)
    for t in range(split * per_split, tile_hi):
        kpos = key_lo + t * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = kpos < key_hi
        blk = tl.load(block_tables_ptr + b * stride_bt + kpos // BLOCK_SIZE, mask=k_ok, other=0)
        blk = blk.to(tl.int64)
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k_off = blk * stride_kb + (kpos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        k = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), FP32_DOT) * scale_log2
        visible = (kpos[None, :] <= pos[:, None]) & k_ok[None, :]
        if HAS_WINDOW:
            visible &= kpos[None, :] > pos[:, None] - window
        s = tl.where(visible, s, float("-inf"))
        p, m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc)
        v_off = blk * stride_vb + (kpos % BLOCK_SIZE) * stride_vs + kv_head * stride_vh
        v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc += _dot(_p_cast(p, v.dtype, FP32_DOT), v, FP32_DOT)

    out_off = token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    part_row = (token * num_q_heads + head) * NUM_SPLITS + split
    _store_rows(out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_i, out_off, part_row, d,
                q_mask, NUM_SPLITS, ROUND_BF16)  # fmt: skip


@triton.jit
def merge_kv_splits_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, sinks_ptr, num_heads, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, DIM: tl.constexpr,
    DIM_PAD: tl.constexpr, HAS_SINKS: tl.constexpr, ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """One (token, head) row: merges the splits' partial (acc, m, l) (flash-decoding) and the
    sink column, and stores acc / l."""
    row = tl.program_id(0)
    token, head = row // num_heads, row % num_heads
    sp = tl.arange(0, SPLITS_PAD)
    sp_ok = sp < NUM_SPLITS
    part = row.to(tl.int64) * NUM_SPLITS + sp
    m = tl.load(part_ml_ptr + part * 2, mask=sp_ok, other=float("-inf"))
    l_split = tl.load(part_ml_ptr + part * 2 + 1, mask=sp_ok, other=0.0)
    m_max = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        m_max = tl.maximum(m_max, sink)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_safe)
    l_tot = tl.sum(l_split * w, 0)
    if HAS_SINKS:
        l_tot += tl.math.exp2(sink - m_safe)
    d = tl.arange(0, DIM_PAD)
    acc = tl.load(part_acc_ptr + part[:, None] * DIM_PAD + d[None, :], mask=sp_ok[:, None],
                  other=0.0)  # fmt: skip
    o = tl.sum(acc * w[:, None], 0) / tl.where(l_tot == 0.0, 1.0, l_tot)
    dest = out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + d
    tl.store(dest, round_to(o, out_ptr.dtype.element_ty, ROUND_BF16), mask=d < DIM)


@triton.jit
def mla_decode_kernel(
    out_ptr, q_ptr, q_pe_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, part_acc_ptr,
    part_ml_ptr, scale_log2, max_keys, num_heads, stride_qb, stride_qh, stride_pb, stride_ph,
    stride_ob, stride_oh, stride_cb, stride_cs, stride_bt,
    RANK: tl.constexpr, RANK_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, FP32_DOT: tl.constexpr, ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """One (request, BLOCK_H heads, split): scores = q_nope . c_kv + q_pe . k_pe over the
    request's latents, values = c_kv (the latent's first RANK columns); q_nope and q_pe are
    read from their own pointers and strides (the two halves of one row, or two tensors)."""
    b = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_ok = h < num_heads
    r = tl.arange(0, RANK_PAD)
    e = tl.arange(0, ROPE_PAD)
    q_row = b.to(tl.int64) * stride_qb + h * stride_qh
    out_mask = h_ok[:, None] & (r < RANK)[None, :]
    q_nope = tl.load(q_ptr + q_row[:, None] + r[None, :], mask=out_mask, other=0.0)
    pe_row = b.to(tl.int64) * stride_pb + h * stride_ph
    q_pe = tl.load(q_pe_ptr + pe_row[:, None] + e[None, :],
                   mask=h_ok[:, None] & (e < ROPE)[None, :], other=0.0)  # fmt: skip
    key_hi = tl.minimum(tl.load(seq_lens_ptr + b), max_keys)
    n_tiles = tl.cdiv(tl.maximum(key_hi, 0), BLOCK_N)
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PAD], tl.float32)
    for t in range(split * per_split, tl.minimum(split * per_split + per_split, n_tiles)):
        kpos = t * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = kpos < key_hi
        blk = tl.load(block_tables_ptr + b * stride_bt + kpos // BLOCK_SIZE, mask=k_ok, other=0)
        row = blk.to(tl.int64) * stride_cb + (kpos % BLOCK_SIZE) * stride_cs
        c_kv = tl.load(cache_ptr + row[:, None] + r[None, :],
                       mask=k_ok[:, None] & (r < RANK)[None, :], other=0.0)  # fmt: skip
        k_pe = tl.load(cache_ptr + row[:, None] + RANK + e[None, :],
                       mask=k_ok[:, None] & (e < ROPE)[None, :], other=0.0)  # fmt: skip
        s = _dot(q_nope, tl.trans(c_kv), FP32_DOT) + _dot(q_pe, tl.trans(k_pe), FP32_DOT)
        s = tl.where(k_ok[None, :], s * scale_log2, float("-inf"))
        p, m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc)
        acc += _dot(_p_cast(p, c_kv.dtype, FP32_DOT), c_kv, FP32_DOT)
    out_off = b.to(tl.int64) * stride_ob + h[:, None] * stride_oh + r[None, :]
    part_row = (b.to(tl.int64) * num_heads + h) * NUM_SPLITS + split
    _store_rows(out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_i, out_off, part_row, r,
                out_mask, NUM_SPLITS, ROUND_BF16)  # fmt: skip
