"""Fused MoE in Triton: token-expert pairs sorted by expert, one grouped GEMM launch per projection.

The design of vLLM's and SGLang's ``fused_moe`` (itself after the MegaBlocks block-sparse
formulation, Gale et al., 2022): ``moe_align_block_size`` groups the ``T * k`` token-expert pairs
by expert and pads each group to a multiple of ``BLOCK_SIZE_M``, so that every M-block of the
sorted list belongs to one expert. ``fused_moe_kernel`` then runs, for each M-block and N-block,
``A[pair rows] @ W[expert].T`` with the block's expert weights, optionally scaled by the pairs'
``topk_weights``. ``fused_moe`` chains: align -> GEMM1 (``w13``, with the SwiGLU in its epilogue:
each tile computes the gate and the up columns of its N-block and stores the activation) ->
GEMM2 (``w2``, routed weight applied) -> sum over the ``k`` slots of each token. The activation
is plain SwiGLU or gpt-oss's clamped variant (:class:`kernels.moe.activation.SwiGLU`), with optional
per-expert biases (gpt-oss), as in Hugging Face's ``GptOssExperts``.

Weights are bf16/fp16/fp32, or INT4 group-wise (the layout of :mod:`quant.int4`:
``[E, N, K // 2]`` uint8, low nibble = even ``k``, fp32 / bf16 / fp16 scales
``[E, N, K // group_size]`` as stored, optional uint8 zero points, implicit zero 8 when
symmetric), or MXFP4 (:mod:`quant.mxfp4`, OCP MX v1.0: E2M1 codes two per byte, low nibble =
even ``k``, one uint8 E8M0 scale per 32 values of ``K``), dequantized in
registers inside the K loop.

Tile sizes per shape come from :mod:`kernels.moe.fused_moe_configs`. Nothing in the op reads a
device value back to the host (buffers and the grid depend on shapes only), so a decode step
that calls it can be captured in a CUDA graph.

The plain torch version of the whole op is :func:`kernels.moe.reference.fused_moe_reference`.
Triton is imported here, never by ``kernels/__init__.py``; on a machine without a GPU the kernels
run under ``TRITON_INTERPRET=1`` (set before ``triton`` is first imported).
"""

from __future__ import annotations

import torch
import triton

from kernels.moe.activation import SILU_AND_MUL, SwiGLU
from kernels.moe.align_kernels import MAX_KERNEL_PAIRS, invoke_moe_align_block_size
from kernels.moe.fused_moe_configs import WEIGHT_FORMATS, MoeTileConfig, get_moe_config
from kernels.moe.fused_moe_kernels import fused_moe_kernel
from kernels.moe.reference import moe_align_block_size_reference
from kernels.moe.sum_kernels import moe_sum
from quant.mxfp4 import MXFP4_BLOCK_SIZE

#: Scale dtypes of INT4 weights the kernel reads (`quant.int4`; a checkpoint's 16-bit scales
#: stay 16-bit, issue 14).
INT4_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

MIN_BLOCK_SIZE = 16  # tl.dot needs every tile dimension >= 16
MIN_PACKED_BLOCK_K = 2 * MIN_BLOCK_SIZE  # 4-bit tiles: one dot per nibble, each BLOCK_K / 2 deep


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

    One Triton launch (:func:`kernels.moe.align_kernels.moe_align_block_size_kernel`, the
    single CUDA kernel of vLLM and SGLang written for Triton) where the torch version takes
    about 40 small ops; calls of more than `align_kernels.MAX_KERNEL_PAIRS` pairs (prefill
    sizes) take the torch version, :func:`kernels.moe.reference.moe_align_block_size_reference`
    (the same outputs). Every output shape depends on the input shapes only and nothing is
    read back to the host, so the call can be captured in a CUDA graph.

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
    if topk_ids.numel() > MAX_KERNEL_PAIRS:
        return moe_align_block_size_reference(topk_ids, block_size, num_experts)
    max_padded = max_num_tokens_padded(topk_ids.numel(), block_size, num_experts)
    return invoke_moe_align_block_size(topk_ids, block_size, num_experts, max_padded)


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


