"""The Triton kernel of `kernels.moe.fused_moe`: one grouped GEMM over token-expert pairs sorted by
expert, its weight tile loaders (bf16/fp16/fp32, INT4 group-wise, MXFP4) dequantizing in
registers, and the SwiGLU epilogue. The launchers, the alignment step and the layouts are
documented in kernels/moe/fused_moe.py; this file holds only the `@triton.jit` code.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_common import round_to


@triton.jit
def _load_weight_tile(
    b_ptr, expert, rows, k, kn_mask, stride_be, stride_bn, stride_bk,
):  # fmt: skip
    """``[BLOCK_K, BLOCK_N]`` tile ``W[expert, rows, k].T`` of plain (bf16/fp16/fp32) weights."""
    b_base = b_ptr + expert * stride_be + rows[None, :] * stride_bn
    return tl.load(b_base + k[:, None] * stride_bk, mask=kn_mask, other=0.0)


@triton.jit
def _load_group_scales(
    b_scale_ptr, b_zero_ptr, expert, rows, n_mask, k0, K, stride_se, stride_sn, stride_sg,
    GROUP_SIZE: tl.constexpr, BLOCK_SIZE_K: tl.constexpr, WEIGHT_FORMAT: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
):  # fmt: skip
    """Scales (and INT4 zero points) of the groups of ``W[expert, rows, k0:k0 + BLOCK_K]``:
    ``[G, 1, BLOCK_N, 1]`` fp32 each, ``G = ceil(BLOCK_K / GROUP_SIZE)``, one load per group (not
    per weight). INT4 scales are read in their stored dtype (fp32, bf16 or fp16) and widened
    (exact); MXFP4 E8M0 bytes are decoded to ``2^(byte - 127)`` (byte 0: the fp32 subnormal
    ``2^-127``; byte 255: NaN; OCP MX v1.0). Groups past K read as scale 0 / 1.0 (unused: their
    weights and activations are masked to 0). ``zero`` is ``scale`` when there are none.
    """
    GROUPS: tl.constexpr = (BLOCK_SIZE_K + GROUP_SIZE - 1) // GROUP_SIZE
    g = k0 // GROUP_SIZE + tl.arange(0, GROUPS)
    s_off = expert * stride_se + rows[None, :] * stride_sn + g[:, None] * stride_sg
    s_mask = (g < K // GROUP_SIZE)[:, None] & n_mask[None, :]
    if WEIGHT_FORMAT == 1:
        scale = tl.load(b_scale_ptr + s_off, mask=s_mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zero = tl.load(b_zero_ptr + s_off, mask=s_mask, other=0).to(tl.float32)
        else:
            zero = scale
    else:
        e8m0 = tl.load(b_scale_ptr + s_off, mask=s_mask, other=127).to(tl.uint32)
        bits = tl.where(e8m0 == 0, 0x00400000, tl.where(e8m0 == 255, 0x7FC00000, e8m0 << 23))
        scale = bits.to(tl.float32, bitcast=True)
        zero = scale
    return scale[:, None, :, None], zero[:, None, :, None]


@triton.jit
def _dequant_packed(
    packed, scale, zero, dtype: tl.constexpr, WEIGHT_FORMAT: tl.constexpr,
    HAS_ZEROS: tl.constexpr, INTERPRET_BF16: tl.constexpr,
):  # fmt: skip
    """The weights ``(W[k even], W[k odd])``, ``[BLOCK_K // 2, BLOCK_N]`` each in ``dtype`` (fp32
    holding bf16 values under ``INTERPRET_BF16``), of a packed ``[BLOCK_K // 2, BLOCK_N]`` uint8
    tile (low nibble = even ``k``), with ``scale``/``zero`` from :func:`_load_group_scales`
    broadcast over each group's rows.

    INT4: ``(code - zero) * scale`` in fp32 (implicit zero 8 when symmetric; :mod:`quant.int4`).
    MXFP4: the E2M1 value (OCP MX v1.0: sign, 2 exponent bits with bias 1, 1 mantissa bit;
    ``|v| = 2^(e - 1) * (1 + m / 2)``, or ``m / 2`` when ``e`` is 0) times the scale, in fp32, as
    :func:`quant.mxfp4.dequantize_mxfp4`. The three magnitude bits are placed at the top of the
    fp32 exponent/mantissa fields, which reads as ``|v| * 2^-126`` (a subnormal when ``e`` is 0);
    one multiply by ``2^126`` is then exact (PTX ``mul.f32`` keeps subnormals; no ``.ftz``).
    Both nibbles go through one decode (joined on a trailing axis of 2, in the same registers).
    """
    GROUPS: tl.constexpr = scale.shape[0]
    shape4: tl.constexpr = (GROUPS, packed.shape[0] // GROUPS, packed.shape[1], 2)
    code = tl.reshape(tl.join(packed & 0xF, packed >> 4), shape4)
    if WEIGHT_FORMAT == 1:
        if HAS_ZEROS:
            w = (code.to(tl.float32) - zero) * scale
        else:
            w = (code.to(tl.float32) - 8.0) * scale
    else:
        code = code.to(tl.uint32)
        bits = ((code & 7) << 22) | ((code & 8) << 28)
        w = (bits.to(tl.float32, bitcast=True) * 8.507059173023462e37) * scale  # 2^126
    w = round_to(w, dtype, INTERPRET_BF16)
    if INTERPRET_BF16:
        w = w.to(tl.float32)  # the interpreter's dot takes fp32 (see _interpret_bf16)
    w_lo, w_hi = tl.split(w)
    return tl.reshape(w_lo, packed.shape), tl.reshape(w_hi, packed.shape)


@triton.jit
def _packed_gemm(
    a_rows, pair_mask, b_ptr, b_scale_ptr, b_zero_ptr, expert, rows, n_mask, K,
    stride_ak, stride_be, stride_bn, stride_bk, stride_se, stride_sn, stride_sg,
    GROUP_SIZE: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr, WEIGHT_FORMAT: tl.constexpr, HAS_ZEROS: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,
):  # fmt: skip
    """``[BLOCK_M, BLOCK_N]`` fp32 ``A[pairs] @ W[expert, rows].T`` over all of K, for packed
    4-bit weights ``W`` ``[E, N_w, K // 2]`` uint8 (INT4 ``WEIGHT_FORMAT`` 1, :mod:`quant.int4`;
    MXFP4 2, :mod:`quant.mxfp4`; two codes per byte, low nibble = even ``k``).

    Per K step the weights are read once, as a ``[BLOCK_K // 2, BLOCK_N]`` uint8 tile contiguous
    along K (16-byte ``cp.async``, pipelined over ``num_stages`` like the activations), split into
    low/high nibbles in registers, dequantized to A's dtype (the same values as the formats'
    dequantize functions, rounded once), and multiplied with the even/odd columns of the A tile:
    ``acc += A[:, 0::2] @ W_lo + A[:, 1::2] @ W_hi``. The next step's scales are loaded one
    step ahead (scales of 1-2 bytes are too narrow for ``cp.async``).
    """
    HALF: tl.constexpr = BLOCK_SIZE_K // 2
    # K is a multiple of GROUP_SIZE; written so, the compiler knows K // 2's divisibility and
    # keeps the masked byte loads 16 bytes wide.
    k_half = (K // GROUP_SIZE) * (GROUP_SIZE // 2)
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    offs_kp = tl.arange(0, HALF)
    b_rows = b_ptr + expert * stride_be + rows[None, :] * stride_bn
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    scale, zero = _load_group_scales(
        b_scale_ptr, b_zero_ptr, expert, rows, n_mask, 0, K, stride_se, stride_sn, stride_sg,
        GROUP_SIZE, BLOCK_SIZE_K, WEIGHT_FORMAT, HAS_ZEROS,
    )  # fmt: skip
    for k0 in range(0, K, BLOCK_SIZE_K):
        k = k0 + offs_k
        a = tl.load(
            a_rows + k[None, :] * stride_ak, mask=pair_mask[:, None] & (k < K)[None, :], other=0.0
        )
        kp = tl.multiple_of(k0 // 2, HALF) + offs_kp
        packed = tl.load(
            b_rows + kp[:, None] * stride_bk, mask=(kp < k_half)[:, None] & n_mask[None, :], other=0
        )
        next_scale, next_zero = _load_group_scales(
            b_scale_ptr, b_zero_ptr, expert, rows, n_mask, k0 + BLOCK_SIZE_K, K,
            stride_se, stride_sn, stride_sg, GROUP_SIZE, BLOCK_SIZE_K, WEIGHT_FORMAT, HAS_ZEROS,
        )  # fmt: skip
        w_lo, w_hi = _dequant_packed(
            packed, scale, zero, a.dtype, WEIGHT_FORMAT, HAS_ZEROS, INTERPRET_BF16
        )
        if INTERPRET_BF16:
            a = a.to(tl.float32)
        a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_SIZE_M, HALF, 2)))
        acc = tl.dot(a_even, w_lo, acc, input_precision="ieee")
        acc = tl.dot(a_odd, w_hi, acc, input_precision="ieee")
        scale, zero = next_scale, next_zero
    return acc


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
    if WEIGHT_FORMAT == 0:
        for k0 in range(0, K, BLOCK_SIZE_K):
            k = k0 + offs_k
            k_mask = k < K
            a = tl.load(
                a_rows + k[None, :] * stride_ak,
                mask=pair_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            kn_mask = k_mask[:, None] & n_mask[None, :]
            b = _load_weight_tile(
                b_ptr, expert, offs_n, k, kn_mask, stride_be, stride_bn, stride_bk
            )
            acc += _dot(a, b, INTERPRET_BF16)
            if ACTIVATION != 0:
                b_up = _load_weight_tile(
                    b_ptr, expert, offs_n + N, k, kn_mask, stride_be, stride_bn, stride_bk
                )
                acc_up += _dot(a, b_up, INTERPRET_BF16)
    else:
        # GEMM1's gate and up tiles in two K loops, not one: half the dequantized weights
        # live in registers at a time (the A rows are re-read, from L2)
        acc = _packed_gemm(
            a_rows, pair_mask, b_ptr, b_scale_ptr, b_zero_ptr, expert, offs_n, n_mask, K,
            stride_ak, stride_be, stride_bn, stride_bk, stride_se, stride_sn, stride_sg,
            GROUP_SIZE, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, WEIGHT_FORMAT, HAS_ZEROS,
            INTERPRET_BF16,
        )  # fmt: skip
        if ACTIVATION != 0:
            acc_up = _packed_gemm(
                a_rows, pair_mask, b_ptr, b_scale_ptr, b_zero_ptr, expert, offs_n + N, n_mask,
                K, stride_ak, stride_be, stride_bn, stride_bk, stride_se, stride_sn, stride_sg,
                GROUP_SIZE, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, WEIGHT_FORMAT, HAS_ZEROS,
                INTERPRET_BF16,
            )  # fmt: skip
    if HAS_BIAS:
        bias_rows = bias_ptr + expert * stride_bias_e
        bias_gate = tl.load(bias_rows + offs_n * stride_bias_n, mask=n_mask, other=0.0)
        acc += bias_gate.to(tl.float32)[None, :]
        if ACTIVATION != 0:
            bias_up = tl.load(bias_rows + (offs_n + N) * stride_bias_n, mask=n_mask, other=0.0)
            acc_up += bias_up.to(tl.float32)[None, :]
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
        round_to(acc, c_ptr.dtype.element_ty, INTERPRET_BF16),
        mask=pair_mask[:, None] & n_mask[None, :],
    )
