"""Fused MoE in Triton: token-expert pairs sorted by expert, one grouped GEMM launch per projection.

The design of vLLM's and SGLang's ``fused_moe`` (itself after the MegaBlocks block-sparse
formulation, Gale et al., 2022): ``moe_align_block_size`` groups the ``T * k`` token-expert pairs
by expert and pads each group to a multiple of ``BLOCK_SIZE_M``, so that every M-block of the
sorted list belongs to one expert. ``fused_moe_kernel`` then runs, for each M-block and N-block,
``A[pair rows] @ W[expert].T`` with the block's expert weights, optionally scaled by the pairs'
``topk_weights``. ``fused_moe`` chains: align -> GEMM1 (``w13``) -> SwiGLU -> GEMM2 (``w2``, routed
weight applied) -> sum over the ``k`` slots of each token.

Weights are bf16/fp16/fp32, or INT4 group-wise (the layout of :mod:`quant.int4`: ``[E, N, K // 2]``
uint8, low nibble = even ``k``, fp32 scales ``[E, N, K // group_size]``, optional uint8 zero points,
implicit zero 8 when symmetric), dequantized in registers inside the K loop.

The plain torch version of the whole op is :func:`kernels.reference.fused_moe_reference`.
Triton is imported here, never by ``kernels/__init__.py``; on a machine without a GPU the kernels
run under ``TRITON_INTERPRET=1`` (set before ``triton`` is first imported).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MIN_BLOCK_SIZE = 16  # tl.dot needs every tile dimension >= 16


def _check_block_size(block_size: int) -> None:
    if (
        not isinstance(block_size, int)
        or block_size < MIN_BLOCK_SIZE
        or block_size & (block_size - 1)
    ):
        raise ValueError(
            f"block_size {block_size} must be a power of two >= {MIN_BLOCK_SIZE} (Triton tiles)"
        )


def max_num_tokens_padded(num_pairs: int, block_size: int, num_experts: int) -> int:
    """Static upper bound (pairs) on the padded length: each non-empty expert adds < block_size.

    At most ``min(num_experts, num_pairs)`` experts are non-empty; rounded up to ``block_size``.
    Depends on shapes only, so buffers and the launch grid do not depend on the routing.
    """
    bound = num_pairs + min(num_experts, num_pairs) * (block_size - 1)
    return triton.cdiv(max(bound, 1), block_size) * block_size


def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group token-expert pairs by expert, each group padded to a multiple of ``block_size``.

    Host-side bookkeeping in plain torch (vectorised: one stable argsort, a bincount and a
    scatter; no loop over experts or tokens). vLLM does the same in a CUDA kernel; here the cost
    is a few small torch ops, negligible next to the GEMMs.

    Args:
        topk_ids: ``[num_tokens, top_k]`` int32, expert ids; ids outside ``[0, num_experts)``
            (e.g. ``-1`` for experts of another rank) are dropped.
        block_size: pairs per M-block (``BLOCK_SIZE_M`` of the GEMM); a power of two >= 16.
        num_experts: experts of this rank, ``E``.

    Returns:
        ``sorted_token_ids``: ``[max_padded]`` int32, flattened pair indices ``t * top_k + j``
            grouped by ascending expert, stable within an expert (ascending pair index); each
            group padded to a multiple of ``block_size`` with the sentinel ``num_tokens * top_k``;
            the tail after ``num_tokens_post_padded`` is sentinel too.
        ``expert_ids``: ``[max_padded // block_size]`` int32, the expert of each M-block;
            ``-1`` for blocks past ``num_tokens_post_padded``.
        ``num_tokens_post_padded``: ``[1]`` int32, the padded length actually used.
        ``max_padded`` is :func:`max_num_tokens_padded` (a function of shapes only).

    Raises:
        ValueError: ``topk_ids`` is not a 2-D integer tensor, ``block_size`` is not a power of
            two >= 16, or ``num_experts`` < 1.
    """
    if topk_ids.dim() != 2 or topk_ids.is_floating_point():
        raise ValueError(f"topk_ids must be [num_tokens, top_k] int32, got {topk_ids.dtype}")
    _check_block_size(block_size)
    if num_experts < 1:
        raise ValueError(f"num_experts {num_experts} must be >= 1")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    max_padded = max_num_tokens_padded(num_pairs, block_size, num_experts)
    valid = (flat >= 0) & (flat < num_experts)
    keyed = torch.where(valid, flat, num_experts)  # invalid pairs sort last, then are cut
    order = torch.argsort(keyed, stable=True)
    counts = torch.bincount(keyed, minlength=num_experts + 1)[:num_experts]
    padded = (counts + block_size - 1) // block_size * block_size
    padded_ends = torch.cumsum(padded, 0)
    num_valid = int(counts.sum())
    pairs = order[:num_valid]
    experts = keyed[pairs]
    rank_in_expert = (
        torch.arange(num_valid, device=device) - (torch.cumsum(counts, 0) - counts)[experts]
    )
    dest = (padded_ends - padded)[experts] + rank_in_expert
    sorted_token_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_token_ids[dest] = pairs.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_size, device=device)
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True)
    expert_ids = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    total = padded_ends[-1:].to(torch.int32)
    return sorted_token_ids, expert_ids, total