def _packed_tile_k(tile_k: int, group_size: int, k_dim: int) -> int:
    """The K tile of a packed 4-bit launch: at least `MIN_PACKED_BLOCK_K` (each nibble half of
    the tile feeds its own ``tl.dot``), and either a multiple or a divisor of ``group_size`` so
    that a tile holds whole groups or lies inside one (halved from ``tile_k`` until it does);
    any tile when K is one group.

    Raises:
        ValueError: no such tile (a group size that is not a multiple of 32 below the tile).
    """
    tile_k = max(tile_k, MIN_PACKED_BLOCK_K)
    if group_size >= k_dim:
        return tile_k
    while tile_k > MIN_PACKED_BLOCK_K and group_size % tile_k and tile_k % group_size:
        tile_k //= 2
    if group_size % tile_k and tile_k % group_size:
        raise ValueError(
            f"group_size {group_size} fits no K tile >= {MIN_PACKED_BLOCK_K} (needs a multiple "
            "or a power-of-two divisor of it)"
        )
    return tile_k


def _weight_format(w: torch.Tensor, w_scales: torch.Tensor | None) -> int:
    """0 plain, 1 INT4 (float scales), 2 MXFP4 (uint8 E8M0 scales); see ``_load_weight_tile``."""
    if w_scales is None:
        return 0
    if w.dtype != torch.uint8:
        raise ValueError(f"packed 4-bit weights must be uint8, got {w.dtype}")
    return 2 if w_scales.dtype == torch.uint8 else 1


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
    bias: torch.Tensor | None = None,
    activation: SwiGLU | None = None,
    block_size_m: int = 16,
    block_size_n: int = 64,
    block_size_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> None:
    """Launch :func:`fused_moe_kernel`: ``out[p] = act(A[p // top_k] @ W[expert(p)].T + bias)``.

    Args:
        a: ``[num_tokens, K]`` (rows shared by the ``top_k`` pairs of a token; GEMM1) or
            ``[num_pairs, K]`` with ``top_k=1`` (one row per pair; GEMM2); bf16, fp16 or fp32.
        w: ``[E, N_w, K]`` in ``a``'s dtype; or, when ``w_scales`` is given, packed 4-bit uint8
            ``[E, N_w, K // 2]`` (low nibble = even ``k``): INT4 (:mod:`quant.int4`) when
            ``w_scales`` is floating, MXFP4 (:mod:`quant.mxfp4`; ``[E, N_w, K // 32, 16]``
            blocks are accepted too) when ``w_scales`` is uint8.
        out: ``[num_pairs, N]`` written in place (pairs that are dropped are left untouched);
            ``N = N_w``, or ``N_w / 2`` with an ``activation``.
        topk_weights: ``[num_tokens, top_k]`` float32, read when ``mul_routed_weight``
            (index = flattened pair index).
        sorted_token_ids, expert_ids, num_tokens_post_padded: from :func:`moe_align_block_size`
            with ``block_size == block_size_m``.
        top_k: pairs per row of ``a`` (the row of pair ``p`` is ``p // top_k``).
        mul_routed_weight: multiply each output row by its pair's routing weight.
        w_scales: INT4: ``[E, N_w, K // group_size]`` float32, bfloat16 or float16 (read as
            stored, widened to fp32 in registers); MXFP4: ``[E, N_w, K // 32]`` uint8 E8M0;
            ``None`` for plain weights.
        w_zeros: INT4 ``[E, N_w, K // group_size]`` uint8 zero points; ``None``: symmetric (8).
        bias: optional ``[E, N_w]`` (any float dtype), added in fp32 before the activation.
        activation: ``None`` (plain GEMM) or a :class:`kernels.moe.activation.SwiGLU` applied in
            the epilogue to gate rows ``[0, N)`` and up rows ``[N, 2N)`` of ``w``.
        block_size_m, block_size_n, block_size_k: tile sizes (powers of two >= 16; N and K tiles
            are shrunk to the problem when smaller); see `kernels.moe.fused_moe_configs`. A
            4-bit K tile is at least 32 and holds whole groups or lies in one
            (:func:`_packed_tile_k`).
        num_warps, num_stages: compiled-Triton launch options (the interpreter ignores them).

    Raises:
        ValueError: ``expert_ids`` does not match ``block_size_m``, a shape or dtype does not
            fit, or a 4-bit group size fits no K tile (not a multiple of 32 below the tile).
    """
    if expert_ids.numel() * block_size_m != sorted_token_ids.numel():
        raise ValueError(
            f"expert_ids has {expert_ids.numel()} blocks, which does not fit "
            f"{sorted_token_ids.numel()} sorted ids with block_size_m {block_size_m}"
        )
    weight_format = _weight_format(w, w_scales)
    if weight_format == 2 and w.dim() == 4:
        w = w.flatten(2)  # [E, N_w, K // 32, 16] blocks -> [E, N_w, K // 2]
    num_pairs, n = out.shape
    n_w = w.shape[1]
    k_dim = w.shape[2] * 2 if weight_format else w.shape[2]
    if a.shape[1] != k_dim or n_w != (2 * n if activation is not None else n):
        raise ValueError(
            f"a {tuple(a.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)} mismatch "
            f"(activation {activation})"
        )
    group_size = k_dim // w_scales.shape[2] if weight_format else k_dim
    if weight_format and group_size * w_scales.shape[2] != k_dim:
        raise ValueError(f"scales {tuple(w_scales.shape)} do not split K={k_dim} into equal groups")
    if weight_format == 2 and group_size != MXFP4_BLOCK_SIZE:
        raise ValueError(f"MXFP4 scales {tuple(w_scales.shape)} are not one per 32 of K={k_dim}")
    if bias is not None and tuple(bias.shape) != (w.shape[0], n_w):
        raise ValueError(f"bias {tuple(bias.shape)} must be [E, N_w] = {(w.shape[0], n_w)}")
    if weight_format == 1 and w_scales.dtype not in INT4_SCALE_DTYPES:
        raise ValueError(f"INT4 scales must be one of {INT4_SCALE_DTYPES}, got {w_scales.dtype}")
    scales = w_scales if weight_format else out  # unused pointers still need a tensor
    zeros = w_zeros if w_zeros is not None else scales
    bias_t = bias if bias is not None else out
    if activation is None:
        act_kind, alpha, limit = 0, 1.0, 0.0
    else:
        act_kind = 2 if activation.clamped else 1
        alpha = float(activation.alpha) if activation.clamped else 1.0
        limit = float(activation.limit) if activation.limit is not None else 0.0
    tile_n, tile_k = _tile(n, block_size_n), _tile(k_dim, block_size_k)
    if weight_format:
        tile_k = _packed_tile_k(tile_k, group_size, k_dim)
    grid = (expert_ids.numel() * triton.cdiv(n, tile_n),)
    fused_moe_kernel[grid](
        a, w, out, scales, zeros, bias_t, topk_weights,
        sorted_token_ids, expert_ids, num_tokens_post_padded,
        n, k_dim, num_pairs, top_k, alpha, limit,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1),
        scales.stride(0) if weight_format else 0, scales.stride(1) if weight_format else 0,
        scales.stride(2) if weight_format else 0,
        bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
        GROUP_SIZE=group_size,
        BLOCK_SIZE_M=block_size_m, BLOCK_SIZE_N=tile_n, BLOCK_SIZE_K=tile_k,
        MUL_ROUTED_WEIGHT=mul_routed_weight, WEIGHT_FORMAT=weight_format,
        HAS_ZEROS=w_zeros is not None, HAS_BIAS=bias is not None, ACTIVATION=act_kind,
        HAS_LIMIT=activation is not None and activation.limit is not None,
        INTERPRET_BF16=_interpret_bf16(a.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


_Weight = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def _fused_moe(
    hidden: torch.Tensor,
    w13: _Weight,
    w2: _Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_size_m: int | None,
    activation: SwiGLU,
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
    config: MoeTileConfig | None,
    addend: torch.Tensor | None = None,
) -> torch.Tensor:
    num_tokens, top_k = topk_ids.shape
    hidden_size = hidden.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(hidden) if addend is None else addend.clone()
    if hidden.shape[0] != num_tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)}, topk_weights {tuple(topk_weights.shape)} and "
            f"topk_ids {tuple(topk_ids.shape)} disagree on num_tokens / top_k"
        )
    num_pairs = num_tokens * top_k
    two_inter = w13[0].shape[1]
    if config is None:
        fmt = WEIGHT_FORMATS[_weight_format(w13[0], w13[1])]
        config = get_moe_config(num_tokens, two_inter // 2, hidden_size, fmt)
    if block_size_m is None:
        block_size_m = config.BLOCK_SIZE_M
    tiles = {
        "block_size_m": block_size_m, "block_size_n": config.BLOCK_SIZE_N,
        "block_size_k": config.BLOCK_SIZE_K, "num_warps": config.num_warps,
        "num_stages": config.num_stages,
    }  # fmt: skip
    num_experts = w13[0].shape[0]
    align = moe_align_block_size(topk_ids, block_size_m, num_experts)
    weights = topk_weights
    if weights.dtype != torch.float32 or not weights.is_contiguous():
        weights = weights.float().contiguous()
    # GEMM1 with the activation in its epilogue: [pairs, I]. Dropped pairs leave garbage rows
    # that GEMM2 never reads (it walks the same sorted ids).
    act = torch.empty(num_pairs, two_inter // 2, dtype=hidden.dtype, device=hidden.device)
    invoke_fused_moe_kernel(
        hidden, w13[0], act, weights, *align, top_k=top_k, mul_routed_weight=False,
        w_scales=w13[1], w_zeros=w13[2], bias=b13, activation=activation, **tiles,
    )  # fmt: skip
    # GEMM2 writes every kept pair's row; dropped pairs' rows stay unwritten, and moe_sum
    # (one launch) skips them as it adds each token's k rows in fp32.
    down = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    invoke_fused_moe_kernel(
        act, w2[0], down, weights, *align, top_k=1, mul_routed_weight=True,
        w_scales=w2[1], w_zeros=w2[2], bias=b2, **tiles,
    )  # fmt: skip
    return moe_sum(down.view(num_tokens, top_k, hidden_size), topk_ids, num_experts, addend)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_size_m: int | None = None,
    *,
    activation: SwiGLU = SILU_AND_MUL,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    config: MoeTileConfig | None = None,
    addend: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mixture of SwiGLU experts with two grouped GEMM launches; same contract as the reference.

    Args:
        hidden: ``[T, H]`` bf16, fp16 or fp32 activations, contiguous.
        w13: ``[E, 2I, H]`` in hidden's dtype: gate rows ``[0, I)``, up rows ``[I, 2I)``.
        w2: ``[E, H, I]`` down projection.
        topk_weights: ``[T, k]`` float32 routing weights.
        topk_ids: ``[T, k]`` int32 expert ids; ids outside ``[0, E)`` are skipped.
        block_size_m: pairs per M-block (power of two >= 16); None: the config's.
        activation: plain SwiGLU (default) or gpt-oss's clamped variant, applied in fp32 in
            GEMM1's epilogue.
        b13: optional ``[E, 2I]`` gate/up bias; b2: optional ``[E, H]`` down bias (gpt-oss).
        config: tile sizes and launch options; None: `kernels.moe.fused_moe_configs.get_moe_config`
            for (T, I, H, weight format).
        addend: optional ``[T, H]`` in hidden's dtype added to the result in `moe_sum`'s
            launch (the shared experts' output), rounded as ``result + addend`` in torch.

    Returns:
        ``[T, H]`` in hidden's dtype; the k slots are summed in fp32.

    Raises:
        ValueError: shapes disagree or ``block_size_m`` is not a power of two >= 16.
    """
    return _fused_moe(
        hidden, (w13, None, None), (w2, None, None), topk_weights, topk_ids, block_size_m,
        activation, b13, b2, config, addend,
    )  # fmt: skip


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
    block_size_m: int | None = None,
    *,
    activation: SwiGLU = SILU_AND_MUL,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    config: MoeTileConfig | None = None,
) -> torch.Tensor:
    """:func:`fused_moe` with INT4 group-wise weights (w4a16) dequantized in registers.

    Args:
        hidden: ``[T, H]`` bf16, fp16 or fp32 activations (the compute dtype).
        w13_packed: ``[E, 2I, H // 2]`` uint8 (:func:`quant.int4.quantize_int4` of ``w13``).
        w13_scales: ``[E, 2I, H // group_size]`` float32, bfloat16 or float16 (a checkpoint's
            16-bit scales as stored).
        w2_packed: ``[E, H, I // 2]`` uint8.
        w2_scales: ``[E, H, I // group_size]``, the same dtype.
        topk_weights, topk_ids: as in :func:`fused_moe`.
        w13_zeros, w2_zeros: uint8 zero points shaped like the scales, or ``None`` (symmetric:
            implicit zero 8).
        block_size_m, activation, b13, b2, config: as in :func:`fused_moe`.

    Returns:
        ``[T, H]`` in hidden's dtype; equal, within GEMM rounding, to :func:`fused_moe` on
        the dequantized weights.
    """
    return _fused_moe(
        hidden, (w13_packed, w13_scales, w13_zeros), (w2_packed, w2_scales, w2_zeros),
        topk_weights, topk_ids, block_size_m, activation, b13, b2, config,
    )  # fmt: skip


def fused_moe_mxfp4(
    hidden: torch.Tensor,
    w13_blocks: torch.Tensor,
    w13_scales: torch.Tensor,
    w2_blocks: torch.Tensor,
    w2_scales: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_size_m: int | None = None,
    *,
    activation: SwiGLU = SILU_AND_MUL,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    config: MoeTileConfig | None = None,
) -> torch.Tensor:
    """:func:`fused_moe` with MXFP4 weights (OCP MX v1.0, the gpt-oss layout) dequantized in
    registers: E2M1 codes decoded by bit operations, times the E8M0 block scale, in fp32.

    Args:
        hidden: ``[T, H]`` bf16, fp16 or fp32 activations (the compute dtype).
        w13_blocks: ``[E, 2I, H // 32, 16]`` (or ``[E, 2I, H // 2]``) uint8, two E2M1 codes per
            byte, low nibble = even element (:func:`quant.mxfp4.quantize_mxfp4` of ``w13``).
        w13_scales: ``[E, 2I, H // 32]`` uint8 E8M0 exponents (``2^(byte - 127)``).
        w2_blocks: ``[E, H, I // 32, 16]`` (or ``[E, H, I // 2]``) uint8.
        w2_scales: ``[E, H, I // 32]`` uint8.
        topk_weights, topk_ids, block_size_m, activation, b13, b2, config: as in
            :func:`fused_moe`.

    Returns:
        ``[T, H]`` in hidden's dtype; equal, within GEMM rounding, to :func:`fused_moe` on
        ``quant.mxfp4.dequantize_mxfp4(blocks, scales, hidden.dtype)`` (the same values).

    Raises:
        ValueError: non-uint8 blocks or scales, or shapes that do not fit.
    """
    for name, t in (("w13_scales", w13_scales), ("w2_scales", w2_scales)):
        if t.dtype != torch.uint8:
            raise ValueError(f"{name} must be uint8 E8M0 exponents, got {t.dtype}")
    return _fused_moe(
        hidden, (w13_blocks, w13_scales, None), (w2_blocks, w2_scales, None),
        topk_weights, topk_ids, block_size_m, activation, b13, b2, config,
    )  # fmt: skip
