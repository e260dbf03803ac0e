"""The CPU expert path for int4 weights: PyTorch's packed int4 matmul (w4a16), per expert.

This is the torch backend (`--kernel-backend fused_moe_int4=torch`, or no native build):
where the native kernel
builds, `QuantizedExperts` runs `kernels.moe.native.PackedQuantExperts` instead (float32
activations, exact float32 scales and zero points).

`torch._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)` computes
`x @ W.T` with `W = (q - 8) * scale + zero` per group of `group_size` input values, reading 4
bits per weight; it is the kernel gpt-fast and torchao use for int4 on CPU. With bfloat16
activations it beats a float32 dense GEMM for decode-sized batches (measured 79 vs 125 us for
8 x 512 @ 512 x 512 on 2 AVX2 cores); its float32-activation variant is far slower, so
activations are cast to bfloat16 around it. Results therefore match the dequantized float32
reference to bfloat16 precision, not bit for bit.
"""

from __future__ import annotations

import torch

from kernels.moe.activation import SILU_AND_MUL, SwiGLU
from kernels.moe.routing import combine_pairs, sort_pairs_by_expert

#: inner_k_tiles of the CPU int4 pack layout (2 is what the CPU kernel expects).
INNER_K_TILES = 2


def pack_int4_for_cpu(
    codes: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    zeros: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Repack one expert's weight for the CPU int4 matmul.

    The kernel dequantizes `(code - 8) * scale + offset` (checked against the dense product);
    `quant.int4`'s `(code - zero) * scale` is that with `offset = (8 - zero) * scale`, so
    asymmetric weights need no other path. The offset is rounded to bfloat16 with the scale.

    Args:
        codes: [N, K] unsigned int4 codes in [0, 15] (any integer dtype).
        scales: [N, K // group_size] float scales.
        group_size: input values per scale.
        zeros: [N, K // group_size] zero points in [0, 15] (asymmetric), or None (symmetric:
            `quant.int4`'s implicit zero point 8, offset 0).

    Returns:
        (packed weight for `torch._weight_int4pack_mm_for_cpu`, scales_and_zeros
        [K // group_size, N, 2] bfloat16: scale and offset per group and output row).
    """
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), INNER_K_TILES)
    scales = scales.float()
    offsets = torch.zeros_like(scales) if zeros is None else (8.0 - zeros.float()) * scales
    scales_and_zeros = torch.stack([scales.t(), offsets.t()], dim=-1)
    return packed, scales_and_zeros.to(torch.bfloat16).contiguous()


def int4_linear(x: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor], group_size: int):
    """x: [M, K] any float dtype -> [M, N] float32, through the packed int4 matmul."""
    packed, scales_and_zeros = weight
    y = torch._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16), packed, group_size, scales_and_zeros
    )
    return y.float()


def fused_moe_int4_cpu(
    hidden: torch.Tensor,
    w13: list[tuple[torch.Tensor, torch.Tensor]],
    w2: list[tuple[torch.Tensor, torch.Tensor]],
    group_size: int,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: SwiGLU = SILU_AND_MUL,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mixture of SwiGLU experts on packed int4 weights (see `fused_moe_reference`).

    Args:
        hidden: [T, H] activations.
        w13, w2: per expert, the `pack_int4_for_cpu` output of w13 [2I, H] and w2 [H, I].
        group_size: input values per scale.
        topk_weights: [T, k] float32; topk_ids: [T, k] int32, ids outside [0, E) skipped.
        activation: plain SwiGLU (default) or gpt-oss's clamped variant (applied in float32).
        b13: optional [E, 2I] gate/up bias; b2: optional [E, H] down bias (added in float32).

    Returns:
        [T, H] in hidden's dtype.
    """
    num_tokens, top_k = topk_ids.shape
    num_experts = len(w13)
    if num_tokens == 0:
        return torch.zeros_like(hidden)
    order, counts = sort_pairs_by_expert(topk_ids, num_experts)
    x = hidden[order // top_k].to(torch.bfloat16)
    y = torch.zeros(x.shape[0], hidden.shape[1], dtype=torch.float32)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        gate_up = int4_linear(x[start:end], w13[expert], group_size)
        if b13 is not None:
            gate_up += b13[expert].float()
        y[start:end] = int4_linear(activation(gate_up), w2[expert], group_size)
        if b2 is not None:
            y[start:end] += b2[expert].float()
        start = end
    y *= topk_weights.reshape(-1)[order, None]
    return combine_pairs(y, order, num_tokens, top_k).to(hidden.dtype)