@triton.jit
def _cast(x, dtype: tl.constexpr, ROUND_BF16: tl.constexpr):
    """``x.to(dtype)``; with ``ROUND_BF16``, fp32 rounded to nearest even bf16 first (finite x)."""
    if ROUND_BF16 and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def fused_moe_kernel(
    a_ptr, b_ptr, c_ptr, b_scale_ptr, b_zero_ptr, topk_weights_ptr,
    sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    N, K, num_valid_pairs, a_row_div,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_se, stride_sn, stride_sg,
    GROUP_SIZE: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr, WEIGHT_INT4: tl.constexpr, HAS_ZEROS: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,
):  # fmt: skip
    """One (M-block, N-block) tile of ``C[pair] = A[pair // a_row_div] @ W[expert].T``.

    Every pair row is at most one token-expert pair; sentinel rows (>= num_valid_pairs) are
    masked out of loads and stores. Row offsets are int64 so ``pairs * N`` may pass 2^31.
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
    b_base = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_SIZE_K):
        k = k0 + offs_k
        k_mask = k < K
        a = tl.load(
            a_rows + k[None, :] * stride_ak, mask=pair_mask[:, None] & k_mask[None, :], other=0.0
        )
        kn_mask = k_mask[:, None] & n_mask[None, :]
        if WEIGHT_INT4:
            packed = tl.load(b_base + (k // 2)[:, None] * stride_bk, mask=kn_mask, other=0)
            code = (packed.to(tl.int32) >> ((k % 2) * 4)[:, None]) & 0xF
            s_off = expert * stride_se + offs_n[None, :] * stride_sn
            s_off += (k // GROUP_SIZE)[:, None] * stride_sg
            scale = tl.load(b_scale_ptr + s_off, mask=kn_mask, other=0.0)
            if HAS_ZEROS:
                zero = tl.load(b_zero_ptr + s_off, mask=kn_mask, other=0).to(tl.float32)
            else:
                zero = 8.0
            b = _cast(((code.to(tl.float32) - zero) * scale), a.dtype, INTERPRET_BF16)
        else:
            b = tl.load(b_base + k[:, None] * stride_bk, mask=kn_mask, other=0.0)
        if INTERPRET_BF16:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b, input_precision="ieee")
    if MUL_ROUTED_WEIGHT:
        routed = tl.load(topk_weights_ptr + pair, mask=pair_mask, other=0.0)
        acc = acc * routed[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(
        c_ptrs,
        _cast(acc, c_ptr.dtype.element_ty, INTERPRET_BF16),
        mask=pair_mask[:, None] & n_mask[None, :],
    )


def _interpret_bf16(dtype: torch.dtype) -> bool:
    """Whether to work around the bf16 gaps of Triton 3.9's interpreter (``TRITON_INTERPRET=1``).

    The interpreter runs ``tl.dot`` as ``np.matmul`` on the raw bf16 bit patterns (numpy has no
    bfloat16), and casts fp32 -> bf16 by truncation where compiled Triton rounds to nearest even.
    So, there only, the kernel upcasts dot operands to fp32 (exact for bf16 values, the same as a
    bf16 MMA with fp32 accumulation) and rounds to nearest even itself before each bf16 cast.
    Compiled kernels keep bf16 operands (tensor cores) and Triton's own casts.
    """
    return dtype == torch.bfloat16 and bool(triton.knobs.runtime.interpret)


def _tile(dim: int, cap: int) -> int:
    return max(MIN_BLOCK_SIZE, min(cap, triton.next_power_of_2(dim)))


def invoke_fused_moe_kernel(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    topk_weights: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    *,
    top_k: int,
    mul_routed_weight: bool,
    w_scales: torch.Tensor | None = None,
    w_zeros: torch.Tensor | None = None,
    block_size_m: int = 16,
    block_size_n: int = 64,
    block_size_k: int = 64,
) -> None:
    """Launch :func:`fused_moe_kernel`: ``out[p] = A[p // top_k] @ W[expert(p)].T`` per pair ``p``.

    Args:
        a: ``[num_tokens, K]`` (rows shared by the ``top_k`` pairs of a token; GEMM1) or
            ``[num_pairs, K]`` with ``top_k=1`` (one row per pair; GEMM2); bf16, fp16 or fp32.
        w: ``[E, N, K]`` in ``a``'s dtype, or ``[E, N, K // 2]`` uint8 packed INT4 when
            ``w_scales`` is given (low nibble = even ``k``, :mod:`quant.int4`).
        out: ``[num_pairs, N]`` written in place (pairs that are dropped are left untouched).
        topk_weights: ``[num_tokens, top_k]`` float32, read when ``mul_routed_weight``
            (index = flattened pair index).
        sorted_token_ids, expert_ids, num_tokens_post_padded: from :func:`moe_align_block_size`
            with ``block_size == block_size_m``.
        top_k: pairs per row of ``a`` (the row of pair ``p`` is ``p // top_k``).
        mul_routed_weight: multiply each output row by its pair's routing weight.
        w_scales: ``[E, N, K // group_size]`` float32 INT4 scales, or ``None`` for plain weights.
        w_zeros: ``[E, N, K // group_size]`` uint8 zero points; ``None`` means symmetric (8).
        block_size_m, block_size_n, block_size_k: tile sizes (powers of two >= 16; N and K tiles
            are shrunk to the problem when smaller).

    Raises:
        ValueError: ``expert_ids`` does not match ``block_size_m``, or a shape does not fit.
    """
    if expert_ids.numel() * block_size_m != sorted_token_ids.numel():
        raise ValueError(
            f"expert_ids has {expert_ids.numel()} blocks, which does not fit "
            f"{sorted_token_ids.numel()} sorted ids with block_size_m {block_size_m}"
        )
    num_pairs, n = out.shape
    int4 = w_scales is not None
    k_dim = w.shape[2] * 2 if int4 else w.shape[2]
    if a.shape[1] != k_dim or w.shape[1] != n:
        raise ValueError(f"a {tuple(a.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)} mismatch")
    group_size = k_dim // w_scales.shape[2] if int4 else k_dim
    scales = w_scales if int4 else out  # unused pointers still need a tensor
    zeros = w_zeros if w_zeros is not None else scales
    tile_n, tile_k = _tile(n, block_size_n), _tile(k_dim, block_size_k)
    grid = (expert_ids.numel() * triton.cdiv(n, tile_n),)
    fused_moe_kernel[grid](
        a, w, out, scales, zeros, topk_weights,
        sorted_token_ids, expert_ids, num_tokens_post_padded,
        n, k_dim, num_pairs, top_k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1),
        scales.stride(0) if int4 else 0, scales.stride(1) if int4 else 0,
        scales.stride(2) if int4 else 0,
        GROUP_SIZE=group_size,
        BLOCK_SIZE_M=block_size_m, BLOCK_SIZE_N=tile_n, BLOCK_SIZE_K=tile_k,
        MUL_ROUTED_WEIGHT=mul_routed_weight, WEIGHT_INT4=int4, HAS_ZEROS=w_zeros is not None,
        INTERPRET_BF16=_interpret_bf16(a.dtype),
    )  # fmt: skip


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``[P, 2I]`` -> ``[P, I]``: ``silu(gate) * up`` in fp32, back to the input dtype."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def _fused_moe(
    hidden: torch.Tensor,
    w13: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    w2: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_size_m: int,
) -> torch.Tensor:
    num_tokens, top_k = topk_ids.shape
    hidden_size = hidden.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    if hidden.shape[0] != num_tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)}, topk_weights {tuple(topk_weights.shape)} and "
            f"topk_ids {tuple(topk_ids.shape)} disagree on num_tokens / top_k"
        )
    num_pairs = num_tokens * top_k
    two_inter = w13[0].shape[1]
    align = moe_align_block_size(topk_ids, block_size_m, w13[0].shape[0])
    weights = topk_weights.float().contiguous()
    gate_up = torch.empty(num_pairs, two_inter, dtype=hidden.dtype, device=hidden.device)
    invoke_fused_moe_kernel(
        hidden, w13[0], gate_up, weights, *align, top_k=top_k, mul_routed_weight=False,
        w_scales=w13[1], w_zeros=w13[2], block_size_m=block_size_m,
    )  # fmt: skip
    # Dropped pairs leave garbage in gate_up; their rows are never read by GEMM2.
    act = _swiglu(gate_up)
    down = torch.zeros(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    invoke_fused_moe_kernel(
        act, w2[0], down, weights, *align, top_k=1, mul_routed_weight=True,
        w_scales=w2[1], w_zeros=w2[2], block_size_m=block_size_m,
    )  # fmt: skip
    return down.view(num_tokens, top_k, hidden_size).float().sum(dim=1).to(hidden.dtype)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_size_m: int = 16,
) -> torch.Tensor:
    """Mixture of SwiGLU experts with two grouped GEMM launches; same contract as the reference.

    Args:
        hidden: ``[T, H]`` bf16, fp16 or fp32 activations, contiguous.
        w13: ``[E, 2I, H]`` in hidden's dtype: gate rows ``[0, I)``, up rows ``[I, 2I)``.
        w2: ``[E, H, I]`` down projection.
        topk_weights: ``[T, k]`` float32 routing weights.
        topk_ids: ``[T, k]`` int32 expert ids; ids outside ``[0, E)`` are skipped.
        block_size_m: pairs per M-block (power of two >= 16).

    Returns:
        ``[T, H]`` in hidden's dtype; the k slots are summed in fp32.

    Raises:
        ValueError: shapes disagree or ``block_size_m`` is not a power of two >= 16.
    """
    return _fused_moe(
        hidden, (w13, None, None), (w2, None, None), topk_weights, topk_ids, block_size_m
    )


def fused_moe_int4(
    hidden: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scales: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scales: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_zeros: torch.Tensor | None = None,
    w2_zeros: torch.Tensor | None = None,
    block_size_m: int = 16,
) -> torch.Tensor:
    """:func:`fused_moe` with INT4 group-wise weights (w4a16) dequantized in registers.

    Args:
        hidden: ``[T, H]`` bf16, fp16 or fp32 activations (the compute dtype).
        w13_packed: ``[E, 2I, H // 2]`` uint8 (:func:`quant.int4.quantize_int4` of ``w13``).
        w13_scales: ``[E, 2I, H // group_size]`` float32.
        w2_packed: ``[E, H, I // 2]`` uint8.
        w2_scales: ``[E, H, I // group_size]`` float32.
        topk_weights, topk_ids: as in :func:`fused_moe`.
        w13_zeros, w2_zeros: uint8 zero points shaped like the scales, or ``None`` (symmetric:
            implicit zero 8).
        block_size_m: pairs per M-block.

    Returns:
        ``[T, H]`` in hidden's dtype; equal, within GEMM rounding, to :func:`fused_moe` on
        the dequantized weights.
    """
    return _fused_moe(
        hidden, (w13_packed, w13_scales, w13_zeros), (w2_packed, w2_scales, w2_zeros),
        topk_weights, topk_ids, block_size_m,
    )  # fmt: skip
