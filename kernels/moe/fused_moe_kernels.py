"""The Triton kernel of `kernels.moe.fused_moe`: one grouped GEMM over token-expert pairs sorted by
expert, its weight tile loaders (bf16/fp16/fp32, INT4 group-wise, MXFP4) dequantizing in
registers, and the SwiGLU epilogue. The launchers, the alignment step and the layouts are
documented in kernels/moe/fused_moe.py; this file holds only the `@triton.jit` code.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _cast(x, dtype: tl.constexpr, ROUND_BF16: tl.constexpr):
    """``x.to(dtype)``; with ``ROUND_BF16``, fp32 rounded to nearest even bf16 first (finite x)."""
    if ROUND_BF16 and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _load_weight_tile(
    b_ptr, b_scale_ptr, b_zero_ptr, expert, rows, k, kn_mask,
    stride_be, stride_bn, stride_bk, stride_se, stride_sn, stride_sg,
    dtype: tl.constexpr, GROUP_SIZE: tl.constexpr, WEIGHT_FORMAT: tl.constexpr,
    HAS_ZEROS: tl.constexpr, INTERPRET_BF16: tl.constexpr,
):  # fmt: skip
    """``[BLOCK_K, BLOCK_N]`` tile ``W[expert, rows, k].T`` in ``dtype``, dequantized here.

    ``WEIGHT_FORMAT``: 0 plain; 1 INT4 (``(code - zero) * scale``, :mod:`quant.int4`);
    2 MXFP4 (E2M1 code times the E8M0 scale ``2^(byte - 127)``, OCP MX v1.0, :mod:`quant.mxfp4`).
    INT4 scales are read in their stored dtype (fp32, bf16 or fp16) and widened to fp32 (exact).
    Both 4-bit formats hold two codes per byte, low nibble = even ``k``. The MXFP4 decode builds
    the fp32 bits of each E2M1 value (``|v| = 2^(e - 1) * (1 + m / 2)``, or ``m / 2`` when the
    exponent field ``e`` is 0) and of the scale (byte 0: the fp32 subnormal ``2^-127``; byte 255:
    NaN), and multiplies in fp32: the same product as :func:`quant.mxfp4.dequantize_mxfp4`.
    """
    b_base = b_ptr + expert * stride_be + rows[None, :] * stride_bn
    if WEIGHT_FORMAT == 0:
        b = tl.load(b_base + k[:, None] * stride_bk, mask=kn_mask, other=0.0)
    else:
        packed = tl.load(b_base + (k // 2)[:, None] * stride_bk, mask=kn_mask, other=0)
        code = (packed.to(tl.int32) >> ((k % 2) * 4)[:, None]) & 0xF
        s_off = expert * stride_se + rows[None, :] * stride_sn
        s_off += (k // GROUP_SIZE)[:, None] * stride_sg
        if WEIGHT_FORMAT == 1:
            scale = tl.load(b_scale_ptr + s_off, mask=kn_mask, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                zero = tl.load(b_zero_ptr + s_off, mask=kn_mask, other=0).to(tl.float32)
            else:
                zero = 8.0
            w = (code.to(tl.float32) - zero) * scale
        else:
            code = code.to(tl.uint32)
            exponent = (code >> 1) & 3
            mantissa = code & 1
            bits = tl.where(
                exponent == 0, mantissa * 0x3F000000, ((exponent + 126) << 23) | (mantissa << 22)
            )
            bits = bits | ((code & 8) << 28)
            e8m0 = tl.load(b_scale_ptr + s_off, mask=kn_mask, other=127).to(tl.uint32)
            scale_bits = tl.where(
                e8m0 == 0, 0x00400000, tl.where(e8m0 == 255, 0x7FC00000, e8m0 << 23)
            )
            w = bits.to(tl.float32, bitcast=True) * scale_bits.to(tl.float32, bitcast=True)
        b = _cast(w, dtype, INTERPRET_BF16)
    return b


@triton.jit
def _dot(a, b, INTERPRET_BF16: tl.constexpr):
    """``a @ b`` accumulated in fp32 (see :func:`_interpret_bf16` for the interpreter case)."""
    if INTERPRET_BF16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def fused_moe_kernel(
    a_ptr, b_ptr, c_ptr, b_scale_ptr, b_zero_ptr, bias_ptr, topk_weights_ptr,
    sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    N, K, num_valid_pairs, a_row_div, swiglu_alpha, swiglu_limit,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_se, stride_sn, stride_sg, stride_bias_e, stride_bias_n,
    GROUP_SIZE: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr, WEIGHT_FORMAT: tl.constexpr, HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_LIMIT: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,
):  # fmt: skip
    """One (M-block, N-block) tile of ``C[pair] = epilogue(A[pair // a_row_div] @ W[expert].T)``.

    ``ACTIVATION`` 0: ``C = A @ W.T (+ bias)``, ``N`` = rows of ``W``. ``ACTIVATION`` 1 (SwiGLU)
    or 2 (gpt-oss's clamped SwiGLU): ``W`` has ``2N`` rows, gate rows ``[0, N)`` and up rows
    ``[N, 2N)``; the tile computes both halves for its ``N`` columns and stores
    ``act(gate, up)``, so GEMM1 writes the ``[pairs, I]`` activation directly. Biases are added
    before the activation; the routing weight multiplies last.

    Every pair row is at most one token-expert pair; sentinel rows (>= num_valid_pairs) are
    masked out of loads and stores. Pair, expert and row offsets are int64, so
    ``pairs * N`` or ``tokens * K`` may pass 2^31.
    """
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    if pid_m * BLOCK_SIZE_M >= tl.load(num_tokens_post_padded_ptr):
        return
    offs_m = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    pair = tl.load(sorted_token_ids_ptr + offs_m).to(tl.int64)
    pair_mask = pair < num_valid_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)).to(tl.int64)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_rows = a_ptr + (pair // a_row_div)[:, None] * stride_am
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_SIZE_K):
        k = k0 + offs_k
        k_mask = k < K
        a = tl.load(
            a_rows + k[None, :] * stride_ak, mask=pair_mask[:, None] & k_mask[None, :], other=0.0
        )
        kn_mask = k_mask[:, None] & n_mask[None, :]
        b = _load_weight_tile(
            b_ptr, b_scale_ptr, b_zero_ptr, expert, offs_n, k, kn_mask,
            stride_be, stride_bn, stride_bk, stride_se, stride_sn, stride_sg,
            a.dtype, GROUP_SIZE, WEIGHT_FORMAT, HAS_ZEROS, INTERPRET_BF16,
        )  # fmt: skip
        acc += _dot(a, b, INTERPRET_BF16)
        if ACTIVATION != 0:
            b_up = _load_weight_tile(
                b_ptr, b_scale_ptr, b_zero_ptr, expert, offs_n + N, k, kn_mask,
                stride_be, stride_bn, stride_bk, stride_se, stride_sn, stride_sg,
                a.dtype, GROUP_SIZE, WEIGHT_FORMAT, HAS_ZEROS, INTERPRET_BF16,
            )  # fmt: skip
            acc_up += _dot(a, b_up, INTERPRET_BF16)
    if HAS_BIAS:
        bias_rows = bias_ptr + expert * stride_bias_e
        acc += tl.load(bias_rows + offs_n * stride_bias_n, mask=n_mask, other=0.0).to(
            tl.float32
        )[None, :]
        if ACTIVATION != 0:
            acc_up += tl.load(
                bias_rows + (offs_n + N) * stride_bias_n, mask=n_mask, other=0.0
            ).to(tl.float32)[None, :]
    if ACTIVATION == 1:
        acc = acc * tl.sigmoid(acc) * acc_up
    elif ACTIVATION == 2:
        gate = acc
        up = acc_up
        if HAS_LIMIT:
            gate = tl.minimum(gate, swiglu_limit)
            up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
        acc = (up + 1.0) * (gate * tl.sigmoid(gate * swiglu_alpha))
    if MUL_ROUTED_WEIGHT:
        routed = tl.load(topk_weights_ptr + pair, mask=pair_mask, other=0.0)
        acc = acc * routed[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(
        c_ptrs,
        _cast(acc, c_ptr.dtype.element_ty, INTERPRET_BF16),
        mask=pair_mask[:, None] & n_mask[None, :],
    )
